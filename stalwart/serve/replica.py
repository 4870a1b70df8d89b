"""One model replica: load, split over the tensor-parallel group, run the engine, serve HTTP on rank 0.

With one process and no supervisor it runs in the `stalwart serve` process itself. Otherwise its launcher
(``serve/launcher.py``) runs it: each rank is a fork of the launcher, which read the weights once, serves
the group's store and holds the HTTP socket (``serve.heal.GroupPlace``); rank 0 serves while the others
follow its steps (``infer/group.py``), and a rank that the launcher starts again finds the others rejoining
its group (``serve/heal.py``). The device comes from the runtime (``engine.device``).
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
from stalwart.serve.heal import GroupPlace

UNHEALTHY_EXIT_S = 5.0  # rank 0 of a group exits once its engine has been dead or stuck this long
EXIT_UNHEALTHY = 3


def run_replica(cfg: ServeConfig, source: Source, port_file: Path | None = None,
                device_setting: str = "engine.device", weights_file: Path | None = None,
                place: GroupPlace | None = None) -> int:
    """Serve ``source``'s weights, or, when ``weights_file`` records a weight update this replica applied
    before it was started again (serve/applied.py), those weights as that version. ``place``: this rank's
    place in a replica its launcher runs (the weights it read, the store, rank 0's socket)."""
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

    world, rank = (place.world, place.rank) if place is not None else (1, 0)
    tp, pp = cfg.layout.tp, cfg.layout.pp
    if world != tp * pp:
        raise UserError(f"this replica has {world} processes but layout.tp x layout.pp = {tp * pp}")
    tp_mesh = link = pipe = healer = None
    stops = _note_stop_signals() if rank != 0 else []
    device = resolve_device(cfg.engine.device, rank, device_setting)
    if place is not None:
        from stalwart.serve.heal import GroupHealer

        healer = GroupHealer(place, device, (pp, tp))
    applied = AppliedWeights(weights_file) if weights_file is not None else None
    last = applied.read() if applied is not None else None
    version, named = 0, source  # the command line's source names the model and its chat format
    loaded = place.loaded if place is not None else None
    if last is not None and (loaded is None or last[1] != place.version):  # the group loads the same weights
        source, version, loaded = *last, None
        print(f"stalwart serve: rank {rank} started again with the weights last applied (version {version}, "
              f"{source.checkpoint or source.run or source.hf})", file=sys.stderr, flush=True)
    elif loaded is not None:
        version = place.version
    try:
        torch.set_grad_enabled(False)
        dtype = getattr(torch, cfg.engine.dtype)
        # Read before joining the group: reading a run checkpoint in a group is a collective over it, and a
        # rank started again alone would wait in it for the others (which serve meanwhile).
        loaded = loaded or read_source(source)
        engine_cfg, draft = cfg.engine, None
        if engine_cfg.speculative == "draft" and rank == 0:  # rank 0 schedules and drafts
            from stalwart.infer.speculative import load_draft_model

            draft = load_draft_model(engine_cfg.draft_model, loaded.args.vocab_size, loaded.tokenizer, dtype, device)
        elif engine_cfg.speculative == "draft":  # the others follow its steps
            engine_cfg = replace(engine_cfg, speculative="off", draft_model="")
        if world > 1:
            from stalwart.infer.group import PipeLink, StepLink

            tp_mesh = healer.join()
            link = StepLink()
            pipe = PipeLink(rank, tp, pp, device) if pp > 1 else None
        model = build_model(loaded, dtype, device, tp_mesh, rank // tp, pp, cfg.engine.quantize)
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

        if world > 1:
            healer.ready(model)  # every rank laid out and loaded (a rank started again: the others wait)
        if rank != 0:
            _follow(engine, link, load, healer if world > 1 else None)
            return 0
        name = cfg.server.model_name or named.name
        loop = EngineLoop(engine, link, load, on_weights=keep, healer=healer if world > 1 else None).start()
        if world > 1:  # its launcher starts this process again when it exits
            _exit_when_unhealthy(loop, UNHEALTHY_EXIT_S)
        try:
            what = (f"{name} ({loaded.origin}; {device.type}, tp={tp} pp={pp}, {engine.pool.num_blocks} KV "
                    f"blocks of {cfg.engine.block_size} tokens)")
            app = create_app(loop, name, router_secret=replica_secret(), chat=ChatFormat.of_dir(named.hf),
                             retrieval=_retrieval(cfg))
            serving = (lambda: healer.announce_serving(os.getpid())) if healer is not None else None
            serve(app, cfg.server.host, cfg.server.port, what, port_file, place.sock if place else None, serving)
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


def _retrieval(cfg: ServeConfig):
    """The indexes requests may retrieve from (serve/rag.py), or None."""
    if not cfg.retrieval.index:
        return None
    from stalwart.serve.rag import Retrieval

    return Retrieval(cfg.retrieval)


def _follow(engine, link, load, healer) -> None:
    """A rank other than 0: follow rank 0's steps until it says stop, rejoining the group whenever the
    launcher starts a lost rank again (rank 0 included)."""
    from stalwart.infer.group import follow

    while True:
        try:
            return follow(engine, link, load)
        except RuntimeError:  # a collective failed: a rank was lost, if the launcher names a new attempt
            if healer is None or not healer.broken(healer.notice_s):
                raise
            healer.rejoin(engine.model)


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
    """Entry of a one-process replica started by `stalwart serve` without a launcher: its exit status (2,
    with one line, for what the user must fix)."""
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
