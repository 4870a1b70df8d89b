"""Dynamic sampling (DAPO, ``rl.dynamic_sampling``): a step's groups whose rewards are all alike carry no
gradient; new groups are sampled and scored in their place (``rl.loop.Stepper.step`` calls
:func:`refill` after scoring)."""

from __future__ import annotations

from typing import Any

from stalwart.rl import rollout
from stalwart.rl.grpo import informative


def refill(stepper: Any, s: int, groups: list[rollout.Group], gfig: dict[str, float], sfig: dict[str, float]
           ) -> tuple[list[rollout.Group], list[rollout.Group], dict[str, Any]]:
    """Dynamic sampling (DAPO): a group whose rewards are all alike carries no gradient, so more
    groups (new instances, generated with the current weights) are sampled and scored in its place,
    for at most ``rl.dynamic_sampling_rounds`` rounds; places still empty then take zero-variance
    groups. The step's figures grow by the extra work. Returns (the groups to train, every group
    sampled, the figures of the refill)."""
    want, r, ctx, svc = len(groups), stepper.r, stepper.ctx, stepper.svc
    keep = [g for g in groups if informative(g.rewards)]
    alike = [g for g in groups if not informative(g.rewards)]
    sampled, rounds = list(groups), 0
    while len(keep) < want and rounds < r.dynamic_sampling_rounds:
        rounds += 1
        plan = rollout.refill_plan(s, rounds, ctx.cfg.run.seed, ctx.task.train,
                                   {g.request.instance.key for g in sampled}, want - len(keep),
                                   r.group_size, max(g.request.index for g in sampled) + 1)
        if not plan:
            break
        stepper.catch_up(s)  # generated with the trainers' current weights (version s - 1): on-policy
        more, fig = svc.generators.run(plan)
        for key in ("gen_s", "rescore_s", "rollout_tokens"):
            gfig[key] += fig[key]
        score = svc.rewards.score(more)
        sfig["score_s"] += score["score_s"]
        sfig["programs_run"] += score["programs_run"]
        sampled += more
        keep += [g for g in more if informative(g.rewards)]
        alike += [g for g in more if not informative(g.rewards)]
    trained = sorted(keep[:want] + alike[:max(0, want - len(keep))], key=lambda g: g.request.index)
    return trained, sampled, {"dynamic_sampling_rounds": rounds, "sampled_groups": len(sampled),
                              "zero_variance_groups": sum(not informative(g.rewards) for g in trained)}
