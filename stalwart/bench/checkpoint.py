"""`stalwart bench checkpoint`: save/restore bandwidth against the raw disk, async and snapshot stalls.

One process, the 125M flavor (110M parameters) with AdamW state (1.42 GB of fp32). Each repeat
measures, in this order and in one temporary directory (deleted at the end):

- raw write: ``dd if=SOURCE bs=16M count=64 oflag=direct conv=fsync`` (1 GiB) into one file right
  before and into a second file right after the sync save (the disk's speed drifts by 2x within a
  minute on the test machine: the save is compared with the mean of the two, and both are printed).
  SOURCE is 1 GiB of random bytes in /dev/shm, made once: the raw files hold data like a checkpoint's
  (on the test machine a file of zeros read back at 1.2 GB/s where random bytes written as recently
  read at 1.5-2.6 GB/s, so zeros flattered the restore);
- sync save: ``CheckpointManager.save`` with ``async_save = false``, files durable and committed;
- async save: the loop's stall (the save call, plus any wait of the next ``optimizer.step`` for the
  background copy, after one real forward/backward of ``--seq`` tokens) and the time until the
  commit (one manager for all repeats, warmed up once: its host buffers are allocated on first use);
- memory snapshot (``SnapshotStore.save`` into /dev/shm): stall and time until the blob is written;
- raw read: ``dd iflag=direct`` of the first file right before and of the second right after the
  restore (resolve + verify + load into a fresh model after dropping the page cache; root only, the
  output says whether it was dropped), which is compared with the mean of the two. Each file is read
  once: a second read of the same file is served by the host's cache at twice the speed. A file
  written seconds before may come from that cache too (on the test machine the second file, written
  after the checkpoint, read at 2.3-2.8 GB/s in some repeats against 1.1-1.3 GB/s for the first), so
  the comparison errs against the restore. dd reads with one request in flight; the restore's readers
  keep two, which this disk serves faster, into memory they reuse (``read_stream.ReadArena``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from stalwart.config.arguments import ArgumentParser, at_least
from stalwart.runtime.device import DEVICES, HOST, resolve_device


def _dd(args: list[str]) -> float:
    """Bytes/s that dd reports."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(m.group(1)) / float(m.group(2))


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _model(seed: int, flavor: str = "125M", device: torch.device = HOST):
    from stalwart.models.flavors import FLAVORS
    from stalwart.models.llama import Transformer

    torch.manual_seed(seed)
    model = Transformer(FLAVORS[flavor]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def _train_step(model, opt, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _pair(speeds: list[float]) -> str:
    """Raw speeds before/after, in MB/s."""
    return "/".join(f"{v / 1e6:.0f}" for v in speeds)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _random_source(n: int = 1 << 30) -> Path:
    """``n`` random bytes in /dev/shm (memory, so dd reading it measures only the disk it writes to)."""
    fd, name = tempfile.mkstemp(prefix="stalwart-bench-src-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    gen = torch.Generator().manual_seed(0)
    with os.fdopen(fd, "wb") as fh:
        for _ in range(n // (64 << 20)):
            fh.write(torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen).numpy().tobytes())
    return Path(name)


def _repeat(model, opt, tokens, work: Path, r: int, asyn, events: list, flavor: str, source: Path) -> dict:
    from stalwart.checkpoint.manager import CheckpointManager
    from stalwart.checkpoint.snapshot import SnapshotStore
    from stalwart.config.job import CheckpointConfig

    out: dict = {}
    raw = [work / "raw0", work / "raw1"]
    write_raw = [f"if={source}", "bs=16M", "count=64", "oflag=direct", "conv=fsync"]
    out["raw_write"] = [_dd([*write_raw, f"of={raw[0]}"])]

    sync = CheckpointManager(work / f"sync{r}", CheckpointConfig(async_save=False, keep_last=1), 0, 1,
                             lambda *a, **k: None)
    t0 = time.perf_counter()
    path = sync.save(1, model, opt, {"tokens_seen": 0})
    out["sync_s"] = time.perf_counter() - t0
    out["bytes"] = _size(path)
    out["raw_write"].append(_dd([*write_raw, f"of={raw[1]}"]))

    t0 = time.perf_counter()
    asyn.save(10 + r, model, opt, {"tokens_seen": 0})
    t1 = time.perf_counter()
    _train_step(model, opt, tokens)  # the loop goes on; its optimizer step waits for the copy if needed
    out["step_s"] = time.perf_counter() - t1
    asyn.wait()
    out["async_total_s"] = time.perf_counter() - t0
    out["async_stall_s"] = [e for e in events if "stall_s" in e][-1]["stall_s"]

    store = SnapshotStore(Path(tempfile.mkdtemp(prefix="stalwart-bench-", dir="/dev/shm")), 0, 1)
    try:
        t0 = time.perf_counter()
        store.save_async(3, model, opt, {"tokens_seen": 0})
        _train_step(model, opt, tokens)
        store.wait()
        out["snap_total_s"] = time.perf_counter() - t0
        out["snap_stall_s"] = store.last_stall_s  # the call, plus the optimizer step's wait for the copy
    finally:
        store.clear()

    out["dropped"] = drop_caches()
    read_raw = ["of=/dev/null", "bs=16M", "iflag=direct"]
    out["raw_read"] = [_dd([*read_raw, f"if={raw[0]}"])]
    fresh, fresh_opt = _model(seed=1, flavor=flavor, device=tokens.device)
    _train_step(fresh, fresh_opt, tokens)  # optimizer state exists, as in a resumed run
    drop_caches()
    t0 = time.perf_counter()
    loader = CheckpointManager(work / f"sync{r}", CheckpointConfig(resume="auto"), 0, 1, lambda *a, **k: None)
    loaded = loader.load_resume(loader.resolve_resume(), fresh, fresh_opt)
    out["restore_s"] = time.perf_counter() - t0
    assert loaded.step == 1
    out["raw_read"].append(_dd([*read_raw, f"if={raw[1]}"]))
    for f in raw:
        f.unlink()
    shutil.rmtree(work / f"sync{r}")
    return out


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench checkpoint", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--seq", type=at_least(1), default=256, help="tokens in the training step run while async work is in flight")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /tmp)")
    p.add_argument("--flavor", default="125M", help="model flavor (the figures in the docs use 125M)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where the model and optimizer live (saves then include the copy to the host)")
    a = p.parse_args(argv)
    device = resolve_device(a.device)
    from stalwart.models.flavors import FLAVORS

    if a.flavor not in FLAVORS:
        p.error(f"--flavor: unknown flavor '{a.flavor}' (one of {', '.join(FLAVORS)})")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model, opt = _model(seed=0, flavor=a.flavor, device=device)
    tokens = torch.randint(0, FLAVORS[a.flavor].vocab_size, (1, a.seq)).to(device)
    _train_step(model, opt, tokens)  # AdamW state exists
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {a.flavor} flavor, {n_params / 1e6:.1f}M parameters, fp32 + AdamW, on {device}")
    print(f"{'rep':>3} {'GB':>5} {'raw W MB/s':>11} {'sync s':>7} {'sync MB/s':>9} {'% raw':>6} {'async stall s':>13} "
          f"{'% sync':>6} {'async s':>7} {'snap stall s':>12} {'snap s':>6} {'% snap':>6} {'raw R MB/s':>11} "
          f"{'restore s':>9} {'MB/s':>6} {'% raw':>6} {'cache dropped':>13} {'step s':>6}  load")
    print(f"{'':>9} {'before/after':>11}{'':>81} {'before/after':>11}")
    source = _random_source()
    try:
        with tempfile.TemporaryDirectory(dir=a.dir, prefix="stalwart-bench-ckpt-") as tmp:
            from stalwart.checkpoint.manager import CheckpointManager
            from stalwart.config.job import CheckpointConfig

            events: list = []
            asyn = CheckpointManager(Path(tmp) / "async", CheckpointConfig(async_save=True, keep_last=1), 0, 1,
                                     lambda e, **k: events.append(k))
            asyn.save(1, model, opt, {"tokens_seen": 0}, block=False)  # warm-up: the host buffers are allocated once
            asyn.wait()
            for r in range(a.repeats):
                o = SimpleNamespace(**_repeat(model, opt, tokens, Path(tmp), r, asyn, events, a.flavor, source))
                mb = o.bytes / 1e6
                w, rd = mb / o.sync_s, mb / o.restore_s
                raw_w, raw_r = (sum(x) / len(x) / 1e6 for x in (o.raw_write, o.raw_read))
                print(f"{r:>3} {o.bytes / 1e9:>5.2f} {_pair(o.raw_write):>11} {o.sync_s:>7.2f} {w:>9.0f} "
                      f"{100 * w / raw_w:>5.0f}% {o.async_stall_s:>13.3f} "
                      f"{100 * o.async_stall_s / o.sync_s:>5.1f}% {o.async_total_s:>7.2f} {o.snap_stall_s:>12.3f} "
                      f"{o.snap_total_s:>6.2f} {100 * o.snap_stall_s / o.snap_total_s:>5.1f}% "
                      f"{_pair(o.raw_read):>11} {o.restore_s:>9.2f} {rd:>6.0f} {100 * rd / raw_r:>5.0f}% "
                      f"{o.dropped!s:>13} {o.step_s:>6.2f}  {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        source.unlink(missing_ok=True)
    return 0
