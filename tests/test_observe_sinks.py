"""Metric sinks (JSONL, TensorBoard, Prometheus over loopback, W&B absent) and the recorder's wrapping
of torch.distributed in a 1-process gloo group (sync and async ops, SIGUSR1 dump)."""

import importlib.util
import json
import os
import signal
import urllib.request

import pytest

from stalwart.errors import UserError
from stalwart.config.job import ObserveConfig
from stalwart.observe.prometheus import PrometheusSink
from stalwart.observe.sinks import JsonlSink, MetricsFanout, WandbSink, build_sinks

RECORDS = [{"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.3, "time": 1.8e9},
           {"step": 2, "loss": 4.5, "lr": 2e-3, "tokens_per_s": 1100.0, "mfu": float("nan"), "time": 1.8e9 + 1},
           {"step": 2, "eval_loss": 4.7, "time": 1.8e9 + 2}]


@pytest.mark.unit
def test_jsonl_and_fanout_drop_a_broken_sink(tmp_path, capsys):
    class Broken:
        def write(self, record):
            raise OSError("disk on fire")

        def close(self):
            pass

    fan = MetricsFanout([JsonlSink(tmp_path / "metrics.jsonl"), Broken()])
    for r in RECORDS:
        fan.write(r)
    fan.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 2] and lines[1]["mfu"] == "nan"
    assert "Broken failed and is disabled: disk on fire" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_sink_writes_readable_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = ObserveConfig(tensorboard=True)
    fan = build_sinks(cfg, tmp_path, "t")
    for r in RECORDS:
        fan.write(r)
    fan.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"loss", "lr", "tokens_per_s", "mfu", "eval_loss"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 5.0), (2, 4.5)]
    assert len(acc.Scalars("mfu")) == 1  # NaN skipped


