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
from stalwart.observe.sinks import JsonlSink, MetricsFanout, PrometheusSink, WandbSink, build_sinks

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


@pytest.mark.unit
def test_prometheus_endpoint_scraped_over_loopback():
    sink = PrometheusSink(port=0, labels={"run": "demo"})
    try:
        assert sink.host == "127.0.0.1"
        for r in RECORDS:
            sink.write(r)
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
        assert '# TYPE stalwart_loss gauge' in body
        assert 'stalwart_loss{run="demo"} 4.5' in body and 'stalwart_step{run="demo"} 2.0' in body
        assert 'stalwart_eval_loss{run="demo"} 4.7' in body and 'stalwart_mfu{run="demo"} NaN' in body
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/other", timeout=5)
    finally:
        sink.close()


@pytest.mark.unit
def test_build_sinks_rank_filtering_and_wandb_absent(tmp_path):
    assert build_sinks(ObserveConfig(), tmp_path, is_main=False).sinks == []
    fan = build_sinks(ObserveConfig(prometheus_port=0), tmp_path)
    assert [type(s).__name__ for s in fan.sinks] == ["JsonlSink"]
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
        body = prom.render()
        assert 'run="my \\"run\\""' in body and "default" not in body
    finally:
        fan.close()
