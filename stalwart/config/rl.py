"""The `stalwart rl` configuration tree. So far: the sandbox that runs generated programs."""

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


@dataclass
class RLConfig:
    sandbox: SandboxConfig = section(SandboxConfig, "Where generated programs run: bubblewrap plus rlimits.")
