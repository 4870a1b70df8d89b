from pathlib import Path

import pytest

from conftest import unapplied_file_values
from stalwart.config.loading import find_config
from stalwart.config import ConfigError, load, to_toml, undocumented_fields
from stalwart.config.job import JobConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.toml"))


def test_expected_configs_ship():
    names = {p.stem for p in SHIPPED}
    assert {"debug", "default", "llama3_1b", "llama3_8b"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_parses(path):
    from stalwart.config.rl import RLConfig

    cfg = load(RLConfig if path.stem.startswith("rl_") else JobConfig, path)  # rl_*: `stalwart rl` configs
    assert unapplied_file_values(cfg, path) == []  # every value the file sets is the one loaded


def test_unknown_key_names_closest_valid_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nstpes = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'training.stpes': did you mean 'training.steps'"):
        load(JobConfig, f)
    with pytest.raises(ConfigError, match="did you mean 'optimizer.lr'"):
        load(JobConfig, None, ["--optimizer.lrr", "1"])
    with pytest.raises(ConfigError, match="unknown config key 'trainig'"):
        load(JobConfig, None, ["--trainig.steps", "1"])


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="training.steps: expected an integer, got 'ten'"):
        load(JobConfig, None, ["--training.steps", "ten"])
    with pytest.raises(ConfigError, match="training.steps: 0 is below the minimum 1"):
        load(JobConfig, None, ["--training.steps", "0"])
    with pytest.raises(ConfigError, match="optimizer.name: 'adamm' is not one of .*did you mean 'adamw'"):
        load(JobConfig, None, ["--optimizer.name", "adamm"])
    with pytest.raises(ConfigError, match="data.val_fraction: 0.9 is above the maximum 0.5"):
        load(JobConfig, None, ["--data.val_fraction", "0.9"])
    for bad in ("nan", "inf", "-inf"):  # float() takes them, and they pass every range check
        with pytest.raises(ConfigError, match=f"optimizer.lr: expected a finite number, got '{bad}'"):
            load(JobConfig, None, ["--optimizer.lr", bad])


def test_a_config_file_that_is_not_text_is_one_error(tmp_path):
    f = tmp_path / "c.toml"
    f.write_bytes(b"\xff\xfe[training]\n")
    with pytest.raises(ConfigError, match="not valid TOML \\(not UTF-8 text at byte 0\\)"):
        load(JobConfig, f, [])


def test_non_finite_numbers_in_a_file_are_refused(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[optimizer]\nlr = nan\n")
    with pytest.raises(ConfigError, match="optimizer.lr: expected a finite number, got nan"):
        load(JobConfig, f, [])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="global_batch .* multiple of .*micro_batch"):
        load(JobConfig, None, ["--training.global_batch", "6", "--training.micro_batch", "4"])


def test_precedence_cli_over_file_over_defaults(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nsteps = 70\nglobal_batch = 16\n[optimizer]\nlr = 0.5\n")
    cfg = load(JobConfig, f, ["--training.steps", "90", "--model.flavor=debug"])
    assert cfg.training.steps == 90  # CLI beats file
    assert cfg.training.global_batch == 16  # file beats default
    assert cfg.optimizer.lr == 0.5
    assert cfg.model.flavor == "debug"
    assert cfg.training.micro_batch == JobConfig().training.micro_batch  # default


def test_toml_round_trip(tmp_path):
    cfg = load(JobConfig, find_config("default"), ["--data.path", "some/dir", "--model.sliding_window", "64"])
    f = tmp_path / "resolved.toml"
    f.write_text(to_toml(cfg))
    assert load(JobConfig, f) == cfg


def test_every_field_is_documented():
    assert undocumented_fields(JobConfig) == []


def test_missing_config_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="config 'nope' not found"):
        find_config("nope")


def test_a_short_run_clamps_the_warmup_with_a_note_and_names_a_config_by_its_spelling():
    from stalwart.train.optim import LRSchedule

    cfg = load(JobConfig, find_config("default"), ["--training.steps", "3"])  # the file says warmup_steps = 20
    assert cfg.notes() == ["note: scheduler.warmup_steps (20) exceeds training.steps (3): the warmup is clamped "
                           "to 3 steps"]
    assert [LRSchedule(cfg.scheduler, 1.0, 3).factor(s) for s in range(3)] == [1 / 3, 2 / 3, 1.0]
    assert load(JobConfig, find_config("default")).notes() == []
    with pytest.raises(ConfigError, match="did you mean 'llama3_8b'"):
        find_config("llama3-8b")


@pytest.mark.parametrize("name", ["llama3_1b", "llama3_8b"])
def test_llama_recipes_train_on_real_data_with_selective_ac_and_profiling(name):
    cfg = load(JobConfig, REPO / "configs" / f"{name}.toml")
    assert Path(cfg.data.path).is_absolute()  # a prepared dataset, not the bundled corpus
    assert cfg.data.tokenizer.endswith("tokenizer.json")  # Llama 3's tokenizer, given by path
    assert cfg.parallelism.activation_checkpoint == "selective"
    assert cfg.profile.window is not None and cfg.profile.window[0] >= 10  # past the first, unsteady steps
    assert cfg.data.seq_len == 8192 and cfg.checkpoint.interval > 0
