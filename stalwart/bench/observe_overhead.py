"""Overhead of the observability hot path: ``stalwart bench observe``.

Trains the per-rank share of ``make train`` (the "tiny" Llama, vocab 2048, micro-batch 4 x 256
tokens, one thread per rank) and measures (a) the fixed cost per step of the PhaseTimer and per
collective of the flight recorder, in microseconds, against the median step time, and (b) an
interleaved A/B of whole steps with and without instrumentation (and of two plain arms: the noise
floor). (a) is the figure to trust on a shared machine; (b) is its sanity check. The collectives per
step are those FSDP2 issues with one unit per block plus the root: an all-gather per unit in forward
and in backward and a reduce-scatter per unit, plus one loss all-reduce. The per-collective cost is
measured on a 1-process group on the host's backend (a world of 1 makes FSDP skip its comms).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

from stalwart.config.arguments import ArgumentParser, at_least, one_of
from stalwart.models.flavors import FLAVORS


def _micro_timer_us(tmp: str, steps: int = 20000) -> float:
    from stalwart.observe.timer import PhaseTimer, TimingsWriter
    from stalwart.runtime import HOST

    timer = PhaseTimer(0, HOST, TimingsWriter(tmp, 0), flush_every=10)
    phases = ("data", "forward", "backward", "comm", "optimizer")
    t = time.perf_counter()
    for s in range(steps):
        timer.begin_step(s)
        for p in phases:
            with timer.phase(p):
                pass
        timer.end_step()
    timer.close()
    return (time.perf_counter() - t) / steps * 1e6


def _micro_collective_us(rec_factory, n: int = 3000) -> float:
    import torch
    import torch.distributed as dist

    x = torch.zeros(1)

    def loop() -> float:
        t = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        return (time.perf_counter() - t) / n

    loop()
    plain = min(loop() for _ in range(3))
    rec = rec_factory()
    try:
        wrapped = min(loop() for _ in range(3))
    finally:
        rec.uninstall()
    return max(0.0, wrapped - plain) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="stalwart bench observe", description=__doc__)
    ap.add_argument("--flavor", type=one_of(FLAVORS), default="tiny", help="model flavor (default tiny)")
    ap.add_argument("--vocab", type=at_least(2), default=2048, help="vocabulary size (default 2048, as make train)")
    ap.add_argument("--batch", type=at_least(1), default=4)
    ap.add_argument("--seq", type=at_least(1), default=256)
    ap.add_argument("--steps", type=at_least(1), default=12, help="steps per A/B arm")
    ap.add_argument("--threads", type=at_least(1), default=1, help="intra-op threads (default 1, as each of 2 ranks)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from stalwart.models.llama import Transformer
    from stalwart.observe.flight import FlightRecorder
    from stalwart.observe.timer import PhaseTimer, TimingsWriter
    from stalwart.runtime import HOST
    from stalwart.runtime.group import init_group, leave

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    init_group(HOST, 0, 1, dist.HashStore(), timeout_s=60.0)
    tmp = tempfile.mkdtemp(prefix="stalwart-overhead-")
    margs = dataclasses.replace(FLAVORS[args.flavor], vocab_size=args.vocab)
    model = Transformer(margs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, margs.vocab_size, (args.batch, args.seq + 1))

    def step(timer: PhaseTimer | None, i: int) -> float:
        t0 = time.perf_counter()
        ctx = timer.phase if timer else (lambda name: _Null())
        if timer:
            timer.begin_step(i)
        with ctx("data"):
            x, y = tokens[:, :-1], tokens[:, 1:]
        with ctx("forward"):
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with ctx("backward"):
            loss.backward()
        with ctx("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if timer:
            timer.end_step()
        return time.perf_counter() - t0

    for i in range(3):
        step(None, i)  # warm-up
    n_coll = 3 * (margs.n_layers + 1) + 1

    plain, inst, plain2 = [], [], []
    rec = FlightRecorder(0, 1, tmp, hang_timeout_s=300)
    timer = PhaseTimer(0, HOST, TimingsWriter(tmp, 0), flush_every=10, on_phase=rec.set_phase,
                       comm_clock=rec.blocked_seconds)
    for i in range(args.steps):  # interleave ABBA so machine noise and position effects hit both arms
        arms = [(plain, None), (inst, timer), (plain2, None)]
        for times, t in (arms if i % 2 else arms[::-1]):
            times.append(step(t, i))
    timer.close()
    step_s = statistics.median(plain)
    timer_us = _micro_timer_us(tmp)
    coll_us = _micro_collective_us(lambda: FlightRecorder(0, 1, tmp, hang_timeout_s=300).install(
        signals=False, excepthook=False))
    total_us = timer_us + n_coll * coll_us
    ab = (statistics.median(inst) - step_s) / step_s * 100
    noise = (statistics.median(plain2) - step_s) / step_s * 100
    leave()
    print(f"model {args.flavor} (vocab {args.vocab}), batch {args.batch} x seq {args.seq}, {args.threads} thread(s)")
    print(f"median step time            {step_s * 1e3:9.2f} ms  ({n_coll} FSDP2 collectives per step assumed)")
    print(f"PhaseTimer per step         {timer_us:9.2f} us  (5 phases, JSONL flush every 10 steps)")
    print(f"flight recorder per collective {coll_us:6.2f} us")
    print(f"instrumentation per step    {total_us:9.2f} us = {total_us / (step_s * 1e6) * 100:.3f}% of the step "
          f"(target <= 2%)")
    print(f"A/B whole steps (noisy)     {ab:+9.2f} %  (median instrumented vs plain, {len(plain)} steps each; "
          f"plain vs plain: {noise:+.2f} %, the noise floor)")
    return 0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
