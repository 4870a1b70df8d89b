"""`stalwart rl --rl.algorithm rloo|dr_grpo` for real, two steps each on four families: every algorithm
trains through the same actors and objective as GRPO (whose own runs are in test_rl_e2e.py). The first
step's samples do not depend on the algorithm (same seeds, same fine-tuned weights), so rloo and dr_grpo
see the same rewards and differ in their loss. dr_grpo's reward workers use a sandbox service
(`stalwart rl sandbox --serve`, `--workers.sandbox_urls`). dapo (dynamic sampling, on a mixture of experts
with routing replay) trains the two layouts of test_rl_layouts_e2e.py, which check it there."""

import json
import math
import re
import shutil
import subprocess

import httpx
import pytest
from conftest import popen_cli, read_metrics, run_cli

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (apt-get install bubblewrap)")]

QUICK = ["--config", "rl_code", "--rl.mode", "sync", "--rl.steps", "2", "--rl.prompts_per_step", "4",
         "--rl.group_size", "4", "--rl.max_tokens", "24", "--rl.eval_interval", "100", "--rl.eval_samples", "1",
         "--task.tests", "2", "--task.families", "add,sub,mul,length", "--task.eval_per_family", "1",
         "--controller.supervision_poll_s", "0.2"]


def test_rloo_and_dr_grpo_each_train_two_steps(tmp_path):
    runs = _run_all(tmp_path)
    for algorithm in ("rloo", "dr_grpo"):
        _check_trained(runs, algorithm)
    _check_rloo_and_dr_grpo(runs)
    assert "routing_replayed" not in _steps(runs / "rloo")[1]  # a dense policy replays nothing


def _run_all(root):
    """One run per algorithm; dr_grpo's reward workers send their programs to a sandbox service (the
    run's default limits), whose metrics are kept in <root>/service_metrics.txt."""
    service = popen_cli("rl", "sandbox", "--serve", "--service.port", "0",
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = service.stdout.readline()
        assert line.startswith("stalwart rl sandbox: serving on http://127.0.0.1:"), line + service.stdout.read()
        url = line.split()[5]
        for algorithm in ("rloo", "dr_grpo"):
            via = ["--workers.sandbox_urls", url] if algorithm == "dr_grpo" else []
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
    assert not dynamic & set(steps[1]), algorithm  # dapo's own (test_rl_layouts_e2e.py)


def _check_rloo_and_dr_grpo(runs):
    """Also: dr_grpo's programs ran in the sandbox service, rloo's in the reward worker's own
    sandboxes, and the same samples got the same rewards."""
    rloo, dr = _steps(runs / "rloo")[1], _steps(runs / "dr_grpo")[1]
    assert rloo["reward_mean"] == dr["reward_mean"] and rloo["train_tokens"] == dr["train_tokens"]
    assert rloo["loss"] != dr["loss"]
    scored = re.findall(r'^stalwart_sandbox_programs_total\{passed="\w+"\} (\S+)$',
                        (runs / "service_metrics.txt").read_text(), re.M)
    assert sum(float(x) for x in scored) >= sum(m["programs_run"] for m in _steps(runs / "dr_grpo").values()) > 0
