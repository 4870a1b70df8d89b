"""Checkpoint benchmark: sync save vs async stall, raw disk bandwidth, restore from memory vs disk.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/checkpoint_bench.py [--flavor 125M] [--dir /tmp/ckbench]

One process, fp32 weights + AdamW state (3x the parameter bytes). Prints one line per figure.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from stalwart.checkpoint.manager import CheckpointManager
from stalwart.checkpoint.snapshot import SnapshotStore
from stalwart.config.job import CheckpointConfig, ModelConfig
from stalwart.models.flavors import resolve_args
from stalwart.models.llama import Transformer, count_params
from stalwart.train.init import materialize_and_init


def build(flavor: str, seed: int = 0):
    args = resolve_args(ModelConfig(flavor=flavor), 0, 64)
    args = type(args)(**{**args.__dict__, "vocab_size": resolve_args(ModelConfig(flavor=flavor), 32768, 64).vocab_size})
    with torch.device("meta"):
        model = Transformer(args)
    materialize_and_init(model, torch.device("cpu"), seed)
    return args, model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def one_step(model, opt, vocab: int) -> None:
    x = torch.randint(0, vocab, (1, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad()


def dd_bandwidth(directory: Path, mib: int) -> float:
    """MB/s of `dd if=/dev/zero of=FILE bs=1M count=N oflag=direct conv=fsync`."""
    target = directory / "dd.bin"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct",
                          "conv=fsync"], capture_output=True, text=True)
    target.unlink(missing_ok=True)
    m = re.search(r"([\d.]+) s, ", out.stderr)
    if not m:
        raise RuntimeError(f"dd failed: {out.stderr}")
    return mib * 2**20 / float(m.group(1)) / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="125M")
    p.add_argument("--dir", default="/tmp/stalwart-ckbench")
    p.add_argument("--dd-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    args, model, opt = build(a.flavor)
    one_step(model, opt, args.vocab_size)  # materialize AdamW state
    n = count_params(args)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    print(f"model            {a.flavor}: {n / 1e6:.1f}M params, fp32 + AdamW state = {state_bytes / 1e9:.2f} GB "
          f"(torch threads {torch.get_num_threads()})")

    def manager(sub: str, async_save: bool) -> CheckpointManager:
        return CheckpointManager(root / sub, CheckpointConfig(async_save=async_save, keep_last=1), 0, 1,
                                 lambda *x, **k: None)

    sync_t, stall_t, async_total = [], [], []
    for i in range(a.repeats):
        m = manager("sync", False)
        t0 = time.perf_counter()
        m.save(i + 1, model, opt, {"tokens_seen": 0})
        sync_t.append(time.perf_counter() - t0)
        m = manager("async", True)
        t0 = time.perf_counter()
        m.save(i + 1, model, opt, {"tokens_seen": 0})  # returns after staging + planning
        stall_t.append(time.perf_counter() - t0)
        m.wait()
        async_total.append(time.perf_counter() - t0)
    ckpt = root / "sync" / f"step-{a.repeats}"
    disk_bytes = sum(f.stat().st_size for f in ckpt.iterdir())
    sync_s, stall_s = min(sync_t), min(stall_t)
    print(f"sync save        {sync_s:.2f} s  ({disk_bytes / 1e9:.2f} GB on disk -> {disk_bytes / sync_s / 1e6:.0f} MB/s, "
          f"incl. fsync + SHA-256)  runs: {', '.join(f'{t:.2f}' for t in sync_t)}")
    print(f"async save       loop stall {stall_s:.2f} s (copy to host memory + plan); background write done after "
          f"{min(async_total):.2f} s  runs: {', '.join(f'{t:.2f}' for t in stall_t)}")
    dd = dd_bandwidth(root, a.dd_mib)
    print(f"disk raw write   {dd:.0f} MB/s (dd bs=1M count={a.dd_mib} oflag=direct conv=fsync in {root})")
    print(f"save throughput  {disk_bytes / sync_s / 1e6 / dd:.0%} of raw disk bandwidth")

    _, model2, opt2 = build(a.flavor, seed=1)
    m = manager("sync", False)
    t0 = time.perf_counter()
    m.verify(ckpt)
    verify_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m.load(ckpt, model2, opt2)
    disk_load_s = time.perf_counter() - t0
    print(f"restore (disk)   {disk_load_s:.2f} s incl. SHA-256 verify ({verify_s:.2f} s of it; page cache warm)")

    store = SnapshotStore(Path("/dev/shm") / "stalwart-ckbench", 0, 1)
    t0 = time.perf_counter()
    size = store.save(1, model, opt, {"tokens_seen": 0})
    snap_save_s = time.perf_counter() - t0
    _, model3, opt3 = build(a.flavor, seed=2)
    t0 = time.perf_counter()
    step = store.newest_complete_step()
    store.load(step, model3, opt3)
    mem_load_s = time.perf_counter() - t0
    print(f"snapshot (RAM)   save {snap_save_s:.2f} s ({size / 1e9:.2f} GB in /dev/shm; x2 with a peer copy), "
          f"restore {mem_load_s:.2f} s incl. checksum")
    same = all(torch.equal(a_, b_) for a_, b_ in zip(model.state_dict().values(), model3.state_dict().values()))
    print(f"restored equal   {same}")
    store.clear()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
