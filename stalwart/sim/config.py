"""The `stalwart simulate` configuration tree (TOML + dotted --section.key overrides).

Every field's help is what `stalwart simulate --help` prints. The defaults describe the Llama 3
405B pre-training job (16,384 H100, 54 days) so that a bare `stalwart simulate` is the calibration
run; `configs/sim/*.toml` are presets on top.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from stalwart.config import ConfigError, option, section
from stalwart.sim.causes import CATALOG, Cause


@dataclass
class JobSection:
    gpus: int = option("GPUs in the training job (whole hosts; the spare pool comes on top). At most 2^24: the "
                       "simulation keeps per-host state (a million GPUs take about 30 s for 100 replications on one "
                       "core, 16 million over 2 minutes).", 16384, min=8, max=1 << 24)
    gpus_per_host: int = option("GPUs per host; a hardware fault takes out the whole host.", 8, min=1, max=64)
    days: float = option("Simulated wall-clock duration of the job, in days.", 54.0, min=0.01, max=3650.0)


@dataclass
class RunSection:
    replications: int = option("Independent seeded replications (confidence intervals come from their spread).",
                               100, min=1, max=100000)
    seed: int = option("Base seed; replication i uses an independent stream spawned from it.", 0, min=0)


@dataclass
class CheckpointSection:
    interval_min: float = option("Minutes of training between checkpoints; 0 = the Young/Daly optimum "
                                 "computed from the job's MTBF and checkpoint cost.", 0.0, min=0.0)
    mode: Literal["sync", "async"] = option(
        "sync: training stalls for the whole save (save_s); async: it stalls only to snapshot state to host "
        "memory (snapshot_s) and the checkpoint becomes durable save_s later.", "async")
    save_s: float = option("Seconds to write one checkpoint to durable storage.", 120.0, min=0.0)
    snapshot_s: float = option("Seconds training stalls per async checkpoint (device-to-host copy).", 5.0, min=0.0)
    restore_from: Literal["storage", "memory"] = option(
        "Where a restart reloads state from: shared storage, or in-memory replicas on peer hosts.", "storage")
    restore_storage_s: float = option("Seconds to load the latest checkpoint from storage on restart.", 90.0,
                                      min=0.0)
    restore_memory_s: float = option("Seconds to load state from in-memory peer replicas on restart.", 20.0,
                                     min=0.0)


@dataclass
class RecoverySection:
    detection_scale: float = option("Multiplier on every cause's detection time (0.1 = 10x faster detection).",
                                    1.0, min=0.0)
    init_base_s: float = option("Restart cost independent of size: process launch, imports, CUDA init (s).",
                                60.0, min=0.0)
    init_per_sqrt_kgpu_s: float = option(
        "Size-dependent restart cost: this many seconds times sqrt(GPUs/1000) (rendezvous, communicator "
        "setup, model build).", 20.0, min=0.0)
    swap_s: float = option("Seconds to drain a failed host and bring a spare into the job.", 60.0, min=0.0)
    model: Literal["whole_job", "per_group"] = option(
        "whole_job: every fault restarts every rank from the last durable checkpoint. per_group: a group-local "
        "fault (failures.<cause>.reach) stops only its replica group (groups.gpus), the others train on at reduced "
        "throughput and it rejoins by a live transfer; job-wide faults fall back to the whole-job restart.",
        "whole_job")


@dataclass
class GroupsSection:
    gpus: int = option("GPUs per data-parallel replica group, the unit that fails alone under recovery.model = "
                       "per_group: one model replica, tp x pp x cp (Llama 3 405B: 8 x 16 x 1 = 128, so 16,384 GPUs "
                       "are 128 groups). The job has job.gpus // gpus groups (a remainder is spread over them); a job smaller "
                       "than a group is one.",
                       128, min=1)
    state_gb: float = option("Training state one group holds and a rejoining group receives, in GB (Llama 3 405B: "
                             "405e9 parameters x 14 bytes of bf16 weights, fp32 master weights and two fp32 Adam "
                             "moments).", 5670.0, min=0.0)
    link_gbps: float = option("Network bandwidth per GPU in Gbit/s for the live transfer (each rank of a healthy "
                              "group sends its shard to its counterpart; Llama 3: 400 Gbit/s RoCE per GPU).",
                              400.0, min=0.001)


@dataclass
class SparesSection:
    hosts: int = option("Spare hosts kept warm next to the job; -1 = 2% of the job's hosts (at least 1).", -1,
                        min=-1)
    repair_h: float = option("Mean hours to repair a failed host and return it to the spare pool "
                             "(exponentially distributed).", 48.0, min=0.0)


@dataclass
class MaintenanceSection:
    interval_h: float = option("Hours between planned interruptions (config/firmware/dataset updates); 0 = none. "
                               "Llama 3: 47 in 54 days.", 54 * 24 / 47, min=0.0)
    downtime_min: float = option("Minutes the job is down for a planned interruption, before it restarts.",
                                 10.0, min=0.0)


@dataclass
class PowerSection:
    gpu_busy_w: float = option("Watts per GPU while training (H100 SXM TDP 700).", 700.0, min=0.0)
    gpu_idle_w: float = option("Watts per GPU while the job stalls (waiting in a collective, restarting).",
                               120.0, min=0.0)
    host_busy_w: float = option("Watts per host besides its GPUs while training (CPUs, NICs, fans).", 2000.0,
                                min=0.0)
    host_idle_w: float = option("Watts per host besides its GPUs while stalled.", 1400.0, min=0.0)
    pue: float = option("Facility power usage effectiveness applied to IT power.", 1.1, min=1.0)
    ramp_s: float = option("Seconds over which the job ramps power up/down (0 = a step; >0 models power "
                           "smoothing such as gradual clock ramps or dummy load).", 0.0, min=0.0)
    window_s: float = option("Window in which the grid sees a step change (the 'peak step change' window).",
                             1.0, min=0.001)
    min_stall_s: float = option("Stalls shorter than this are smoothed by power supplies and not counted as swings.",
                                2.0, min=0.0)


@dataclass
class ClusterSection:
    enabled: bool = option("Also simulate several jobs sharing a cluster (scheduling, placement, queueing).",
                           False)
    racks: int = option("Racks in the cluster.", 64, min=1)
    hosts_per_rack: int = option("Hosts per rack (a rack is the unit the placement tries not to split).", 16, min=1)
    spare_hosts: int = option("Hosts held back as a spare pool for running jobs' failures.", 32, min=0)
    jobs: int = option("Jobs submitted over the simulated period.", 200, min=1)
    job_gpus: list[int] = option("Job sizes in GPUs, drawn uniformly (rounded up to whole hosts).",
                                 factory=lambda: [8, 64, 256, 1024, 2048])
    mean_hours: float = option("Mean job run time in hours (exponentially distributed).", 24.0, min=0.01)
    days: float = option("Submission window in days (jobs arrive as a Poisson process over it).", 14.0, min=0.01)
    placement: Literal["topology", "random"] = option(
        "topology: whole hosts (so tensor parallel stays inside NVLink), a job in as few racks as possible; "
        "random: any free hosts (the baseline).", "topology")
    extra_rack_slowdown: float = option(
        "Fractional slowdown of a job per rack it spans beyond the fewest possible (cross-rack traffic "
        "over the oversubscribed aggregation layer).", 0.01, min=0.0)
    policy: Literal["fifo", "backfill"] = option(
        "fifo: strictly in order; backfill: later jobs that fit may start while the head job waits.", "backfill")


@dataclass
class ReportSection:
    optimize_interval: bool = option("Search the simulated-optimal checkpoint interval around Young/Daly "
                                     "(extra replications, common random numbers).", True)
    optimize_replications: int = option("Replications per candidate interval in that search.", 30, min=1)
    recovery_models: bool = option("Also run the other recovery model (recovery.model) on the same failure traces "
                                   "and print both side by side with the per-group assumptions; sweeps report "
                                   "both too.", True)
    whatifs: bool = option("Run the built-in what-ifs (in-memory checkpoints, faster detection, more spares, "
                           "...) and rank them by ETTR.", False)


def _cause_section(c: Cause) -> type:
    """One small section per cause, so each can be overridden: --failures.hbm3.rate 5."""
    cls_name = "".join(p.title() for p in c.name.split("_")) + "Failure"
    fields = [
        ("rate", float, option(f"{c.label}: events per million {c.per}-hours (Llama 3: {c.llama3_count} "
                               f"in 54 days on 16,384 GPUs).", round(c.default_rate, 5), min=0.0)),
        ("per", Literal["gpu", "host"], option("Unit the rate is counted per.", c.per)),
        ("detect_min", float, option("Minutes from the fault until the job notices it.", c.detect_min, min=0.0)),
        ("hardware", bool, option("The host must be swapped for a spare and repaired (else just restart).",
                                  c.hardware)),
        ("reach", Literal["group", "job"], option(
            "group: stops only the replica group holding the unit (per-group recovery restarts that group alone); "
            "job: stops every rank whatever the recovery model.", c.reach)),
    ]
    cls = dataclasses.make_dataclass(cls_name, fields)
    cls.__module__ = __name__
    return cls


CAUSE_SECTIONS: dict[str, type] = {c.name: _cause_section(c) for c in CATALOG}
FailuresSection = dataclasses.make_dataclass(
    "FailuresSection", [(c.name, CAUSE_SECTIONS[c.name], section(CAUSE_SECTIONS[c.name], c.label)) for c in CATALOG])
FailuresSection.__module__ = __name__
FailuresSection.__doc__ = "Unplanned interruption causes; defaults are the Llama 3 calibration."


@dataclass
class SimConfig:
    job: JobSection = section(JobSection, "The training job.")
    run: RunSection = section(RunSection, "Replications and seeding.")
    checkpoint: CheckpointSection = section(CheckpointSection, "Checkpoint policy (interval, stalls, restore).")
    recovery: RecoverySection = section(RecoverySection, "Detection and restart after an interruption.")
    groups: GroupsSection = section(GroupsSection, "Data-parallel replica groups (per-group recovery).")
    spares: SparesSection = section(SparesSection, "Spare hosts and repair.")
    maintenance: MaintenanceSection = section(MaintenanceSection, "Planned interruptions.")
    failures: FailuresSection = section(FailuresSection, FailuresSection.__doc__)  # type: ignore[valid-type]
    power: PowerSection = section(PowerSection, "Facility power swings when the job starts, stops or stalls.")
    cluster: ClusterSection = section(ClusterSection, "Several jobs sharing one cluster.")
    report: ReportSection = section(ReportSection, "What the report computes besides the baseline.")

    def __post_init__(self) -> None:
        if self.job.gpus % self.job.gpus_per_host:
            raise ConfigError(f"job.gpus ({self.job.gpus}) must be a multiple of job.gpus_per_host "
                              f"({self.job.gpus_per_host})")
        g = self.groups.gpus
        if g % self.job.gpus_per_host:
            raise ConfigError(f"groups.gpus ({g}) must be a multiple of job.gpus_per_host ({self.job.gpus_per_host})")
        if self.power.gpu_idle_w > self.power.gpu_busy_w:
            raise ConfigError("power.gpu_idle_w must not exceed power.gpu_busy_w")
        if not self.cluster.job_gpus or min(self.cluster.job_gpus) < 1:
            raise ConfigError("cluster.job_gpus must list positive job sizes")
        if self.cluster.enabled:
            largest = -(-max(self.cluster.job_gpus) // self.job.gpus_per_host)
            usable = self.cluster.racks * self.cluster.hosts_per_rack - self.cluster.spare_hosts
            if largest > usable:
                raise ConfigError(f"cluster.job_gpus: a {max(self.cluster.job_gpus)}-GPU job needs {largest} hosts "
                                  f"but the cluster has only {usable} besides its spares")


def spare_hosts(cfg: SimConfig) -> int:
    hosts = cfg.job.gpus // cfg.job.gpus_per_host
    return cfg.spares.hosts if cfg.spares.hosts >= 0 else max(1, round(0.02 * hosts))
