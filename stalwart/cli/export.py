"""`stalwart export --run runs/X --format hf --out DIR`: a run's checkpoint as a Hugging Face Llama model.

Writes config.json (LlamaConfig), model.safetensors (or shards + index), tokenizer.json and
tokenizer_config.json. The checkpoint is verified and read without unpickling anything.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stalwart.atomic import staged_output
from stalwart.config.arguments import ArgumentParser
from stalwart.errors import UserError
from stalwart.paths import RunPaths


class ExportCliError(UserError):
    pass


def export_run(run_dir: Path, out: Path, checkpoint: str | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Export ``run_dir``'s newest complete checkpoint (or ``checkpoint``) to ``out``; returns the checkpoint."""
    from stalwart.checkpoint.run_checkpoint import open_run_checkpoint, run_paths

    run_paths(run_dir)  # not a run directory: one line, before torch loads
    from stalwart.checkpoint.inspect import load_flat
    from torch.distributed.checkpoint.api import CheckpointException

    from stalwart.checkpoint.safe_io import UnsafeCheckpointError, describe_load_failure
    from stalwart.data.tokenizer import EOS
    from stalwart.export.hf import export_hf, first_shape_mismatch, model_shapes, shape_words, weight_files

    run = open_run_checkpoint(run_dir, checkpoint)
    path, args, tokenizer = run.path, run.args, run.tokenizer
    try:
        flat = load_flat(path, "model.")
    except UnsafeCheckpointError as e:
        raise ExportCliError(f"checkpoint {path}: refused: {e}") from None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps reader failures
        raise ExportCliError(describe_load_failure(path, e)) from None
    state = {k.removeprefix("model."): v for k, v in flat.items()}
    bad = first_shape_mismatch(state, model_shapes(args))
    if bad is not None:
        name, have, want = bad
        flag = f"--checkpoint {checkpoint}" if checkpoint else f"checkpoint {path}"
        raise ExportCliError(f"{flag}: tensor '{name}' has shape {shape_words(have)} in the checkpoint, but the "
                             f"model {run_dir}/config.toml describes has {shape_words(want)}; export it with "
                             "--run set to the run that wrote it")
    def prune(written: set[str]) -> None:  # an earlier export's weight files this one does not rewrite
        for stale in weight_files(out):
            if stale.name not in written:
                stale.unlink()

    # Written beside --out first and moved in whole, config.json last: a full disk leaves --out as it was.
    with staged_output(out, "--out", last=("config.json",), prune=prune) as tmp:
        export_hf(state, args, RunPaths(run_dir).tokenizer, EOS, tokenizer.token_to_id(EOS), tmp, max_shard_bytes)
    return path


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart export", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (runs/<name>)")
    p.add_argument("--format", default="hf", choices=["hf"], help="output format (hf = Hugging Face Llama)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--checkpoint", default=None, help="a specific checkpoint directory (default: newest complete)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split model.safetensors above this size")
    a = p.parse_args(argv)
    if not (0 < a.max_shard_gb < float("inf")):
        p.error(f"--max-shard-gb must be a positive number of gigabytes, got {a.max_shard_gb}")
    out = Path(a.out)
    path = export_run(Path(a.run), out, a.checkpoint, int(a.max_shard_gb * 2**30))
    print(f"exported {path} -> {out} (Hugging Face Llama: config.json, safetensors, tokenizer)", file=sys.stderr)
    return 0
