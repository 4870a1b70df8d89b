"""Open a finished (or running) run directory for the tools that read its checkpoints.

`stalwart generate` and `stalwart export` both need the same four things: the run's resolved config,
its tokenizer, the checkpoint to read (verified), and the model shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stalwart.errors import UserError
from stalwart.paths import RunPaths


class RunDirError(UserError):
    """The directory is not a run, or has no usable checkpoint."""


@dataclass
class RunCheckpoint:
    cfg: object  # JobConfig
    tokenizer: object  # tokenizers.Tokenizer
    path: Path  # the verified checkpoint directory
    args: object  # TransformerArgs


def run_paths(run_dir: Path) -> RunPaths:
    """``run_dir``'s paths, or RunDirError when it is not a run directory. Imports nothing heavy, so a
    command checks its ``--run`` before it loads torch."""
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise RunDirError(f"{run_dir} is not a run directory (no config.toml); pass --run runs/<name>")
    return paths


def open_run_checkpoint(run_dir: Path, checkpoint: str | None = None) -> RunCheckpoint:
    from stalwart.checkpoint.manager import CheckpointManager
    from stalwart.config import load
    from stalwart.config.job import CheckpointConfig, JobConfig
    from stalwart.data.tokenizer import load_tokenizer
    from stalwart.models.flavors import resolve_args

    paths = run_paths(run_dir)
    cfg = load(JobConfig, paths.config)
    tokenizer = load_tokenizer(paths.tokenizer)
    manager = CheckpointManager(paths.checkpoints, CheckpointConfig(resume=checkpoint or "auto"), 0, 1,
                                lambda *a, **k: None)
    path = manager.resolve_resume(full=True)  # export reads the files itself: every checksum first
    if path is None:
        raise RunDirError(f"{run_dir} has no complete checkpoint")
    args = resolve_args(cfg.model, tokenizer.get_vocab_size(), cfg.data.seq_len)
    return RunCheckpoint(cfg, tokenizer, path, args)


def load_run_model(run_dir: Path, checkpoint: str | None = None):
    """(model, tokenizer, config, checkpoint path) for a run directory, on CPU, weights only."""
    import torch

    from stalwart.checkpoint.manager import CheckpointManager
    from stalwart.config.job import CheckpointConfig
    from stalwart.models.llama import Transformer

    run = open_run_checkpoint(run_dir, checkpoint)
    model = Transformer(run.args)
    with torch.no_grad():
        CheckpointManager(run.path.parent, CheckpointConfig(), 0, 1, lambda *a, **k: None).load(run.path, model, None)
    model.reset_buffers()
    return model, run.tokenizer, run.cfg, run.path
