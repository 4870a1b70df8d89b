"""`stalwart rl` with a sharded, split and sparse trainer mesh: a mixture-of-experts policy (one dense
layer, one sparse) trained with DAPO by four
trainer ranks laid out dp_shard=2 x tp=2 x ep=2 (FSDP, tensor parallel and expert parallel at once,
through the pre-training parallelism code), against the same policy on two FSDP ranks (the data-parallel
layout, same data-parallel degree). Exact log-probabilities hold in both: the FSDP run's generator
re-scores with a plain copy of the model, the split run's trainers score with their own forward (two
updates per step: the first from its own forward, the second's rows in a pass before it); the mismatch
is exactly 0.0 in every step of each. The weights reach the generator from the
split layout's shards (the experts, held by both tp ranks, sent once). Layouts that cannot be exact are
refused in one line. A tensor-parallel generator (two processes, the engine split as `stalwart serve --tp`
splits it) trains the FSDP run's steps bit for bit, and a follower process killed mid-run replaces its
whole generator.

The FSDP and split runs are also the test of DAPO's dynamic sampling (the other algorithms' runs are in
test_rl_algorithms_e2e.py) and of routing replay: the trainer routes every position to the experts the
generator recorded."""

import json
import math
import os
import shutil
import signal
import time

import pytest
from conftest import read_metrics, run_cli
from controller_kill import has, journal, start

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (apt-get install bubblewrap)")]

QUICK = ["--config", "rl_code", "--model.flavor", "debug-moe", "--rl.algorithm", "dapo", "--rl.mode", "sync",
         "--rl.logprobs", "exact",
         "--rl.steps", "2", "--rl.updates_per_step", "2", "--rl.prompts_per_step", "4", "--rl.group_size", "4", "--rl.max_tokens", "24",
         "--rl.eval_interval", "100", "--rl.eval_samples", "1", "--task.tests", "2", "--task.families",
         "add,sub,mul,length", "--task.eval_per_family", "1", "--workers.trainers", "2", "--parallelism.dp_shard", "2",
         "--controller.supervision_poll_s", "0.2"]
SPLIT = ["--workers.trainers", "4", "--parallelism.tp", "2", "--parallelism.ep", "2"]
COMPARED = ("reward_mean", "loss", "grad_norm", "logprob_mismatch_max", "clip_fraction", "train_tokens",
            "routing_flip_frac")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-layouts")
    run_cli("rl", *QUICK, "--run.dir", str(root / "fsdp"), timeout=600)
    run_cli("rl", *QUICK, *SPLIT, "--run.dir", str(root / "split"), timeout=600)
    return root


def _metrics(run, kind):
    return {m["step"]: m for m in read_metrics(run) if m.get("kind") == kind}


def test_every_layout_trains_with_exact_logprobs_and_matches_the_data_parallel_run(runs):
    fsdp, split = runs / "fsdp", runs / "split"
    layouts = {r.name: [json.loads(x) for x in (r / "events.jsonl").read_text().splitlines() if '"rl_trainers"' in x]
               for r in (fsdp, split)}
    assert layouts["fsdp"][0]["layout"] == "dp_shard=2" and layouts["split"][0]["layout"] == "dp_shard=2 x tp=2 x ep=2"
    a, b = _metrics(fsdp, "rl"), _metrics(split, "rl")
    assert sorted(a) == sorted(b) == [1, 2]
    for s in (1, 2):
        for m in (a[s], b[s]):
            assert m["logprob_mismatch_max"] == 0.0 and m["logprob_mismatch_mean"] == 0.0, (s, m)
        assert a[s]["rescore_s"] > 0 and "exact_score_s" not in a[s]  # the generator re-scored
        # The trainers scored: the first update from its own forward, the second's rows in a pass before it.
        assert b[s]["exact_score_s"] > 0 and b[s]["rescore_s"] < a[s]["rescore_s"]
        # The same samples (weights equal to rounding), so the same rewards; the losses and gradients go
        # through other summation orders (tp's partial products, ep's expert batches): equal to rounding.
        assert a[s]["reward_mean"] == b[s]["reward_mean"] and a[s]["train_tokens"] == b[s]["train_tokens"]
        assert math.isclose(a[s]["loss"], b[s]["loss"], rel_tol=1e-5, abs_tol=1e-9)
        assert math.isclose(a[s]["grad_norm"], b[s]["grad_norm"], rel_tol=1e-4, abs_tol=1e-7)
    sa, sb = _metrics(fsdp, "sft"), _metrics(split, "sft")
    assert sa[1]["loss"] == sb[1]["loss"]  # the same initial weights in every layout (seeded per parameter name)
    assert math.isclose(sa[max(sa)]["loss"], sb[max(sb)]["loss"], rel_tol=1e-4)
    # The generator holds the weights the split trainers sent (each element once): its evaluation ran on them.
    assert 0.0 <= json.loads((split / "summary.json").read_text())["final_reward_mean"] <= 1.0
    for run in (fsdp, split):
        _check_dapo_refills(run)
        _check_routing_replay(run)


