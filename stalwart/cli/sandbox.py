"""`stalwart sandbox`: the code sandbox on its own (`stalwart/sandbox/`), apart from RL.

`stalwart sandbox run --program FILE --tests FILE` runs one program against one test file and prints
one JSON line: reward, passed, total, reason; `stalwart sandbox serve` runs the sandbox as an HTTP
service (``sandbox/service.py``). `stalwart rl sandbox` is the same command under its older name
(``--serve`` for ``serve``).
"""

from __future__ import annotations

from pathlib import Path

from stalwart.config import ConfigError, help_text, load
from stalwart.config.loading import split_args
from stalwart.config.sandbox import SandboxOnlyConfig

USAGE = """usage: stalwart sandbox run --program FILE --tests FILE [--sandbox.key VALUE ...]
       stalwart sandbox serve [--service.port N] [--service.key VALUE ...] [--sandbox.key VALUE ...]
       (`stalwart rl sandbox [--serve]` is the same command under its older name)

`stalwart sandbox run`

Runs a Python program (reads stdin, writes stdout) against a JSON list of {"input": str, "output": str}
cases in the sandbox (bubblewrap: no network, read-only /usr only, private /tmp; rlimits on CPU,
memory, processes, file size and open files; a wall-clock timeout) and prints one JSON line
{"reward": passed/total, "passed": n, "total": n, "reason": "..."}. A case passes when the program's
stdout, stripped, equals its output, stripped.

`stalwart sandbox serve` runs the same sandbox as an HTTP service (loopback by default) that RL reward
workers on other hosts call (`--workers.sandbox_urls`): POST /v1/score with {"program": str, "cases":
[...]} answers that JSON verdict; GET /health, GET /metrics (Prometheus). `service.concurrency`
requests run at once and `service.queue` more wait; past them a request gets 429 with Retry-After.
`stalwart bench sandbox` measures it (throughput, start-up, --concurrent N programs alive at once)."""


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


def _help() -> int:
    print(USAGE + "\n\nSandbox limits and the service (--sandbox.key / --service.key VALUE):\n"
          + help_text(SandboxOnlyConfig))
    return 0


def run_main(argv: list[str]) -> int:
    """`stalwart sandbox run`: one program against one test file, one JSON line."""
    from stalwart.sandbox.local import Sandbox, parse_cases

    found, overrides = split_args(argv, {"--program": True, "--tests": True})
    cfg = load(SandboxOnlyConfig, None, overrides)
    program = _read("--program", found.get("--program"))
    cases = parse_cases(_read("--tests", found.get("--tests")), f"--tests {found['--tests']}")
    print(Sandbox(cfg.sandbox).score(program, cases).to_json())
    return 0


def serve_main(argv: list[str], name: str = "stalwart sandbox") -> int:
    """`stalwart sandbox serve`: the service until SIGINT/SIGTERM; ``name`` starts its lines."""
    cfg = load(SandboxOnlyConfig, None, argv)
    from stalwart.sandbox.local import Sandbox
    from stalwart.sandbox.service import serve

    serve(Sandbox(cfg.sandbox), cfg.service, name)
    return 0


def alias_main(argv: list[str]) -> int:
    """`stalwart rl sandbox [--serve] ...`: the older spelling of `run` and `serve`."""
    if any(a in ("-h", "--help") for a in argv):
        return _help()
    found, rest = split_args(argv, {"--serve": False})
    if not found.get("--serve"):
        return run_main(rest)
    if any(a.split("=")[0] in ("--program", "--tests") for a in rest):
        raise ConfigError("--serve takes programs over HTTP: drop --program and --tests")
    return serve_main(rest, "stalwart rl sandbox")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        return _help()
    command, rest = argv[0], argv[1:]
    if any(a in ("-h", "--help") for a in rest):
        return _help()
    if command == "run":
        return run_main(rest)
    if command == "serve":
        return serve_main(rest)
    raise ConfigError(f"unknown sandbox command '{command}' (run, serve). {USAGE.splitlines()[0]}")
