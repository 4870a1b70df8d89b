"""From a command line to a training config: find the TOML file, split launcher flags from dotted
overrides, load and validate. Used by `stalwart train`, the worker entry point and the launcher, so
argv is parsed in one place."""

from __future__ import annotations

from pathlib import Path

from stalwart.config.core import ConfigError, load
from stalwart.config.job import JobConfig
from stalwart.config.render import help_text

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def find_config(name: str) -> Path:
    """A config given as a path, or by name from ./configs or the repository's configs/."""
    p = Path(name)
    if p.is_file():
        return p
    for base in (Path("configs"), REPO_CONFIGS):
        for candidate in (base / name, base / f"{name}.toml"):
            if candidate.is_file():
                return candidate
    shipped = sorted(f.stem for f in REPO_CONFIGS.glob("*.toml")) if REPO_CONFIGS.is_dir() else []
    import difflib

    key = name.lower().replace("-", "_").removesuffix(".toml")
    guess = [s for s in shipped if s == key] or difflib.get_close_matches(key, shipped, n=1)
    hint = f"did you mean '{guess[0]}'? " if guess else ""
    raise ConfigError(f"config '{name}' not found ({hint}a TOML path, or one of: {', '.join(shipped)})")


def split_args(argv: list[str], flags: dict[str, bool]) -> tuple[dict[str, str | bool], list[str]]:
    """Pull the command's own flags out of argv; the rest are dotted config overrides.

    ``flags`` maps a flag name to whether it takes a value.
    """
    found: dict[str, str | bool] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg.partition("=")
        if name in flags:
            if flags[name]:
                if inline:
                    found[name] = inline
                    i += 1
                elif i + 1 < len(argv):
                    found[name] = argv[i + 1]
                    i += 2
                else:
                    raise ConfigError(f"{name} needs a value")
            else:
                found[name] = True
                i += 1
            continue
        rest.append(arg)
        i += 1
    return found, rest


def load_job(config: str | None, overrides: list[str]) -> JobConfig:
    return load(JobConfig, find_config(config) if config else None, overrides)


def job_help(command: str, intro: str) -> str:
    return f"{intro}\n\nConfiguration (TOML [section] key = value, or --section.key VALUE; CLI > file > defaults):\n" \
           + help_text(JobConfig)


# `stalwart train`'s own flags (everything else on its command line is a dotted config override).
TRAIN_FLAGS = {"--config": True, "--nproc-per-node": True, "--nproc_per_node": True, "--controller": False,
               "--device": True}


def parse_train_argv(argv: list[str]) -> tuple[dict[str, str | bool], JobConfig]:
    """``stalwart train`` / ``-m stalwart.train`` arguments -> (launcher flags, validated config)."""
    opts, overrides = split_args(argv, TRAIN_FLAGS)
    if "--device" in opts:  # the short form every model-running command takes; the setting is training.device
        overrides = [*overrides, "--training.device", str(opts["--device"])]
    return opts, load_job(opts.get("--config"), overrides)  # type: ignore[arg-type]
