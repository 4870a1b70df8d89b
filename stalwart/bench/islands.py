"""`stalwart bench islands`: training across sites on an emulated, shaped, delayed network.

Each island runs on a host of its own (a network namespace, :class:`~stalwart.comm.netns.NetnsCluster`)
as a real `stalwart train` (``--fault.replica_group i``, island 0's host serves the store); the links
between hosts are shaped to ``rate_mbit`` and delayed ``delay_ms`` one way (netem, or the delay line
where the kernel has none), while the processes of one island talk over their host's loopback. The
variants (synchronous gradients every step, DiLoCo, Streaming DiLoCo) run interleaved, ``repeats``
times each, on the same cluster. Reported per run: tokens/s over the training span (first step to
last) and over the whole command, bytes that crossed the inter-island links per token (counted by
the switch's ports, start-up included), compute utilisation (1 - time waiting for the outer sync /
training span, the mean over islands) and the final eval loss (after the last sync every island holds
the same model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stalwart.config import ConfigError, help_text, load, option

USAGE = """usage: stalwart bench islands [--config FILE] [--islands K] [--procs N] [--rate_mbit R] [--delay_ms D]
                              [--steps S] [--variants sync,diloco:50,streaming:100:4:int4] [--repeats N]"""


@dataclasses.dataclass
class IslandsBenchConfig:
    islands: int = option("Islands, one emulated host each.", 2, min=2, max=8)
    procs: int = option("Processes per island (they replicate the model).", 1, min=1, max=4)
    rate_mbit: float = option("Bandwidth of each host's link, Mbit/s.", 100.0, min=1.0)
    delay_ms: float = option("One-way latency added per link, ms (two links between two hosts).", 25.0, min=0.0)
    steps: int = option("Optimizer steps of every run (the same tokens for every variant).", 200, min=1)
    variants: list[str] = option(
        "What to run: 'sync', 'diloco:H[:QUANT]', 'streaming:H:P[:QUANT[:TAU]]' (QUANT none|bf16|int8|int4).",
        factory=lambda: ["sync", "diloco:50", "diloco:100", "streaming:100:4:int4"])
    repeats: int = option("Runs of each variant, interleaved.", 1, min=1)
    train_config: str = option("Training config (name or TOML) every run starts from.", "debug")
    train_args: list[str] = option("Further `stalwart train` overrides, e.g. --training.global_batch=16.",
                                   factory=list)
    timeout_s: float = option("Longest one run may take.", 1800.0, min=10.0)
    json_out: str = option("Write every run's figures as JSON here (empty: don't).", "")
    keep: str = option("Keep the runs' directories under this folder (empty: a temporary one).", "")


def variant_args(spec: str) -> list[str]:
    """`stalwart train` arguments of one variant; ConfigError names a malformed one."""
    parts = spec.split(":")
    quants = ("none", "bf16", "int8", "int4")
    try:
        if parts[0] == "sync" and len(parts) == 1:
            return ["--islands.algorithm", "sync"]
        if parts[0] == "diloco" and len(parts) in (2, 3):
            q = parts[2] if len(parts) == 3 else "none"
            if q not in quants:
                raise ValueError
            return ["--islands.algorithm", "diloco", "--islands.inner_steps", str(int(parts[1])),
                    "--islands.quantize", q]
        if parts[0] == "streaming" and len(parts) in (3, 4, 5):
            q = parts[3] if len(parts) >= 4 else "int4"
            if q not in quants:
                raise ValueError
            tau = int(parts[4]) if len(parts) == 5 else 1
            return ["--islands.algorithm", "streaming", "--islands.inner_steps", str(int(parts[1])),
                    "--islands.fragments", str(int(parts[2])), "--islands.quantize", q,
                    "--islands.overlap_steps", str(tau)]
    except ValueError:
        pass
    raise ConfigError(f"variants: {spec!r} is not sync, diloco:H[:QUANT] or streaming:H:P[:QUANT[:TAU]] "
                      "(QUANT none|bf16|int8|int4)")


def _island(run: Path, i: int) -> Path:
    return run if i == 0 else run / "groups" / str(i)


def _figures(run: Path, islands: int) -> dict:
    """Training span, sync wait and eval loss of a finished run, from its islands' records."""
    spans, utils, tokens = [], [], 0
    for i in range(islands):
        steps = [json.loads(x) for x in (_island(run, i) / "metrics.jsonl").read_text().splitlines()
                 if x.strip() and '"step_time_s"' in x]
        summary = json.loads((_island(run, i) / "summary.json").read_text())
        span = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_time_s"]
        spans.append(span)
        utils.append(1.0 - summary["islands"]["sync_wait_s"] / span)
        tokens += steps[-1]["tokens_seen"]
        if i == 0:
            loss, params, parts = summary["final_eval_loss"], summary["islands"]["params"], \
                summary["islands"]["fragment_params"]
    return {"train_s": max(spans), "utilisation": statistics.mean(utils), "tokens": tokens, "eval_loss": loss,
            "params": params, "fragment_params": parts}


