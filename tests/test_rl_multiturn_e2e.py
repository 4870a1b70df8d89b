"""`stalwart rl --rl.turns 2` for real: episodes are conversations (program, the sandbox's feedback on the
visible tests, program), the loss covers the policy's tokens only, exact log-probabilities stay exact
on the longer rows, and a controller killed mid-run resumes bit for bit (the step it computes again
matches the journal of the uninterrupted session). One run, killed once and resumed."""

import json
import shutil

import pytest
from conftest import read_metrics, run_cli
from controller_kill import has, kill_when, start

from stalwart.config.sandbox import SandboxConfig
from stalwart.rl.episode import feedback_text
from stalwart.sandbox.local import Sandbox
from stalwart.rl.tasks import all_instances

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (apt-get install bubblewrap)")]

CMD = ["rl", "--config", "rl_code", "--rl.mode", "sync", "--rl.logprobs", "exact", "--rl.turns", "2",
       "--rl.feedback_tokens", "40", "--rl.steps", "3", "--sft.steps", "8", "--rl.prompts_per_step", "4",
       "--rl.group_size", "4", "--rl.max_tokens", "24", "--rl.eval_interval", "100", "--rl.eval_samples", "2",
       "--task.tests", "2", "--task.families", "add,sub,mul,length", "--task.eval_per_family", "2",
       "--workers.snapshot_interval", "2", "--controller.supervision_poll_s", "0.2"]


def test_multi_turn_episodes_feed_back_the_sandbox_mask_the_feedback_and_resume_bit_for_bit(tmp_path):
    run = tmp_path / "turns"
    kill_when(start(*CMD, "--run.dir", str(run)), run, lambda j: has(j, "applied", 3), timeout_s=400)
    out = run_cli(*CMD, "--run.dir", str(run), timeout=400).stdout
    assert "resumed at RL step 2" in out
    s = json.loads((run / "summary.json").read_text())
    # step 3, computed again from the snapshot of step 2, equals the killed session's (sync: strict)
    assert s["resumed"] == {"step": 2, "source": "memory", "checks": 1, "checks_matched": 1, "checks_differed": 0}

    steps = {m["step"]: m for m in read_metrics(run) if m.get("kind") == "rl"}
    assert sorted(steps) == [1, 2, 3]
    for m in steps.values():
        assert m["logprob_mismatch_max"] == 0.0  # the trainer's numbers, on rows holding feedback too
        assert m["train_tokens"] == m["rollout_tokens"]  # the loss covers exactly the tokens the policy wrote
        assert 1.0 <= m["turns_mean"] <= 2.0
    assert sum(m["feedback_tokens"] for m in steps.values()) > 0  # ... and none of the feedback after a failure

    evals = [m for m in read_metrics(run) if m.get("kind") == "eval"]
    assert all(0.0 <= e["held_out_reward_turn1"] <= 1.0 and 1.0 <= e["turns_mean"] <= 2.0 for e in evals)
    # turn 2's prompt holds what the sandbox said of turn 1's program on the instance's visible tests
    instances = {(i.family, i.prompt): i for i in all_instances()}
    sandbox = Sandbox(SandboxConfig())
    checked = 0
    for family, ex in s["final_examples"].items():
        conv = ex["conversation"]
        assert conv[-1] == ex["program"] and len(conv) in (1, 3), conv
        inst = instances[family, ex["prompt"]]
        visible = inst.visible_cases(2, 0, 2)
        verdict = sandbox.score(conv[0], visible)
        if len(conv) == 1:  # stopped after one turn: its program passed the visible tests
            assert verdict.passed == verdict.total
            continue
        expected = feedback_text(verdict.reason, [(c.input, c.output) for c in visible])
        feedback = conv[1].removeprefix("\n")  # a line break first when turn 1 ran out of tokens
        *case, why = feedback.splitlines(keepends=True)
        *want_case, want_why = expected.splitlines(keepends=True)
        # the reason names the error: whole, or cut at its end (rl.feedback_tokens), never left empty
        assert len(why) > len("# x\n") and (why == want_why or want_why.startswith(why[:-1].rstrip("\ufffd")))
        if case:  # the case line before it (cut first, or dropped, to keep the reason)
            assert want_case and want_case[0].startswith(case[0][:-1].rstrip("\ufffd")), (feedback, expected)
            assert want_case[0] in {f"# input {c.input} output {c.output}\n" for c in visible}
        assert not {c.input for c in visible} & {c.input for c in inst.cases(2, 0)}  # hidden tests stay hidden
        checked += 1
    assert checked >= 1
