"""`stalwart rl --rl.algorithm dapo|rloo|dr_grpo` for real, two steps each on four families: every
algorithm trains through the same actors and objective as GRPO (whose own runs are in test_rl_e2e.py).
The first step's samples do not depend on the algorithm (same seeds, same fine-tuned weights), so
rloo and dr_grpo see the same rewards and differ in their loss; dapo's dynamic sampling trains only
groups past the planned ones when the planned ones scored alike, each once. dr_grpo's reward workers
use a sandbox service (`stalwart rl sandbox --serve`, `--workers.sandbox_urls`). dapo's policy is a
mixture of experts with routing replay and exact log-probabilities: the trainer routes every position
to the experts the generator recorded, and its log-probabilities are the generator's re-scored ones."""

import json
import math
import re
import shutil
import subprocess
import sys

import httpx
import pytest
from conftest import REPO, cli_env, read_metrics, run_cli

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (apt-get install bubblewrap)")]

QUICK = ["--config", "rl_code", "--rl.mode", "sync", "--rl.steps", "2", "--rl.prompts_per_step", "4",
         "--rl.group_size", "4", "--rl.max_tokens", "24", "--rl.eval_interval", "100", "--rl.eval_samples", "1",
         "--task.tests", "2", "--task.families", "add,sub,mul,length", "--task.eval_per_family", "1",
         "--controller.supervision_poll_s", "0.2"]


def test_dapo_rloo_and_dr_grpo_each_train_two_steps(tmp_path):
    """One test, so that pytest-xdist never starts the three runs twice (a module fixture runs once per
    worker that gets one of its tests)."""
    runs = _run_all(tmp_path)
    for algorithm in ("dapo", "rloo", "dr_grpo"):
        _check_trained(runs, algorithm)
    _check_rloo_and_dr_grpo(runs)
    _check_dapo_refills(runs)
    _check_routing_replay(runs)


def _run_all(root):
    """One run per algorithm; dr_grpo's reward workers send their programs to a sandbox service (the
    run's default limits), whose metrics are kept in <root>/service_metrics.txt."""
    service = subprocess.Popen([sys.executable, "-m", "stalwart", "rl", "sandbox", "--serve", "--service.port", "0"],
                               cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = service.stdout.readline()
        assert line.startswith("stalwart rl sandbox: serving on http://127.0.0.1:"), line + service.stdout.read()
        url = line.split()[5]
        for algorithm in ("dapo", "rloo", "dr_grpo"):
            via = ["--workers.sandbox_urls", url] if algorithm == "dr_grpo" else []
            if algorithm == "dapo":  # a mixture-of-experts policy, its routing replayed (the default)
                via = ["--model.moe_experts", "8", "--rl.logprobs", "exact"]
            run_cli("rl", *QUICK, "--rl.algorithm", algorithm, *via, "--run.dir", str(root / algorithm), timeout=400)
        (root / "service_metrics.txt").write_text(httpx.get(f"{url}/metrics").text)
    finally:
        service.terminate()
        service.wait(30)
    return root


def _steps(run):
    return {m["step"]: m for m in read_metrics(run) if m.get("kind") == "rl"}


def _check_trained(runs, algorithm):
    steps = _steps(runs / algorithm)
    assert sorted(steps) == [1, 2]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in steps.values())
    summary = json.loads((runs / algorithm / "summary.json").read_text())
    assert summary["groups_trained"] == 2 * 4 and 0.0 <= summary["final_reward_mean"] <= 1.0
    dynamic = {"dynamic_sampling_rounds", "sampled_groups", "zero_variance_groups"}
    assert (dynamic <= set(steps[1])) if algorithm == "dapo" else not dynamic & set(steps[1]), algorithm


def _check_rloo_and_dr_grpo(runs):
    """Also: dr_grpo's programs ran in the sandbox service, rloo's in the reward worker's own
    sandboxes, and the same samples got the same rewards."""
    rloo, dr = _steps(runs / "rloo")[1], _steps(runs / "dr_grpo")[1]
    assert rloo["reward_mean"] == dr["reward_mean"] and rloo["train_tokens"] == dr["train_tokens"]
    assert rloo["loss"] != dr["loss"]
    scored = re.findall(r'^stalwart_sandbox_programs_total\{passed="\w+"\} (\S+)$',
                        (runs / "service_metrics.txt").read_text(), re.M)
    assert sum(float(x) for x in scored) >= sum(m["programs_run"] for m in _steps(runs / "dr_grpo").values()) > 0


def _check_dapo_refills(runs):
    run = runs / "dapo"
    journal = [json.loads(x) for x in (run / "controller" / "journal.jsonl").read_text().splitlines()]
    trained = {e["step"]: e["groups"] for e in journal if e["cmd"] == "step"}
    for s, m in _steps(run).items():
        assert len(trained[s]) == len(set(trained[s])) == 4
        refilled = [g for g in trained[s] if int(g.split("/")[1]) >= 4]  # groups sampled past the plan
        assert (m["dynamic_sampling_rounds"] > 0) == (m["sampled_groups"] > 4)
        assert len(refilled) <= m["sampled_groups"] - 4
        if m["zero_variance_groups"] == 0 and m["sampled_groups"] > 4:
            assert refilled  # a planned group that scored alike was replaced


def _check_routing_replay(runs):
    """Every position a trained token depends on had the generator's recorded experts, both sparse layers
    took them, and the trainer's log-probabilities equal the re-scored ones exactly (both replay); the
    trainer's own top-k agrees with the records (a record misplaced by one position would not), and the
    sampler's log-probabilities are the re-scored ones up to rounding. A dense policy replays nothing."""
    for m in _steps(runs / "dapo").values():
        assert m["routing_layers"] == 2 and m["routing_unrecorded"] == 0 and m["routing_replayed"] > 0, m
        assert m["logprob_mismatch_max"] == 0.0 and m["routing_flip_frac"] <= 0.01, m
        assert 0.0 <= m["sampler_mismatch_max"] < 1e-3, m
    assert "routing_replayed" not in _steps(runs / "rloo")[1]
