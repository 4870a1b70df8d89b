"""One model replica: load, split over the tensor-parallel group, run the engine, serve HTTP on rank 0.

With one process it runs in the `stalwart serve` process itself; with ``--tp N --pp M`` torch's
elastic agent (``serve/launcher.py``) runs N x M copies of ``python -m stalwart.serve.replica``, each
forked from that launcher once it has imported the replica's modules, and rank 0 serves while the others follow its steps (``infer/group.py``). The device and the process group
come from the runtime (``engine.device``; the group's store on loopback).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from stalwart.config.serve import ServeConfig
from stalwart.errors import UserError
from stalwart.infer.load import Source
from stalwart.procs import die_with_parent

IDLE_TIMEOUT_S = 30 * 24 * 3600.0  # a follower rank waits this long for rank 0's next step
UNHEALTHY_EXIT_S = 5.0  # rank 0 of a group exits once its engine has been dead or stuck this long
EXIT_UNHEALTHY = 3


def run_replica(cfg: ServeConfig, source: Source, port_file: Path | None = None,
                device_setting: str = "engine.device", weights_file: Path | None = None) -> int:
    """Serve ``source``'s weights, or, when ``weights_file`` records a weight update this replica applied
    before it was started again (serve/applied.py), those weights as that version."""
    import torch

    from stalwart.infer.engine import Engine
    from stalwart.infer.load import build_model, read_source, source_from
    from stalwart.runtime.device import resolve_device
    from stalwart.serve.app import create_app
    from stalwart.serve.applied import AppliedWeights
    from stalwart.serve.chat import ChatFormat
    from stalwart.serve.http import serve
    from stalwart.serve.loop import EngineLoop
    from stalwart.serve.resume import replica_secret

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tp, pp = cfg.layout.tp, cfg.layout.pp
    if world != tp * pp:
        raise UserError(f"this replica has {world} processes but layout.tp x layout.pp = {tp * pp}")
    tp_mesh = link = pipe = None
    stops = _note_stop_signals() if rank != 0 else []
    if world > 1:
        from stalwart.infer.group import PipeLink, StepLink
        from stalwart.runtime.group import device_mesh, init_from_env

        # An idle server waits in a broadcast for the next step for as long as it is idle.
        device = init_from_env(cfg.engine.device, IDLE_TIMEOUT_S, device_setting).device
        mesh = device_mesh(device, (pp, tp), ("pp", "tp"))
        tp_mesh = mesh["tp"] if tp > 1 else None
        link = StepLink()
        pipe = PipeLink(rank, tp, pp, device) if pp > 1 else None
    else:
        device = resolve_device(cfg.engine.device, 0, device_setting)
    applied = AppliedWeights(weights_file) if weights_file is not None else None
    last = applied.read() if applied is not None else None
    version, named = 0, source  # the command line's source names the model and its chat format
    if last is not None:  # every rank reads the same record: the group loads the same weights
        source, version = last
        if rank == 0:
            print(f"stalwart serve: started again with the weights last applied (version {version}, "
                  f"{source.checkpoint or source.run or source.hf})", file=sys.stderr, flush=True)
    try:
        torch.set_grad_enabled(False)
        loaded = read_source(source)
        dtype = getattr(torch, cfg.engine.dtype)
        model = build_model(loaded, dtype, device, tp_mesh, rank // tp, pp, cfg.engine.quantize)
        engine_cfg, draft = cfg.engine, None
        if engine_cfg.speculative == "draft":  # rank 0 schedules and drafts; the others follow its steps
            from stalwart.infer.speculative import load_draft_model

            # Every rank reads it: reading a run checkpoint is a collective over the group.
            draft = load_draft_model(engine_cfg.draft_model, loaded.args.vocab_size, loaded.tokenizer, dtype, device)
            if rank != 0:
                draft, engine_cfg = None, replace(engine_cfg, speculative="off", draft_model="")
        engine = Engine(model, loaded.tokenizer, loaded.eos_id, engine_cfg, tp_size=tp, link=link, pipe=pipe,
                        weight_version=version, draft=draft)
        origins: dict[str, Path] = {}  # what each update's path named when it was read (a run: its checkpoint)

        def load(where: str) -> dict:
            read = read_source(source_from(where))
            origins[where] = read.origin
            return read.state

        def keep(version: int, where: str | None, state: dict | None) -> None:
            if applied is not None:
                applied.keep(version, where, origins.pop(where, None) if where else None, state, engine)

        if rank != 0:
            from stalwart.infer.group import follow

            follow(engine, link, load)
            return 0
        name = cfg.server.model_name or named.name
        loop = EngineLoop(engine, link, load, on_weights=keep).start()
        if world > 1:  # its launcher starts the group again when a process exits
            _exit_when_unhealthy(loop, UNHEALTHY_EXIT_S)
        try:
            what = (f"{name} ({loaded.origin}; {device.type}, tp={tp} pp={pp}, {engine.pool.num_blocks} KV "
                    f"blocks of {cfg.engine.block_size} tokens)")
            app = create_app(loop, name, router_secret=replica_secret(), chat=ChatFormat.of_dir(named.hf))
            serve(app, cfg.server.host, cfg.server.port, what, port_file)
        finally:
            loop.stop()
        return 0
    except Exception:
        if stops:  # rank 0 went away while the group was being stopped: nothing failed
            return 0
        raise
    finally:
        from stalwart.runtime.group import leave

        leave()


def _exit_when_unhealthy(loop, after_s: float) -> None:
    """Watch ``loop`` from a thread; once its engine has been dead or stuck (``EngineLoop.problem``) for
    ``after_s`` seconds (``/health`` said 503 meanwhile), end this process at once: a stuck engine holds
    a collective that no graceful stop gets past. The group's launcher then stops the other ranks and
    `stalwart serve` starts the group again."""
    import threading
    import time

    def watch() -> None:
        since = None
        while not loop.stopped:
            time.sleep(0.5)
            problem = loop.problem()
            since = None if problem is None else since or time.monotonic()
            if since is not None and time.monotonic() - since > after_s and not loop.stopped:
                print(f"stalwart serve: {problem}; this replica exits to be started again", file=sys.stderr,
                      flush=True)
                os._exit(EXIT_UNHEALTHY)

    threading.Thread(target=watch, name="stalwart-watchdog", daemon=True).start()


def _note_stop_signals() -> list[int]:
    """A rank other than 0 leaves stopping to rank 0: SIGINT/SIGTERM are noted (in the list returned),
    not acted on. Rank 0, stopped by the same signal or by the launcher, tells this rank to stop."""
    import signal

    noted: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _frame: noted.append(s))
    return noted


def main(argv: list[str]) -> int:
    """Entry of a replica process started by `stalwart serve` (alone, or as one rank of serve/launcher.py's
    group, forked from that launcher): its exit status (2, with one line, for what the user must fix)."""
    from stalwart.serve.options import device_setting, parse

    die_with_parent()
    argv = argv[1:] if argv[:1] == ["--"] else argv
    try:
        cfg, source, port_file, weights_file = parse(argv)
        return run_replica(cfg, source, port_file, device_setting(argv), weights_file)
    except UserError as e:
        print(f"stalwart serve: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