def _check_dapo_refills(run):
    """DAPO trains the planned number of groups, each once; dynamic sampling draws groups past the planned
    ones when the planned ones scored alike, and trains them in their place."""
    steps = _metrics(run, "rl")
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in steps.values())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["groups_trained"] == 2 * 4 and 0.0 <= summary["final_reward_mean"] <= 1.0
    journal = [json.loads(x) for x in (run / "controller" / "journal.jsonl").read_text().splitlines()]
    trained = {e["step"]: e["groups"] for e in journal if e["cmd"] == "step"}
    for s, m in steps.items():
        assert {"dynamic_sampling_rounds", "sampled_groups", "zero_variance_groups"} <= set(m)
        assert len(trained[s]) == len(set(trained[s])) == 4
        refilled = [g for g in trained[s] if int(g.split("/")[1]) >= 4]  # groups sampled past the plan
        assert (m["dynamic_sampling_rounds"] > 0) == (m["sampled_groups"] > 4)
        assert len(refilled) <= m["sampled_groups"] - 4
        if m["zero_variance_groups"] == 0 and m["sampled_groups"] > 4:
            assert refilled  # a planned group that scored alike was replaced


def _check_routing_replay(run):
    """Every position a trained token depends on had the generator's recorded experts, the sparse layer took
    them (records of several sparse layers: test_routing_replay.py), and the trainer's log-probabilities
    equal the exact ones (both replay); the trainer's own top-k agrees with the records (a record misplaced
    by one position would not), and where the generator re-scored, the sampler's log-probabilities are the
    re-scored ones up to rounding. A dense policy replays nothing (test_rl_algorithms_e2e.py)."""
    for m in _metrics(run, "rl").values():
        assert m["routing_layers"] == 1 and m["routing_unrecorded"] == 0 and m["routing_replayed"] > 0, m
        assert m["logprob_mismatch_max"] == 0.0 and m["routing_flip_frac"] <= 0.01, m
        if "exact_score_s" not in m:
            assert 0.0 <= m["sampler_mismatch_max"] < 1e-3, m


def test_a_layout_that_cannot_be_exact_is_one_line_through_the_cli(tmp_path):
    """The other refusals are config checks (tests/test_rl_layouts.py); this one and the model check go
    through the command."""
    p = run_cli("rl", "--config", "rl_code", "--workers.trainers", "2", "--parallelism.tp", "2", "--rl.mode", "async",
                "--rl.logprobs", "exact", "--run.dir", str(tmp_path / "x"), check=False, timeout=120)
    assert p.returncode == 2 and "needs rl.mode = sync" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = run_cli("rl", "--config", "rl_code", "--workers.trainers", "2", "--parallelism.dp_shard", "2", "--parallelism.ep",
                "2", "--run.dir", str(tmp_path / "y"), check=False, timeout=120)
    assert p.returncode == 2 and "needs a mixture-of-experts model" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = run_cli("rl", "--config", "rl_code", "--workers.generator_tp", "3", "--run.dir", str(tmp_path / "z"),
                check=False, timeout=120)
    assert p.returncode == 2 and "workers.generator_tp (3) must divide" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_tensor_parallel_generator_trains_the_same_steps_and_a_lost_process_replaces_it(runs, tmp_path):
    """The FSDP run again with ``workers.generator_tp 2``: its engine's row-parallel sums run in another
    order (the sampler's log-probabilities differ in the last bits), but no sampled token changed and the
    exact re-scoring copy is the plain forward, so every step's figures equal the one-process generator's;
    the follower process of the generator is killed once step 1 is trained, and the generator (both
    processes) is replaced and brought up to the current weights."""
    run = tmp_path / "generator-tp"
    proc = start("rl", *QUICK, "--workers.generator_tp", "2", "--run.dir", str(run))
    try:
        deadline = time.monotonic() + 600
        while not has(journal(run), "applied", 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
        members = [e for e in events if e["event"] == "rl_meshes"][-1]["generator_members"]["0"]
        os.kill(members[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    replaced = [e for e in events if e["event"] == "rl_worker_replaced" and e["mesh"] == "generator"]
    assert len(replaced) == 1 and replaced[0]["pid"] not in members, replaced
    a, b = _metrics(runs / "fsdp", "rl"), _metrics(run, "rl")
    assert sorted(a) == sorted(b) == [1, 2]
    for s in (1, 2):
        assert b[s]["logprob_mismatch_max"] == 0.0 and b[s]["rescore_s"] > 0, b[s]
        assert {k: a[s][k] for k in COMPARED} == {k: b[s][k] for k in COMPARED}, s