def predicted(spec: str, figures: dict, cfg: IslandsBenchConfig) -> dict:
    """The planner's step time for this run (``planner/islands.py``), given the run's own compute per step
    (its training span less the time it waited for the link): what the link model adds, checked."""
    from stalwart.planner.islands import predict

    args = variant_args(spec)
    opt = dict(zip(args[::2], args[1::2]))
    compute = figures["train_s"] * figures["utilisation"] / cfg.steps
    algorithm = opt["--islands.algorithm"]
    p = predict(figures["params"], compute, cfg.islands, cfg.procs, cfg.rate_mbit, 2 * cfg.delay_ms, algorithm,
                inner_steps=int(opt.get("--islands.inner_steps", 1)), fragments=int(opt.get("--islands.fragments", 1)),
                overlap=int(opt.get("--islands.overlap_steps", 0)), quantize=opt.get("--islands.quantize", "none"),
                steps=cfg.steps, fragment_params=figures["fragment_params"] if algorithm == "streaming" else None)
    measured = figures["train_s"] / cfg.steps
    return {"predicted_step_s": p.step_s, "measured_step_s": measured, "predicted_utilisation": p.utilisation,
            "step_error": (p.step_s - measured) / measured}


def run_variant(cluster, spec: str, cfg: IslandsBenchConfig, root: Path, port: int) -> dict:
    """One run of ``spec``: every island on its host, to its end. Its figures."""
    from stalwart.comm.netns import IFNAME

    run = root / f"{spec.replace(':', '-')}-{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME, PYTHONWARNINGS="ignore")
    before = [cluster.link_bytes(h)[0] for h in range(cfg.islands)]
    t0 = time.perf_counter()
    procs = []
    for i in range(cfg.islands):
        cmd = ["ip", "netns", "exec", cluster.names[i], sys.executable, "-m", "stalwart", "train", "--config",
               cfg.train_config, "--nproc-per-node", str(cfg.procs), "--parallelism.islands", str(cfg.islands),
               "--parallelism.data_parallel", "replicate", "--fault.replica_group", str(i), "--fault.lighthouse",
               f"{cluster.addr(0)}:{port}", "--run.dir", str(run), "--training.steps", str(cfg.steps),
               "--metrics.progress", "false", "--checkpoint.interval", "0", "--sample.max_new_tokens", "0",
               *variant_args(spec), *cfg.train_args]
        log = open(root / f"{run.name}-island{i}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + cfg.timeout_s
    codes = []
    try:
        for p, log in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            log.close()
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    wall = time.perf_counter() - t0
    if any(codes):
        tail = (root / f"{run.name}-island{codes.index(next(c for c in codes if c))}.log").read_text()[-2000:]
        raise RuntimeError(f"{spec}: an island exited {codes}:\n{tail}")
    sent = sum(cluster.link_bytes(h)[0] - before[h] for h in range(cfg.islands))
    out = {"variant": spec, "wall_s": wall, "link_bytes": sent, **_figures(run, cfg.islands),
           "load": os.getloadavg()[0]}
    out.update(predicted(spec, out, cfg))
    out["tokens_per_s"] = out["tokens"] / out["train_s"]
    out["link_bytes_per_token"] = sent / out["tokens"]
    return out


def run(cfg: IslandsBenchConfig) -> list[dict]:
    from stalwart.comm.netns import NetnsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise ConfigError(f"stalwart bench islands needs network namespaces: {reason}")
    for spec in cfg.variants:
        variant_args(spec)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="stw-islands-") as tmp, \
            NetnsCluster(cfg.islands, cfg.rate_mbit, cfg.delay_ms) as cluster:
        root = Path(cfg.keep) if cfg.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        print(f"# {cfg.islands} islands x {cfg.procs} process(es), links {cfg.rate_mbit:g} Mbit/s, "
              f"{cfg.delay_ms:g} ms one way per link ({cluster.delay_how}), {cfg.steps} steps of "
              f"--config {cfg.train_config} {' '.join(cfg.train_args)}", flush=True)
        port = 29800
        for rep in range(cfg.repeats):
            for spec in cfg.variants:  # interleaved: every variant once per round
                port += 1
                r = {"repeat": rep, **run_variant(cluster, spec, cfg, root, port)}
                results.append(r)
                print(f"{spec:<24} rep {rep}: {r['tokens_per_s']:8.0f} tok/s (train {r['train_s']:6.1f} s, command "
                      f"{r['wall_s']:6.1f} s)  link {r['link_bytes_per_token']:9.2f} B/token  utilisation "
                      f"{100 * r['utilisation']:5.1f} %  eval loss {r['eval_loss']:.4f}  load {r['load']:.1f}  step "
                      f"{1000 * r['measured_step_s']:.1f} ms, planner {1000 * r['predicted_step_s']:.1f} ms "
                      f"({100 * r['step_error']:+.1f} %)",
                      flush=True)
    base = [r for r in results if r["variant"] == "sync"]
    if base:
        b_tps = statistics.mean(r["tokens_per_s"] for r in base)
        b_bpt = statistics.mean(r["link_bytes_per_token"] for r in base)
        b_loss = statistics.mean(r["eval_loss"] for r in base)
        print("\nvs sync (means of the repeats):")
        for spec in cfg.variants:
            rs = [r for r in results if r["variant"] == spec]
            tps = statistics.mean(r["tokens_per_s"] for r in rs)
            bpt = statistics.mean(r["link_bytes_per_token"] for r in rs)
            loss = statistics.mean(r["eval_loss"] for r in rs)
            print(f"  {spec:<24} speed x{tps / b_tps:5.2f}  link bytes / {b_bpt / bpt:7.1f}  eval loss "
                  f"{100 * (loss - b_loss) / b_loss:+5.2f} %")
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(results, indent=1))
    return results


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print(help_text(IslandsBenchConfig))
        return 0
    file = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        file, argv = argv[1], argv[2:]
    cfg = load(IslandsBenchConfig, file, argv)
    run(cfg)
    sys.stdout.flush()
    return 0
