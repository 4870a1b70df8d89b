"""`stalwart train`: validate the config, then run one worker in-process or launch N under supervision.

Multi-node jobs use standard torchrun rendezvous instead of --nproc-per-node:
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m stalwart.train --config llama3_8b
"""

from __future__ import annotations

from stalwart.config.loading import job_help, parse_train_argv
from stalwart.launch.local import launch, preflight, supervised
from stalwart.train.dist_env import launched_by_torchrun
from stalwart.train.worker import worker_main

INTRO = """usage: stalwart train [--config FILE_OR_NAME] [--nproc-per-node N] [--section.key VALUE ...]

Train a model. With --nproc-per-node N > 1 (or launch.nproc_per_node in the config) the workers are
started through torch's elastic launcher; under torchrun, use `torchrun ... -m stalwart.train ...`.
Re-running on an existing run.dir with checkpoint.resume = auto continues from its newest complete
checkpoint and appends to its metrics.jsonl."""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(job_help("train", INTRO))
        return 0
    opts, cfg = parse_train_argv(argv)
    if launched_by_torchrun():
        return worker_main(cfg)
    nproc = int(opts.get("--nproc-per-node") or opts.get("--nproc_per_node") or cfg.launch.nproc_per_node)
    preflight(cfg, nproc)
    if nproc == 1 and not supervised(cfg):
        return worker_main(cfg)
    return launch(argv, nproc, cfg)
