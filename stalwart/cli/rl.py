"""`stalwart rl`: reinforcement-learning post-training tools.

`stalwart rl sandbox --program FILE --tests FILE` runs one program against one test file in the
sandbox the reward workers use and prints one JSON line: reward, passed, total, reason;
`stalwart rl sandbox --serve` runs that sandbox as an HTTP service (``rl/sandbox_service.py``).
"""

from __future__ import annotations

from pathlib import Path

from stalwart.cli.extras import require
from stalwart.config import ConfigError, help_text, load
from stalwart.config.loading import find_config, split_args
from stalwart.config.rl import RLConfig, SandboxOnlyConfig

USAGE = """usage: stalwart rl --config FILE|NAME [--device auto|cpu|cuda] [--section.key VALUE ...]
       stalwart rl sandbox --program FILE --tests FILE [--sandbox.key VALUE ...]
       stalwart rl sandbox --serve [--service.port N] [--service.key VALUE ...] [--sandbox.key VALUE ...]

`stalwart rl --config rl_code` fine-tunes a small policy on a few examples of a verifiable code task, then
trains it with GRPO on one controller driving generator, trainer and reward-worker actor meshes; it writes
a run directory (metrics.jsonl with reward_mean per step, summary.json with final_reward_mean on held-out
problem instances). It needs Monarch, from the 'controller' extra (`make train` does not install it).

`stalwart rl sandbox`

Runs a Python program (reads stdin, writes stdout) against a JSON list of {"input": str, "output": str}
cases in the reward sandbox (bubblewrap: no network, read-only /usr only, private /tmp; rlimits on CPU,
memory, processes, file size and open files; a wall-clock timeout) and prints one JSON line
{"reward": passed/total, "passed": n, "total": n, "reason": "..."}. A case passes when the program's
stdout, stripped, equals its output, stripped.

`stalwart rl sandbox --serve` runs the same sandbox as an HTTP service (loopback by default) that reward
workers on other hosts call (`--workers.sandbox_urls`): POST /v1/score with {"program": str, "cases":
[...]} answers that JSON verdict; GET /health, GET /metrics (Prometheus). `service.concurrency` programs
run at once and `service.queue` more wait; past them a request gets 429 with Retry-After."""


def _read(flag: str, value: str | bool | None) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{flag} FILE is required")
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"{flag}: {path} is not a file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag}: cannot read {path} as UTF-8 text ({e})") from None


def sandbox_main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n\nSandbox limits and the service (--sandbox.key / --service.key VALUE):\n"
              + help_text(SandboxOnlyConfig))
        return 0
    from stalwart.rl.sandbox import Sandbox, parse_cases

    found, overrides = split_args(argv, {"--program": True, "--tests": True, "--serve": False})
    cfg = load(SandboxOnlyConfig, None, overrides)
    if found.get("--serve"):
        if "--program" in found or "--tests" in found:
            raise ConfigError("--serve takes programs over HTTP: drop --program and --tests")
        from stalwart.rl.sandbox_service import serve

        serve(Sandbox(cfg.sandbox), cfg.service)
        return 0
    program = _read("--program", found.get("--program"))
    cases = parse_cases(_read("--tests", found.get("--tests")), f"--tests {found['--tests']}")
    print(Sandbox(cfg.sandbox).score(program, cases).to_json())
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "sandbox":
        return sandbox_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nOptions (--section.key VALUE):\n" + help_text(RLConfig))
        return 0
    if not argv[0].startswith("-"):
        raise ConfigError(f"unknown rl command '{argv[0]}'. {USAGE.splitlines()[0]}")
    found, overrides = split_args(argv, {"--config": True, "--device": True})
    if "--device" in found:  # the short form every model-running command takes; the setting is workers.device
        overrides = [*overrides, "--workers.device", str(found["--device"])]
    config = found.get("--config")
    cfg = load(RLConfig, find_config(config) if isinstance(config, str) else None, overrides)
    require("monarch", "RL post-training (one controller driving actor meshes)")
    from stalwart.rl.driver import run_rl_job

    return run_rl_job(cfg)
