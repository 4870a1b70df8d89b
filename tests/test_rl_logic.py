"""RL post-training, pure logic: the algorithms' advantages and loss against hand-computed values, dynamic
sampling, the code task's families and its held-out split."""

import math

import numpy as np
import pytest
import torch

from stalwart.rl import grpo
from stalwart.rl.tasks import BY_NAME, FAMILIES, Instance, all_instances, split

pytestmark = pytest.mark.unit


def test_group_advantages_by_hand():
    r = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]
    a = grpo.group_advantages(r, eps=0.0 + 1e-12)
    std = math.sqrt(((0.5 ** 2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    assert a[0] == pytest.approx(np.array([0.5, -0.5, -0.5, 0.5]) / std)
    assert np.array_equal(a[1], np.zeros(4))  # a group that scored alike carries no signal
    assert grpo.group_advantages(r, scale=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="k >= 2"):
        grpo.group_advantages([[1.0]])


def test_every_algorithms_advantages_by_hand():
    r = [[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.5]]
    std = math.sqrt(1 / 3)
    dapo = grpo.group_advantages(r, "dapo", eps=1e-12)
    assert dapo[0] == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])  # grpo's
    # rloo: reward minus the mean of the other rewards. [1, 0, 0, 1]: 1 - 1/3, 0 - 2/3; [1, 0, 0]: 1 - 0, 0 - 1/2
    rloo = grpo.group_advantages(r, "rloo")
    assert rloo[0] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3]) and rloo[1] == pytest.approx([1.0, -0.5, -0.5])
    # dr_grpo: centred, never divided by the std (scale is grpo's switch only)
    dr = grpo.group_advantages(r, "dr_grpo", scale=True)
    assert dr[0].tolist() == [0.5, -0.5, -0.5, 0.5] and dr[1] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    for algorithm in ("grpo", "dapo", "rloo", "dr_grpo"):  # alike rewards: no signal under any of them
        assert np.array_equal(grpo.group_advantages(r, algorithm)[2], np.zeros(3)), algorithm
    assert grpo.informative([1.0, 0.0]) and not grpo.informative([0.5, 0.5, 0.5])


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
    # Dr. GRPO: the token sums over a constant length (max_tokens 4), then the mean: (-3.2 / 4 + 3.6 / 4) / 2
    dr = grpo.policy_loss(logp, old, adv, mask, how="seq-mean-token-sum-norm", max_tokens=4).loss.item()
    assert dr == pytest.approx(0.05)
    # DAPO's clip-higher: the ratio-2 token with A = 1 is clipped at 1.28 instead of 1.2; the lower bound is
    # unchanged: (-1.28 - 1 - 1 + 1.6 + 2) / 5
    dapo = grpo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, how="token-mean")
    assert dapo.loss.item() == pytest.approx(0.064) and dapo.clip_fraction.item() == pytest.approx(2 / 5)


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


