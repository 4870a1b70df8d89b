"""RL post-training, pure logic: GRPO advantages and loss against hand-computed values, the code
task's families and its held-out split."""

import math

import numpy as np
import pytest
import torch

from stalwart.rl import grpo
from stalwart.rl.tasks import BY_NAME, FAMILIES, Instance, all_instances, split

pytestmark = pytest.mark.unit


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = grpo.group_advantages(r, eps=0.0 + 1e-12)
    std = math.sqrt(((0.5 ** 2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert torch.equal(a[1], torch.zeros(4))  # a group that scored alike carries no signal
    assert torch.equal(grpo.group_advantages(r, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="k >= 2"):
        grpo.group_advantages(torch.ones(3, 1))


def test_clipped_loss_and_aggregations_by_hand():
    # two responses, three token slots; the second response has two tokens.
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.9, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.4, 0.9, 0.3]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -2.0])
    # ratios: [2, 1, 1], [0.5, 1, -]; clip 0.2 -> [1.2, 1, 1], [0.8, 1, -]
    # per-token loss -min(r*A, clip(r)*A): A=1: [-1.2, -1, -1]; A=-2: -min(-1, -1.6) = 1.6, -min(-2,-2) = 2
    tok = [[-1.2, -1.0, -1.0], [1.6, 2.0]]
    parts = grpo.policy_loss(logp, old, adv, mask, how="token-mean")
    assert parts.loss.item() == pytest.approx((sum(tok[0]) + sum(tok[1])) / 5)
    assert parts.clip_fraction.item() == pytest.approx(2 / 5)  # the ratio-2 token and the ratio-0.5 token
    seq_sum = grpo.policy_loss(logp, old, adv, mask, how="seq-mean-token-sum").loss.item()
    assert seq_sum == pytest.approx((sum(tok[0]) + sum(tok[1])) / 2)
    seq_mean = grpo.policy_loss(logp, old, adv, mask, how="seq-mean-token-mean").loss.item()
    assert seq_mean == pytest.approx((sum(tok[0]) / 3 + sum(tok[1]) / 2) / 2)


def test_kl_penalty_is_k3_and_zero_at_the_reference():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    mask = torch.ones(1, 2)
    r = math.log(0.5)  # ref - logp on the first token
    want = (math.exp(r) - r - 1) / 2
    parts = grpo.policy_loss(logp, logp.detach(), torch.zeros(1), mask, ref_logp=ref, kl_coef=0.1)
    assert parts.kl.item() == pytest.approx(want)
    assert parts.loss.item() == pytest.approx(0.1 * want)
    same = grpo.policy_loss(logp, logp, torch.zeros(1), mask, ref_logp=logp, kl_coef=0.1)
    assert same.kl.item() == 0.0


def test_the_loss_gradient_pushes_up_tokens_with_positive_advantage():
    logits = torch.zeros(2, 4, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :1].T  # (1 response, 2 tokens): token 0 at each position
    parts = grpo.policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    parts.loss.backward()
    assert (logits.grad[:, 0] < 0).all()  # gradient descent raises the sampled token's logit


def test_task_has_twenty_families_with_consistent_rules():
    assert len(FAMILIES) >= 20 and len(BY_NAME) == len(FAMILIES)
    for inst in all_instances():
        cases = inst.cases(4, seed=0)
        assert len(cases) == 4 and len({c.input for c in cases}) == 4, inst.key
        assert inst.cases(4, seed=0) == cases and inst.cases(4, seed=1) != cases
        assert str(inst.params[0]) in inst.prompt or inst.family in ("count_char", "replace"), inst.key


def test_held_out_instances_are_never_trained_on_and_cover_every_family():
    train, held = split(seed=0, fraction=0.25)
    assert not set(train) & set(held) and set(train) | set(held) == set(all_instances())
    for fam in FAMILIES:
        assert any(i.family == fam.name for i in train) and any(i.family == fam.name for i in held), fam.name
    assert split(seed=0, fraction=0.25) == (train, held) and split(seed=1, fraction=0.25)[1] != held
    assert Instance("add", (7,)).solution == "print(int(input())+7)"


# ---------------------------------------------------------------- rollouts and the trainer's objective
def _group(step, index, rewards, version=0, prompt=(5, 6, 7)):
    from stalwart.rl.rollout import Group, GroupRequest
    from stalwart.rl.tasks import Instance

    req = GroupRequest(step, index, Instance("add", (3,)), tuple(range(len(rewards))))
    responses = [[10 + i, 11, 2][: 1 + i % 3] for i in range(len(rewards))]
    logps = [[-0.5 - 0.1 * j for j in range(len(r))] for r in responses]
    return Group(req, list(prompt), responses, logps, version, rewards=list(rewards))


def test_step_plans_are_seeded_and_distinct_per_step():
    from stalwart.rl.rollout import plan_step
    from stalwart.rl.tasks import split

    pool, _ = split(0, 0.3)
    a, b = plan_step(3, 0, pool, 8, 4), plan_step(3, 0, pool, 8, 4)
    assert a == b and len({q.instance.key for q in a}) == 8  # no instance twice in one step
    assert plan_step(4, 0, pool, 8, 4) != a and plan_step(3, 1, pool, 8, 4) != a
    seeds = [s for q in a for s in q.seeds]
    assert len(set(seeds)) == len(seeds)


def test_staleness_bound():
    from stalwart.rl.rollout import admissible, staleness

    # step s trains with weights version s - 1
    assert staleness(4, 5) == 0 and admissible(4, 5, 0)
    assert staleness(3, 5) == 1 and admissible(3, 5, 1) and not admissible(3, 5, 0)
    assert not admissible(2, 5, 1) and not admissible(5, 5, 3)  # too old; from the future


def test_packed_rows_line_up_targets_old_logprobs_and_mask():
    from stalwart.rl.rollout import (
        ADVANTAGE,
        MASK,
        OLD_LOGP,
        ON_POLICY,
        TOKEN,
        pack_group,
    )

    g = _group(1, 0, [1.0, 0.0, 0.0])
    inputs, rows = pack_group(g, np.array([2.0, -1.0, -1.0]), 8, 0, 0.5, 0, False)
    assert inputs.shape == (3, 8) and rows.shape[:2] == (3, 8)
    # response 2 is [12, 11, 2]: the prompt's last position (2) predicts its first token
    assert inputs[2, :5].tolist() == [5, 6, 7, 12, 11] and rows[2, :5, TOKEN].tolist() == [6, 7, 12, 11, 2]
    assert rows[2, :, MASK].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert rows[2, 2:5, OLD_LOGP].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert rows[0, 2, ADVANTAGE] == 2.0 and rows[1, 2, ADVANTAGE] == -1.0 and rows[0, 3, MASK] == 0
    assert rows[..., ON_POLICY].min() == 1.0
    assert pack_group(g, np.zeros(3), 8, 0, 0.5, 1, False)[1][..., ON_POLICY].max() == 0.0


@pytest.mark.parametrize("how", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_objective_over_micro_batches_and_ranks_adds_up_to_the_global_aggregate(how):
    """Two ranks with two micro-batches each: the runner divides by the micro-batches and data
    parallelism averages the ranks, so each part's weighted loss must add up to grpo.policy_loss on
    the whole batch."""
    from stalwart.rl.grpo import policy_loss
    from stalwart.rl.objective import GRPOObjective, token_logprobs
    from stalwart.rl.rollout import (
        MASK,
        OLD_LOGP,
        TOKEN,
        advantages,
        aggregation_weights,
        pack_group,
    )

    torch.manual_seed(0)
    groups = [_group(1, i, [float(i % 2), 1.0, 0.0, 0.5]) for i in range(4)]
    adv = advantages([g.rewards for g in groups], True)
    w = aggregation_weights(groups, how, ranks=2, micro_per_rank=2)
    packed = [pack_group(g, a, 6, 0, w, 0, False) for g, a in zip(groups, adv)]
    logits = [torch.randn(4, 6, 16) for _ in groups]
    obj = GRPOObjective(0.2, 0.2, how, 0.0)
    parts = [obj(lg, torch.from_numpy(rows)) for lg, (_, rows) in zip(logits, packed)]
    ranks = [(parts[0] + parts[2]) / 2, (parts[1] + parts[3]) / 2]  # rank r gets groups r, r + 2
    distributed = (ranks[0] + ranks[1]) / 2
    rows = torch.from_numpy(np.concatenate([r for _, r in packed]))
    logp = token_logprobs(torch.cat(logits), rows[..., TOKEN].long())
    ref = policy_loss(logp, rows[..., OLD_LOGP].float(), torch.from_numpy(np.concatenate(adv)).float(),
                      rows[..., MASK], how=how)
    assert float(distributed) == pytest.approx(float(ref.loss), rel=1e-5)


def test_balancer_moves_a_worker_to_the_longer_phase_and_holds_still_near_balance():
    from stalwart.rl.balance import Layout, critical, decide

    # generation 4 worker-seconds on 1 generator, training 1 on 2 trainers: 4 + 0.5 -> 2 + 1 with 2 and 1
    move = decide(4.0, 1.0, Layout(1, 2), prompts=16)
    assert move.to == Layout(2, 1) and "generation is the longer phase" in move.reason
    assert critical(4.0, 1.0, move.to) == 3.0
    # training dominates: a generator becomes a trainer
    assert decide(0.5, 6.0, Layout(2, 1), prompts=16).to == Layout(1, 2)
    # balanced, or a gain under the threshold: no move
    assert decide(1.0, 1.0, Layout(1, 1), prompts=16) is None
    assert decide(2.0, 2.1, Layout(2, 2), prompts=16, min_gain=0.1) is None
    # trainer counts must divide the prompts: 3 trainers cannot split 16 prompts, so 4 -> 2
    assert decide(9.0, 1.0, Layout(1, 4), prompts=16).to == Layout(3, 2)
    assert decide(0.1, 9.0, Layout(3, 1), prompts=16).to == Layout(2, 2)


def test_hidden_tests_never_all_share_one_answer():
    """A constant program ("print('no')" for "greater than 90") must not pass every hidden case."""
    for seed in (0, 1):
        for inst in all_instances():
            assert len({c.output for c in inst.cases(3, seed)}) >= 2, (seed, inst.key)
