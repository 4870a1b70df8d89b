"""What recovering from a fault costs, in both recovery models, and the assumptions behind it.

Whole-job restart: every rank re-initialises, ``init_base_s + init_per_sqrt_kgpu_s * sqrt(GPUs/1000)``
(process launch and CUDA init, then rendezvous, communicators and model build, which grow with the
job), and restores the last durable checkpoint.

Per replica group (torchft's model): the job is R = job.gpus / groups.gpus data-parallel replica
groups, each one model replica. When a group-local fault stops one group:

- the survivors wait in the gradient exchange until the fault is noticed (the cause's detection time,
  the same in both models), then rebuild their cross-group communicators (``regroup_s``) and train on,
  redoing the lost group's micro-batches in the same step: the global batch is kept and throughput is
  (R - 1)/R while the group is away;
- the failed group swaps its host (a spare, or a wait for a repair: the survivors do not wait) and
  re-initialises alone (``group_restart_s``): the same formula as the whole job's with the group's GPUs,
  because its rendezvous and model build span only its own ranks; it does not restore a checkpoint;
- it rejoins by a live transfer from a healthy group (``transfer_s``: state_gb over the group's links,
  every rank sending its shard to its counterpart in parallel) after another regroup; the survivors
  stall for the regroup and the transfer only. Nothing is rolled back.

NOTE: ``regroup_s`` assumes a cross-group communicator's members are the R ranks that hold one shard
position (one per group), so its setup is the size-dependent init term at R ranks.
"""

from __future__ import annotations

import math

from stalwart.sim.causes import CATALOG


def init_seconds(recovery, gpus: int) -> float:
    """Re-initialising ``gpus`` GPUs (``recovery`` is the ``recovery`` config section)."""
    return recovery.init_base_s + recovery.init_per_sqrt_kgpu_s * math.sqrt(gpus / 1000.0)


def restart_seconds(cfg) -> float:
    """The whole-job restart: re-initialise every rank, then restore the checkpoint."""
    c = cfg.checkpoint
    restore = c.restore_memory_s if c.restore_from == "memory" else c.restore_storage_s
    return init_seconds(cfg.recovery, cfg.job.gpus) + restore


def replica_groups(cfg) -> int:
    """R: how many replica groups the job has (1 when the job is smaller than one group)."""
    return max(1, cfg.job.gpus // cfg.groups.gpus)


def group_costs(cfg) -> dict[str, float]:
    """Seconds a lost group costs: its own restart, the survivors' regroup and the live transfer."""
    r = replica_groups(cfg)
    group_gpus = cfg.job.gpus // r
    link_gb_s = cfg.groups.link_gbps / 8.0
    return {"group_restart_s": init_seconds(cfg.recovery, group_gpus),
            "regroup_s": cfg.recovery.init_per_sqrt_kgpu_s * math.sqrt(r / 1000.0),
            "transfer_s": cfg.groups.state_gb / (group_gpus * link_gb_s)}


def assumptions(cfg) -> dict:
    """The per-group model's assumptions for this config, as figures and printable lines."""
    r = replica_groups(cfg)
    costs = group_costs(cfg)
    wide = [c for c in CATALOG if getattr(cfg.failures, c.name).reach == "job"]
    local = [c for c in CATALOG if getattr(cfg.failures, c.name).reach == "group"]
    hosts = cfg.job.gpus / cfg.job.gpus_per_host

    def rate(c) -> float:
        sec = getattr(cfg.failures, c.name)
        return sec.rate * (cfg.job.gpus if sec.per == "gpu" else hosts)

    total = sum(rate(c) for c in CATALOG)
    wide_share = sum(rate(c) for c in wide) / total if total > 0 else 0.0
    lines = [
        f"R = {r} replica groups of {cfg.job.gpus // r:,} GPUs (groups.gpus: one model replica, tp x pp x cp)",
        "job-wide causes, a whole-job restart in both models: " + ", ".join(c.label for c in wide)
        + f" ({100 * wide_share:.1f}% of unplanned interruptions); planned maintenance stops the whole job too",
        f"group-local causes: the {len(local)} others (one GPU or one host)",
        f"a lost group: the survivors stall for its detection, then {costs['regroup_s']:.1f} s to regroup, and "
        f"train at (R-1)/R throughput with the global batch kept; the group swaps its host (no wait for the "
        f"survivors) and re-initialises alone in {costs['group_restart_s']:.1f} s (no restore)",
        f"its rejoin: {costs['regroup_s']:.1f} s regroup + {costs['transfer_s']:.2f} s live transfer "
        f"({cfg.groups.state_gb:,.0f} GB over {cfg.job.gpus // r} x {cfg.groups.link_gbps:g} Gbit/s) stalls "
        "the survivors; nothing is rolled back",
        "whole-job fallback: a job-wide cause, a fault that leaves no group training, or a fault during a "
        "whole-job restart; groups still waiting for a host then stay out and rejoin later by transfer",
        "each model checkpoints at its own Young/Daly interval (per group: from the rate of whole-job rollbacks)",
    ]
    return {"groups": r, "group_gpus": cfg.job.gpus // r, **costs,
            "job_wide_causes": [c.name for c in wide], "group_local_causes": [c.name for c in local],
            "job_wide_share": wide_share, "lines": lines}
