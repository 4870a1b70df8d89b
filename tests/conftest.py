"""Shared test helpers: run the real CLI in a subprocess (forked from a preloaded interpreter:
tests/preloaded_cli.py), and a small real-text corpus.

Every test belongs to exactly one tier (markers registered in pyproject.toml):

- ``unit``: pure logic in the pytest process; no subprocesses, no worker processes, no browser.
  ``make test-fast`` runs this tier (under two minutes on 2 CPU cores): run it on every change.
- ``multiproc``: real worker processes (gloo groups, spawned, crashed or killed children) that do not
  go through the ``stalwart`` CLI.
- ``e2e``: end to end through the real CLI (``stalwart train ...``), a browser, network namespaces or
  mounts.
- ``gpu``: the same code on CUDA (``make test-gpu``); skipped, with the reason, where there is no CUDA.

``make test`` (what CI runs) runs all three. A test without a tier, or with two, fails collection.
Prefer one ``pytestmark = pytest.mark.<tier>`` per file; mark single tests where a file mixes tiers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TIERS = ("unit", "multiproc", "e2e", "gpu")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything: every collected test must choose
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            bad.append(f"  {item.nodeid}: {'no tier marker' if not tiers else 'several tiers ' + ', '.join(tiers)}")
    if bad:
        raise pytest.UsageError(
            "every test needs exactly one tier marker, one of " + ", ".join(f"@pytest.mark.{t}" for t in TIERS)
            + " (see tests/conftest.py; prefer a module-level `pytestmark = pytest.mark.<tier>`):\n"
            + "\n".join(bad))


class _XdistSchedule:
    """How `make test` shares two workers (pytest-xdist, ``--dist loadgroup`` in pyproject.toml). A test goes
    to whichever worker is free, except that the tests sharing a module-scoped fixture (a training run, a
    server) go to one worker together, so the fixture is built once per session instead of once per
    worker that gets one of them. The longest tier goes first: the end-to-end tests start at once and the
    last minutes are short unit tests filling both workers, not one long test holding a worker while the
    other idles. (Registered on workers only; trylast: after pytest's own reordering for fixtures.)"""

    ORDER = {"e2e": 0, "multiproc": 1, "gpu": 2, "unit": 3}
    SHARED_SCOPES = ("module", "class", "package")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if config.getvalue("loadgroup"):
            for item in items:
                defs = getattr(item, "_fixtureinfo", None)
                if defs and any(d[-1].scope in self.SHARED_SCOPES for d in defs.name2fixturedefs.values() if d):
                    self._group(item, item.nodeid.split("::")[0])
        items.sort(key=lambda item: self.ORDER[next(m.name for m in item.iter_markers() if m.name in TIERS)])

    @staticmethod
    def _group(item: pytest.Item, group: str) -> None:
        """What ``pytest.mark.xdist_group(group)`` does: loadgroup schedules by the node id's ``@`` suffix.
        NOTE: pytest-xdist 3.8.0 writes that suffix to ``item._nodeid``, which pytest 9 no longer reads (it
        keeps a ``NodeId`` in ``item._id``), so the mark is silently ignored there; this sets the one that
        pytest reads."""
        if hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{group}")
        else:
            item._nodeid = f"{item.nodeid}@{group}"


def pytest_configure(config: pytest.Config) -> None:
    """One data cache (stalwart.data.cache) per test session, shared by its xdist workers and the CLI
    runs they start (they inherit the environment): text is tokenized once per session, and no session
    sees another's entries or the user's ~/.cache."""
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(_XdistSchedule(), "stalwart-xdist-schedule")
    if hasattr(config, "workerinput") or os.environ.get("STALWART_TEST_CACHE_OWNER"):
        return  # an xdist worker: the controller made it
    import tempfile

    os.environ["STALWART_CACHE"] = tempfile.mkdtemp(prefix="stalwart-test-cache-")
    # Compiled blocks are kept across sessions (Inductor's cache is keyed by the graph, the torch version and
    # its settings, so an entry is never stale): the tests that compile pay the cold compile once per machine.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "stalwart-tests-inductor"))
    os.environ["STALWART_TEST_CACHE_OWNER"] = str(os.getpid())


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("STALWART_TEST_CACHE_OWNER") == str(os.getpid()) and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(os.environ.pop("STALWART_CACHE"), ignore_errors=True)
        os.environ.pop("STALWART_TEST_CACHE_OWNER", None)


# A small slice of the standard library: real text, quick to tokenize.
SMALL_CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "json")

# Overrides that make a training run take seconds on 2 cores.
TINY_RUN = [
    "--model.flavor", "debug", "--data.path", SMALL_CORPUS, "--data.vocab_size", "384",
    "--data.tokenizer_train_mb", "0.1", "--data.seq_len", "32", "--data.val_fraction", "0.2",
    "--training.global_batch", "4", "--training.micro_batch", "2", "--scheduler.warmup_steps", "2",
    "--eval.batches", "1", "--eval.interval", "0", "--sample.max_new_tokens", "8",
    "--metrics.peak_tflops", "0.1", "--metrics.progress", "false",
    # Layout parity holds to 1e-5 in float32; 'auto' picks bfloat16 on a CPU whose bf16 matmul is faster.
    "--training.dtype", "float32",
    # Multi-process tests exercise FSDP sharding; the automatic choice (replicate when it fits) is tested
    # by name in tests/test_layout_choice.py and tests/test_parallel_parity.py.
    "--parallelism.data_parallel", "shard",
    # Eager: a compiled block's start-up (seconds even when cached) would dominate a test of seconds, and a
    # long-running test (a server's trainer) could make 'auto' compile. Compile is tested by name
    # (tests/test_compile.py, the 'compile' layout of tests/test_parallel_parity.py).
    "--parallelism.compile", "false",
]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


