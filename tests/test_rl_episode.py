"""Multi-turn episodes, pure logic: a conversation's tokens and policy mask, the feedback a failed turn
appends, the packed rows and the loss that cover the policy's own tokens only, the visible tests apart
from the hidden ones, and a pending episode written and read back (the runs are in test_rl_multiturn_e2e.py)."""

import numpy as np
import pytest
import torch

from stalwart.rl import rollout
from stalwart.rl.episode import Conversation, feedback_ids, feedback_text, segments, turn_seed
from stalwart.rl.tasks import BY_NAME, Instance, split

pytestmark = pytest.mark.unit


def _episode() -> Conversation:
    """Turn 1 [10, 11, 2] (2 = end of text), feedback [40, 41], turn 2 [12, 2]."""
    c = Conversation()
    c.add_turn([10, 11, 2], [-0.5, -0.25, -0.125])
    c.add_feedback([40, 41])
    c.add_turn([12, 2], [-1.0, -2.0])
    return c


def test_a_conversation_keeps_the_policys_tokens_apart_from_the_feedback():
    c = _episode()
    assert c.tokens == [10, 11, 2, 40, 41, 12, 2]
    assert c.mask == [1, 1, 1, 0, 0, 1, 1]
    assert c.logprobs == [-0.5, -0.25, -0.125, 0.0, 0.0, -1.0, -2.0]
    assert c.turns == 2 and c.program() == [12, 2]
    assert segments(c.tokens, c.mask) == [(True, [10, 11, 2]), (False, [40, 41]), (True, [12, 2])]
    assert rollout.first_turn(c.tokens, c.mask) == [10, 11, 2]
    assert rollout.last_turn([7, 8], [1, 1]) == [7, 8] and rollout.last_turn([], []) == []
    assert rollout.last_turn([7, 8, 9], [1, 0, 0]) == [7]  # a cut last feedback: the last program is turn 1


def test_packed_multi_turn_rows_mask_the_prompt_and_the_feedback():
    from stalwart.rl.rollout import ADVANTAGE, MASK, OLD_LOGP, TOKEN, Group, GroupRequest, pack_group

    c, one = _episode(), Conversation()
    one.add_turn([13, 2], [-0.75, -0.5])  # passed the visible tests after one turn
    req = GroupRequest(1, 0, Instance("add", (3,)), (0, 1))
    g = Group(req, [5, 6], [c.tokens, one.tokens], [c.logprobs, one.logprobs], 0, masks=[c.mask, one.mask])
    assert g.programs() == [[12, 2], [13, 2]] and g.policy_tokens() == 5 + 2
    inputs, rows = pack_group(g, np.array([1.5, -1.5]), rollout.row_length(2, 3, 2, 2), 0, 0.25, 0, False)
    assert rollout.row_length(2, 3, 2, 2) == 2 + 2 * 3 + 2 - 1 == 9
    # position p predicts token p + 1: the prompt's last position (1) predicts the first response token
    assert inputs[0].tolist() == [5, 6, 10, 11, 2, 40, 41, 12, 0]
    assert rows[0, :, TOKEN].tolist() == [6, 10, 11, 2, 40, 41, 12, 2, 0]
    assert rows[0, :, MASK].tolist() == [0, 1, 1, 1, 0, 0, 1, 1, 0]
    assert rows[0, :, OLD_LOGP].tolist() == [0, -0.5, -0.25, -0.125, 0, 0, -1.0, -2.0, 0]
    assert rows[1, :, MASK].tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert rows[0, 1, ADVANTAGE] == 1.5 and rows[1, 1, ADVANTAGE] == -1.5
    # token-mean weighs each of the 7 policy tokens alike; the 2 feedback tokens are not counted
    assert rollout.aggregation_weights([g], "token-mean", 1, 1) == 1 / 7
    one_turn = Group(req, [5, 6], [[10, 2], [11]], [[-1.0, -1.0], [-1.0]], 0)  # masks None: every token
    assert one_turn.programs() == one_turn.responses and one_turn.policy_tokens() == 3
    assert pack_group(one_turn, np.ones(2), 4, 0, 1.0, 0, False)[1][0, :, MASK].tolist() == [0, 1, 1, 0]


def test_the_loss_has_no_gradient_on_feedback_tokens():
    """The objective multiplies by the mask: the logits at feedback positions (and the prompt's) get
    exactly zero gradient, the policy's positions do not."""
    from stalwart.rl.objective import GRPOObjective
    from stalwart.rl.rollout import Group, GroupRequest, pack_group

    c = _episode()
    req = GroupRequest(1, 0, Instance("add", (3,)), (0,))
    g = Group(req, [5, 6], [c.tokens], [c.logprobs], 0, masks=[c.mask])
    _, rows = pack_group(g, np.array([1.0]), 9, 0, 1 / 5, 0, False)
    torch.manual_seed(0)
    logits = torch.randn(1, 9, 64, requires_grad=True)
    GRPOObjective(0.2, 0.2, "token-mean", 0.0)(logits, torch.from_numpy(rows)).backward()
    moved = (logits.grad[0].abs().sum(-1) > 0).tolist()
    assert moved == [False, True, True, True, False, False, True, True, False]