def test_a_trimmed_micro_batch_keeps_every_trained_position_and_the_same_loss():
    """rollout.trim cuts the positions past every row's last trained token; with a causal model the
    kept positions' logits are unchanged, so the objective is the same (every aggregation)."""
    from stalwart.models.flavors import TransformerArgs
    from stalwart.models.llama import Transformer
    from stalwart.rl.objective import GRPOObjective
    from stalwart.rl.rollout import MASK, pack_group, trim

    torch.manual_seed(0)
    g = _group(1, 0, [1.0, 0.0, 0.5])  # responses of 3, 1 and 3 tokens after a 3-token prompt
    inputs, rows = pack_group(g, np.array([1.0, -1.0, 0.0]), 12, 0, 0.25, 0, False)
    routes = np.zeros((3, 12, 2, 1))
    cut = trim((inputs, rows, routes))
    last = max(int(np.nonzero(r[:, MASK])[0][-1]) for r in rows)
    assert [a.shape[1] for a in cut] == [last + 1] * 3 and last + 1 < 12
    assert (cut[1][..., MASK].sum() == rows[..., MASK].sum()) and (cut[0] == inputs[:, :last + 1]).all()
    model = Transformer(TransformerArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=16, ffn_hidden=64,
                                        max_seq_len=16))
    for how in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        obj = GRPOObjective(0.2, 0.2, how, 0.0)
        with torch.no_grad():
            full = obj(model(torch.from_numpy(inputs)), torch.from_numpy(rows))
            short = obj(model(torch.from_numpy(cut[0])), torch.from_numpy(cut[1]))
        assert float(short) == pytest.approx(float(full), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("how,algorithm", [("token-mean", "grpo"), ("seq-mean-token-sum", "grpo"),
                                           ("seq-mean-token-mean", "grpo"), ("token-mean", "rloo"),
                                           ("seq-mean-token-sum-norm", "dr_grpo")])
def test_objective_over_micro_batches_and_ranks_adds_up_to_the_global_aggregate(how, algorithm):
    """Two ranks with two micro-batches each: the runner divides by the micro-batches and data
    parallelism averages the ranks, so each part's weighted loss must add up to grpo.policy_loss on
    the whole batch."""
    from stalwart.rl.grpo import policy_loss
    from stalwart.rl.objective import GRPOObjective, token_logprobs
    from stalwart.rl.rollout import (
        MASK,
        OLD_LOGP,
        TOKEN,
        aggregation_weights,
        pack_group,
    )

    torch.manual_seed(0)
    groups = [_group(1, i, [float(i % 2), 1.0, 0.0, 0.5]) for i in range(4)]
    adv = grpo.group_advantages([g.rewards for g in groups], algorithm)
    w = aggregation_weights(groups, how, ranks=2, micro_per_rank=2, max_tokens=5)
    packed = [pack_group(g, a, 6, 0, w, 0, False) for g, a in zip(groups, adv)]
    logits = [torch.randn(4, 6, 16) for _ in groups]
    obj = GRPOObjective(0.2, 0.2, how, 0.0)
    parts = [obj(lg, torch.from_numpy(rows)) for lg, (_, rows) in zip(logits, packed)]
    ranks = [(parts[0] + parts[2]) / 2, (parts[1] + parts[3]) / 2]  # rank r gets groups r, r + 2
    distributed = (ranks[0] + ranks[1]) / 2
    rows = torch.from_numpy(np.concatenate([r for _, r in packed]))
    logp = token_logprobs(torch.cat(logits), rows[..., TOKEN].long())
    ref = policy_loss(logp, rows[..., OLD_LOGP].float(), torch.from_numpy(np.concatenate(adv)).float(),
                      rows[..., MASK], how=how, max_tokens=5)
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


def test_the_algorithm_picks_the_defaults_it_leaves_unset_and_refuses_what_it_cannot_take():
    from stalwart.config import ConfigError, load
    from stalwart.config.rl import RLConfig

    def rl(*args):
        return load(RLConfig, None, list(args)).rl

    got = {a: (c.clip_low, c.clip_high, c.aggregation, c.scale_advantages, c.dynamic_sampling)
           for a in ("grpo", "dapo", "rloo", "dr_grpo") for c in [rl("--rl.algorithm", a)]}
    assert got == {"grpo": (0.2, 0.2, "token-mean", True, False), "dapo": (0.2, 0.28, "token-mean", True, True),
                   "rloo": (0.2, 0.2, "token-mean", False, False),
                   "dr_grpo": (0.2, 0.2, "seq-mean-token-sum-norm", False, False)}
    c = rl("--rl.algorithm", "dapo", "--rl.clip_high", "0.3", "--rl.dynamic_sampling", "false")
    assert (c.clip_high, c.dynamic_sampling) == (0.3, False)
    assert rl("--rl.scale_advantages", "false").scale_advantages is False
    with pytest.raises(ConfigError, match="dapo's loss is token-level"):
        rl("--rl.algorithm", "dapo", "--rl.aggregation", "seq-mean-token-mean")
    with pytest.raises(ConfigError, match="rloo's advantages are not divided"):
        rl("--rl.algorithm", "rloo", "--rl.scale_advantages", "true")
    with pytest.raises(ConfigError, match="did you mean 'dapo'"):
        rl("--rl.algorithm", "dappo")


def test_dynamic_sampling_refills_zero_variance_groups_with_new_instances():
    """Step 1 plans 4 groups, two of them scoring alike. The first refill round gives one informative
    group and one alike, the second the last informative one: the step trains 4 informative groups,
    planned ones first in index order, and every group sampled counts in the figures."""
    from types import SimpleNamespace

    from stalwart.config import load
    from stalwart.config.rl import RLConfig
    from stalwart.rl.dynamic import refill
    from stalwart.rl.loop import Stepper
    from stalwart.rl.rollout import Group, plan_step, refill_plan

    cfg = load(RLConfig, None, ["--rl.algorithm", "dapo", "--rl.prompts_per_step", "4", "--rl.group_size", "2"])
    pool, _ = split(0, 0.3)
    scores = iter([[0.0, 1.0], [1.0, 1.0], [0.0, 0.5], [0.0, 0.0],  # the planned groups 0-3
                   [1.0, 0.0], [0.5, 0.5],                        # round 1: groups 4, 5
                   [0.0, 1.0]])                                   # round 2: group 6
    plans = []

    def run(plan):
        plans.append(plan)
        return [Group(q, [1], [[2], [3]], [[-0.1], [-0.2]], 0) for q in plan], {
            "gen_s": 1.0, "rescore_s": 0.0, "rollout_tokens": 2 * len(plan)}

    def score(groups):
        for g in groups:
            g.rewards = next(scores)
        return {"score_s": 0.5, "programs_run": 2 * len(groups)}

    st = Stepper.__new__(Stepper)
    st.r = cfg.rl
    st.ctx = SimpleNamespace(cfg=cfg, task=SimpleNamespace(train=pool))
    st.svc = SimpleNamespace(generators=SimpleNamespace(run=run), rewards=SimpleNamespace(score=score))
    st.catch_up = lambda s: None
    planned, _ = run(plan_step(1, 0, pool, 4, 2))
    plans.clear()
    gfig, sfig = {"gen_s": 1.0, "rescore_s": 0.0, "rollout_tokens": 8}, score(planned)
    trained, sampled, fig = refill(st, 1, planned, gfig, sfig)
    assert [g.request.index for g in trained] == [0, 2, 4, 6]
    assert [len(p) for p in plans] == [2, 1] and plans[0] == refill_plan(
        1, 1, 0, pool, {g.request.instance.key for g in planned}, 2, 2, 4)
    assert len({g.request.instance.key for g in sampled}) == len(sampled) == 7  # no instance twice in a step
    assert len({s for g in sampled for s in g.request.seeds}) == 14
    assert fig == {"dynamic_sampling_rounds": 2, "sampled_groups": 7, "zero_variance_groups": 0}
    assert gfig == {"gen_s": 3.0, "rescore_s": 0.0, "rollout_tokens": 14} and sfig["programs_run"] == 14
    # out of rounds: the places left take zero-variance groups
    st.r.dynamic_sampling_rounds = 1
    scores = iter([[1.0, 1.0]] * 4 + [[0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.5]])  # one round of 4
    planned, _ = run(plan_step(2, 0, pool, 4, 2))
    trained, _, fig = refill(st, 2, planned, gfig, score(planned))
    assert [g.request.index for g in trained] == [0, 1, 2, 4] and fig["zero_variance_groups"] == 3
