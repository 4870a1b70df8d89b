"""`stalwart train`: validate the config, then run one worker in-process or launch N under supervision.

Multi-node jobs use standard torchrun rendezvous instead of --nproc-per-node:
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m stalwart.train --config llama3_8b
"""

from __future__ import annotations

from stalwart.cli.extras import require
from stalwart.config.core import ConfigError
from stalwart.config.loading import job_help, parse_train_argv
from stalwart.runtime.settings import launched_by_torchrun

INTRO = """usage: stalwart train [--config FILE_OR_NAME] [--nproc-per-node N] [--controller] [--section.key VALUE ...]

Train a model. With --nproc-per-node N > 1 (or launch.nproc_per_node in the config) the workers are
started through torch's elastic launcher; under torchrun, use `torchrun ... -m stalwart.train ...`.
With --controller one controller process drives N trainer actors (Monarch: the 'controller' extra),
journals every command and recovers a failed actor from the in-memory snapshots plus the journal
(see docs/controller.md and the [controller] section below).
Re-running on an existing run.dir with checkpoint.resume = auto continues from its newest complete
checkpoint and appends to its metrics.jsonl."""


def _nproc(opts: dict, default: int) -> int:
    """--nproc-per-node as given (named in its own errors), else launch.nproc_per_node."""
    flag = "--nproc-per-node" if "--nproc-per-node" in opts else "--nproc_per_node"
    raw = opts.get(flag)
    if raw is None:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1 or str(raw).strip() != str(n):
        raise ConfigError(f"{flag} must be a whole number >= 1 (got {raw!r})")
    return n


def _worker(cfg) -> int:
    """This process trains: one worker, or a rank torchrun started."""
    from stalwart.train.worker import worker_main

    return worker_main(cfg)


def _controller(cfg, nproc: int) -> int:
    require("monarch", "--controller")
    from stalwart.controller.driver import run_controller

    return run_controller(cfg, nproc)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(job_help("train", INTRO))
        return 0
    opts, cfg = parse_train_argv(argv)
    if launched_by_torchrun():
        return _worker(cfg)
    nproc = _nproc(opts, cfg.launch.nproc_per_node)
    from stalwart.launch.preflight import preflight

    preflight(cfg, nproc)  # torch only for its last checks (the device, a resumed checkpoint's shape)
    # torch and its elastic agent (seconds to import) only once the command line, config and job are valid
    from stalwart.launch.local import launch, supervised

    if opts.get("--controller"):
        return _controller(cfg, nproc)
    if cfg.fault.group_recovery or cfg.parallelism.islands > 1:
        from stalwart.launch.groups import launch_groups

        return launch_groups(argv, nproc, cfg)
    if nproc == 1 and not supervised(cfg):
        return _worker(cfg)
    return launch(argv, nproc, cfg)