def test_the_feedback_names_the_first_failing_visible_case_and_why():
    cases = [("22", "25"), ("7", "10")]
    assert feedback_text("case 1: wrong answer", cases) == "# input 7 output 10\n# wrong answer\n"
    # a program that does not parse ran no case: its one line names the error
    assert feedback_text("syntax error: invalid syntax (line 1)", cases) == "# syntax error: invalid syntax (line 1)\n"
    long = feedback_text("case 0: exit status 2: " + "x" * 100, [("a\nb", "c")])
    assert long == "# input a\\nb output c\n# exit status 2: " + "x" * 30 + "...\n"  # 48 characters at most
    assert feedback_text("case 1: exit status 1: NameError: name 'x' is not defined", cases) == \
        "# input 7 output 10\n# NameError: name 'x' is not defined\n"  # the exception names it, not the status
    # a cut feedback still ends its line
    assert feedback_ids(lambda s: [ord(ch) for ch in s], "abcdef\n", 4, [10]) == [97, 98, 99, 10]
    assert feedback_ids(lambda s: [ord(ch) for ch in s], "ab\n", 4, [10]) == [97, 98, 10]


def test_a_cut_feedback_keeps_naming_the_error():
    """A tokenizer trained on the task's text spends about a token per character of an error message: a
    32-token feedback cut at its end kept the case and left '# syntax error: ' with no error named."""
    chars = lambda s: [ord(ch) for ch in s]  # noqa: E731  (a token per character)
    text = lambda ids: "".join(map(chr, ids))  # noqa: E731
    cases = [("22", "25"), ("7", "10")]
    cut = text(feedback_ids(chars, feedback_text("syntax error: '(' was never closed (line 1)", cases), 32, [10]))
    assert cut == "# syntax error: '(' was never c\n"
    cut = text(feedback_ids(chars, feedback_text("case 1: exit status 1: NameError: name 'x' is not defined",
                                                  cases), 40, [10]))
    assert cut == "# NameError: name 'x' is not defined\n"  # the reason whole; no room left for the case
    cut = text(feedback_ids(chars, "\n" + feedback_text("case 0: wall-clock timeout", cases), 40, [10]))
    assert cut == "\n# input 22 output\n# wall-clock timeout\n"  # the case line cut, the reason whole
    for reason in ("case 0: wrong answer", "case 1: exit status 1: ValueError: invalid literal for int()",
                   "syntax error: unexpected indent (line 2)", "case 0: CPU-time limit"):
        for limit in (8, 16, 24, 32, 48):
            cut = text(feedback_ids(chars, feedback_text(reason, cases), limit, [10]))
            assert len(cut) <= limit and cut.endswith("\n")
            why = cut.splitlines()[-1]
            assert why.startswith("# ") and len(why) >= min(limit - 1, 8), (reason, limit, cut)


def test_turn_seeds_keep_the_first_turn_and_differ_after():
    assert turn_seed(1234, 1) == 1234
    assert turn_seed(1234, 2) == turn_seed(1234, 2) != turn_seed(1234, 3)
    assert turn_seed(1234, 2) != turn_seed(1235, 2)


def test_visible_tests_are_drawn_apart_from_the_hidden_ones():
    inst = Instance("add", (1,))
    hidden = inst.cases(3, 0)
    assert [c.input for c in hidden] == ["72", "7", "4"]  # the hidden draw is what it always was
    visible = inst.visible_cases(2, 0, 3)
    assert visible == inst.visible_cases(2, 0, 3) and len(visible) == 2
    train, held = split(0, 0.3)
    for i in train + held:
        vis, hid = i.visible_cases(2, 0, 3), i.cases(3, 0)
        assert len(vis) == 2 and all(BY_NAME[i.family].answer(c.input, i.params) == c.output for c in vis)
        if i.family in ("add", "list_sum", "reverse", "pair_sum"):  # families with many inputs: always apart
            assert not {c.input for c in vis} & {c.input for c in hid}, i.key


def test_a_pending_episode_is_written_and_read_back_bit_for_bit():
    from stalwart.rl.state import group_of, group_record

    train, _ = split(0, 0.2)
    (req,) = rollout.plan_step(3, 0, train, 1, 2)
    c = _episode()
    g = rollout.Group(req, [1, 2], [c.tokens, [9]], [c.logprobs, [-0.5]], 2, masks=[c.mask, [1]])
    back = group_of(group_record(g), {i.key: i for i in train})
    assert back == g and back.masks == [c.mask, [1]]
