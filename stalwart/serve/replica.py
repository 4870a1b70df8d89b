"""One model replica: load, split over the tensor-parallel group, run the engine, serve HTTP on rank 0.

With one process it runs in the `stalwart serve` process itself; with ``--tp N --pp M`` torchrun
starts N x M copies of ``python -m stalwart.serve.replica`` and rank 0 serves while the others follow
its steps (``infer/group.py``).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

from stalwart.config.serve import ServeConfig
from stalwart.errors import UserError
from stalwart.infer.load import Source
from stalwart.procs import die_with_parent


def run_replica(cfg: ServeConfig, source: Source, port_file: Path | None = None) -> int:
    import torch

    from stalwart.infer.engine import Engine
    from stalwart.infer.load import build_model, read_source, source_from
    from stalwart.serve.app import create_app
    from stalwart.serve.http import serve
    from stalwart.serve.loop import EngineLoop

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tp, pp = cfg.layout.tp, cfg.layout.pp
    if world != tp * pp:
        raise UserError(f"this replica has {world} processes but layout.tp x layout.pp = {tp * pp}")
    tp_mesh = link = pipe = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from stalwart.infer.group import PipeLink, StepLink

        # An idle server waits in a broadcast for the next step for as long as it is idle.
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=30))
        mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
        tp_mesh = mesh["tp"] if tp > 1 else None
        link = StepLink()
        pipe = PipeLink(rank, tp, pp) if pp > 1 else None
    try:
        torch.set_grad_enabled(False)
        loaded = read_source(source)
        dtype = getattr(torch, cfg.engine.dtype)
        model = build_model(loaded, dtype, tp_mesh, rank // tp, pp)
        engine = Engine(model, loaded.tokenizer, loaded.eos_id, cfg.engine, tp_size=tp, link=link, pipe=pipe)

        def load(where: str) -> dict:
            return read_source(source_from(where)).state

        if rank != 0:
            from stalwart.infer.group import follow

            follow(engine, link, load)
            return 0
        name = cfg.server.model_name or source.name
        loop = EngineLoop(engine, link, load).start()
        try:
            what = (f"{name} ({loaded.origin}; tp={tp} pp={pp}, {engine.pool.num_blocks} KV blocks of "
                    f"{cfg.engine.block_size} tokens)")
            serve(create_app(loop, name), cfg.server.host, cfg.server.port, what, port_file)
        finally:
            loop.stop()
        return 0
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """Entry of a replica process started by `stalwart serve` (alone or under torchrun)."""
    from stalwart.serve.options import parse

    die_with_parent()
    cfg, source, port_file = parse(argv[1:] if argv[:1] == ["--"] else argv)
    return run_replica(cfg, source, port_file)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"stalwart serve: error: {e}", file=sys.stderr)
        sys.exit(2)