_preloaded: list = []  # this process's PreloadedCli, once started (None: fresh interpreters)


def _preloaded_cli():
    if not _preloaded:
        from preloaded_cli import PreloadedCli

        server = None if os.environ.get("STALWART_TEST_FRESH_CLI") == "1" else PreloadedCli(cli_env(), REPO)
        if server is not None and not server.ready():
            server.close()
            server = None
        _preloaded.append(server)
    return _preloaded[0]


def popen_cli(*args: str, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen([python, -m, stalwart, *args], **kwargs)`` (environment ``cli_env()`` and
    working directory the repository unless given), forked from a preloaded interpreter
    (tests/preloaded_cli.py) unless ``STALWART_TEST_FRESH_CLI=1``."""
    kwargs.setdefault("env", cli_env())
    kwargs.setdefault("cwd", REPO)
    cmd = [sys.executable, "-m", "stalwart", *args]
    server = _preloaded_cli()
    if server is not None:
        try:
            return server.popen(cmd, **kwargs)
        except OSError:  # the server is gone (killed from outside): a fresh interpreter from now on
            _preloaded[0] = None
    return subprocess.Popen(cmd, **kwargs)


def run_cli(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m stalwart ARGS`` to its end, output captured (``popen_cli``)."""
    from preloaded_cli import run

    proc = run(lambda **kw: popen_cli(*args, **kw), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"stalwart {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def tiny_hf(root: Path, steps: int) -> Path:
    """A tiny model trained ``steps`` steps into ``root/run`` and exported as a Hugging Face directory ``root/hf``."""
    run_cli("train", "--run.dir", str(root / "run"), *TINY_RUN, "--training.steps", str(steps), "--model.max_seq_len",
            "128", "--sample.max_new_tokens", "0", "--launch.nproc_per_node", "1")
    run_cli("export", "--run", str(root / "run"), "--format", "hf", "--out", str(root / "hf"))
    return root / "hf"


def read_metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return lines


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss (the last line wins if a step was logged twice)."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def step_fingerprints(run_dir: Path) -> dict[int, str]:
    """step -> state fingerprint (weights, optimizer state, RNG, data position; stalwart.train.fingerprint),
    the last line winning if a step was logged twice."""
    return {m["step"]: m["fingerprint"] for m in read_metrics(run_dir) if "fingerprint" in m}


def assert_same_states(a: Path, b: Path, skip: tuple[int, ...] = ()) -> None:
    """Two runs went bit for bit alike: every common step's loss and whole-state fingerprint are equal
    (``skip``: steps left out), and they have the same steps. Names the first step that differs."""
    la, lb = step_losses(a), step_losses(b)
    fa, fb = step_fingerprints(a), step_fingerprints(b)
    assert fa and sorted(fa) == sorted(la), f"{a}: steps without a state fingerprint"
    assert sorted(la) == sorted(lb), (sorted(la), sorted(lb))
    for step in sorted(la):
        if step not in skip:
            assert (la[step], fa[step]) == (lb[step], fb[step]), f"the runs differ first at step {step}"


def _spawned_rank(rank: int, world: int, target, cases: list, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    for i, case in enumerate(cases):
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{i}", rank=rank, world_size=world)
        try:
            result = target(case, rank, world)
        finally:
            dist.destroy_process_group()
        with open(f"{tmp}/case{i}-rank{rank}.json", "w") as f:
            json.dump(result, f)


def spawn_gloo(tmp_path: Path, world: int, target, cases: list) -> list[list]:
    """Run ``target(case, rank, world)`` for each case on ``world`` spawned ranks, each case in a fresh gloo
    group; returns every case's JSON results, one per rank. ``target`` is a module-level function."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned_rank, args=(world, target, cases, str(tmp_path)), nprocs=world, start_method="spawn")
    return [[json.loads((tmp_path / f"case{i}-rank{r}.json").read_text()) for r in range(world)]
            for i in range(len(cases))]


def unapplied_file_values(cfg, path: Path) -> list[str]:
    """Dotted keys set in the TOML file ``path`` whose value the loaded config ``cfg`` does not hold."""
    import tomllib

    from stalwart.config import to_dict

    def walk(raw: dict, loaded: dict, prefix: str) -> list[str]:
        out = []
        for key, value in raw.items():
            name, got = prefix + key, loaded.get(key)
            if isinstance(value, dict):
                out += walk(value, got if isinstance(got, dict) else {}, name + ".")
            elif got != value:
                out.append(f"{name}: file says {value!r}, loaded {got!r}")
        return out

    return walk(tomllib.loads(Path(path).read_text()), to_dict(cfg), "")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
