"""The sandbox's configuration: the limits every program runs under (`[sandbox]`, which an RL run's tree
holds too) and the sandbox service's (`[service]`)."""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.config.core import option, section


@dataclass
class SandboxConfig:
    wall_seconds: float = option("Wall-clock limit of one test case; past it the case's processes are killed "
                                 "(and the whole sandbox once all its cases' limits are spent).",
                                 5.0, min=0.1)
    cpu_seconds: int = option("CPU-time limit of one test case (RLIMIT_CPU, whole seconds).", 2, min=1)
    memory_mb: int = option("Address-space limit of every process in the sandbox (RLIMIT_AS), MiB.", 256, min=16)
    processes: int = option("Processes and threads a program may run at once, itself included (RLIMIT_NPROC "
                                "in the sandbox's user namespace).", 16, min=1)
    file_size_mb: float = option("Largest file a program may write, stdout included (RLIMIT_FSIZE), MiB.", 1.0,
                                 min=0.001)
    open_files: int = option("Open file descriptors per process (RLIMIT_NOFILE).", 32, min=8)
    python: str = option("Interpreter that runs the programs, inside the sandbox ('auto' = the system's "
                         "/usr/bin/python3 or /usr/local/bin/python3).", "auto")
    warm: int = option("Sandboxes kept started ahead of need (namespaces, mounts, the interpreter and the runner's "
                       "imports done), each waiting for a request: a program then starts with a fork.", 2, min=0)
    reuse: int = option("Requests one warm sandbox serves, one after another, before a fresh one replaces it (each "
                        "from a pristine fork of its runner, with every process killed and /tmp, /dev/shm and "
                        "System V IPC emptied between them; 1 = a sandbox per request).", 64, min=1)
    max_sandboxes: int = option("Sandboxes alive at once at most on this host (0 = as many as memory allows); one "
                                "more is refused (the service answers 429), never started.", 0, min=0)
    memory_reserve_mb: int = option("No sandbox starts while the host has less memory available than this "
                                    "(MemAvailable), MiB: the refusal comes before the OOM killer would.", 1024, min=0)


@dataclass
class SandboxServiceConfig:
    host: str = option("Address `stalwart sandbox serve` listens on. Loopback by default: whoever reaches the "
                       "service can run programs in its sandboxes.", "127.0.0.1")
    port: int = option("Port of the sandbox service (0 = any free port; the address is printed at start).", 8077,
                       min=0, max=65535)
    concurrency: int = option("Sandboxes the service runs at once (0 = two per CPU core).", 0, min=0)
    queue: int = option("Requests the service holds waiting beyond those running; a request past them is answered "
                        "429 with Retry-After (back-pressure: the client tries another service or waits).", 64, min=0)
    retry_after_s: float = option("Retry-After of a 429 (busy) answer, seconds.", 1.0, min=0.0)
    max_cases: int = option("Test cases one program may carry (a request with more is refused, 413).", 64, min=1)
    max_programs: int = option("Programs one batch request may carry, run one after another in one sandbox (a "
                               "request with more is refused, 413).", 32, min=1)
    max_request_mb: float = option("Largest request body, MiB (a larger one is refused unread, 413).", 4.0,
                                   min=0.001)


@dataclass
class SandboxOnlyConfig:
    """What `stalwart sandbox` reads: the sandbox section and, with --serve, the service's."""
    sandbox: SandboxConfig = section(SandboxConfig, "Where generated programs run: bubblewrap plus rlimits.")
    service: SandboxServiceConfig = section(SandboxServiceConfig, "`--serve`: the sandbox as an HTTP service.")
