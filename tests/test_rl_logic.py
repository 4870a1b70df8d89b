"""RL post-training, pure logic: GRPO advantages and loss against hand-computed values, the code
task's families and its held-out split."""

import math

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