def scrape(port: int) -> dict:
    """{(sample name, frozen labels): value} of one endpoint, parsed by prometheus_client's own parser;
    also checks every family has HELP text and a type."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        assert fam.documentation and fam.type in ("gauge", "counter"), fam
        assert fam.name.startswith("stalwart_train_") and not fam.name.endswith("_s"), fam.name
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


@pytest.mark.unit
def test_prometheus_follows_the_conventions_per_rank_and_run_level(tmp_path):
    from stalwart.observe.timer import PhaseTimer

    lab = {"run": "demo", "run_dir": "/runs/demo"}
    main, other = PrometheusSink(0, rank=0, main=True, labels=lab), PrometheusSink(0, rank=1, main=False, labels=lab)
    try:
        assert main.host == "127.0.0.1"
        for sink in (main, other):
            timer = PhaseTimer(sink.collector.rank, "cpu", None, flush_every=2, on_flush=sink.write_timings)
            for step in (1, 2, 3):
                timer.begin_step(step)
                with timer.phase("forward"):
                    pass
                timer.end_step()
                sink.write({"step": step, "loss": 5.0 - step, "lr": 1e-3 * step, "grad_norm": 0.5,
                            "tokens_seen": 64 * step, "step_time_s": 0.25 * (sink.collector.rank + 1),
                            "mem_bytes": 1000 + step, "mfu": float("nan"), "time": 1.8e9})
            sink.write({"step": 3, "eval_loss": 4.7, "time": 1.8e9})
        m, o = scrape(main.port), scrape(other.port)
    finally:
        main.close()
        other.close()
    run = frozenset(lab.items())

    def r(rank, **more):
        return frozenset({**lab, "rank": str(rank), **more}.items())

    assert m[("stalwart_train_tokens_total", run)] == 192.0  # a counter: tokens since the run began
    assert m[("stalwart_train_loss", run)] == 2.0 and m[("stalwart_train_eval_loss", run)] == 4.7
    assert m[("stalwart_train_learning_rate", run)] == pytest.approx(3e-3)
    assert m[("stalwart_train_step", run)] == 3.0 and m[("stalwart_train_grad_norm", run)] == 0.5
    assert m[("stalwart_train_mfu_ratio", run)] != m[("stalwart_train_mfu_ratio", run)]  # NaN
    for rank, vals in ((0, m), (1, o)):
        assert vals[("stalwart_train_step_duration_seconds", r(rank))] == 0.25 * (rank + 1)
        assert vals[("stalwart_train_step_seconds_total", r(rank))] == pytest.approx(0.75 * (rank + 1))
        assert vals[("stalwart_train_steps_total", r(rank))] == 3.0
        assert vals[("stalwart_train_memory_bytes", r(rank))] == 1003.0
        assert vals[("stalwart_train_phase_seconds_total", r(rank, phase="forward"))] > 0  # 2 flushed steps
    assert not any(name in ("stalwart_train_loss", "stalwart_train_tokens_total") for name, _ in o)  # rank 0's


@pytest.mark.unit
def test_build_sinks_rank_filtering_and_wandb_absent(tmp_path):
    assert build_sinks(ObserveConfig(), tmp_path, is_main=False).sinks == []
    fan = build_sinks(ObserveConfig(prometheus_port=0), tmp_path)
    assert [type(s).__name__ for s in fan.sinks] == ["JsonlSink"]
    fan.close()
    from stalwart.comm.launch import free_port

    fan = build_sinks(ObserveConfig(prometheus_port=free_port()), tmp_path, is_main=False, rank=3)
    assert [type(s).__name__ for s in fan.sinks] == ["PrometheusSink"]  # per-rank series on every rank
    fan.close()
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(UserError, match="'wandb' package is not installed"):
            WandbSink("p", "n")


@pytest.mark.unit
def test_recorder_wraps_torch_distributed_and_dumps_on_sigusr1(tmp_path):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from stalwart.observe.flight import FlightRecorder

    orig = dist.all_reduce
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rec = FlightRecorder(0, 1, tmp_path, hang_timeout_s=0).install()
    try:
        assert dist.all_reduce is not orig and c10d.all_reduce is dist.all_reduce
        dist.all_reduce(torch.ones(3, 4))
        dist.all_reduce(torch.ones(2), async_op=True).wait()
        out = torch.empty(5)
        dist.all_gather_single(out, torch.ones(5))  # what FSDP2 calls
        objs = [None]
        dist.all_gather_object(objs, {"a": 1})  # calls all_gather inside: recorded once
        dist.barrier()
        os.kill(os.getpid(), signal.SIGUSR1)
        d = json.loads((tmp_path / "flight" / "rank-0.json").read_text())
    finally:
        rec.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is orig and c10d.all_reduce is orig
    ops = [e["op"] for e in d["entries"]]
    assert ops == ["all_reduce", "all_reduce", "all_gather_single", "all_gather_object", "barrier"]
    assert [e["seq"] for e in d["entries"]] == [0, 1, 2, 3, 4]
    e0, e1 = d["entries"][:2]
    assert e0["sizes"] == [[3, 4]] and e0["dtype"] == "float32" and e0["group"] == "default"
    assert e1["async"] and e1["state"] == "completed"  # completed by the Work's future
    assert all(e["state"] == "completed" and e["t_end"] >= e["t_start"] for e in d["entries"])
    assert d["reason"] == "signal SIGUSR1"


@pytest.mark.multiproc
def test_sigterm_dumps_then_terminates(tmp_path):
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from stalwart.observe.flight import FlightRecorder\n"
            f"rec = FlightRecorder(0, 1, {str(tmp_path)!r}, hang_timeout_s=0).install()\n"
            "rec.set_phase('forward', 12)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(10)\n")
    p = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert p.returncode == -signal.SIGTERM, p.stderr
    d = json.loads((tmp_path / "flight" / "rank-0.json").read_text())
    assert d["reason"] == "signal SIGTERM" and d["step"] == 12 and d["phase"] == "forward"


@pytest.mark.unit
def test_prometheus_run_label_names_the_run_directory(tmp_path):
    run = tmp_path / 'my "run"'
    from stalwart.comm.launch import free_port

    fan = build_sinks(ObserveConfig(prometheus_port=free_port()), run, run_name="default")
    prom = next(s for s in fan.sinks if isinstance(s, PrometheusSink))
    try:
        prom.write(RECORDS[0])
        labels = {dict(k)["run"] for k in (k for _, k in scrape(prom.port))}
        assert labels == {'my "run"'}
    finally:
        fan.close()
