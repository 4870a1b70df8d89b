"""The catalogue of interruption causes, calibrated on Llama 3's published 54-day run.

Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, table 5) reports 466 job interruptions during a
54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 hosts of 8): 47 planned (firmware, config
and dataset updates) and 419 unexpected, broken down by root cause below. A cause's default rate is
its count divided by the exposure of its unit (GPU-hours or host-hours) in that run, so the
defaults *are* the calibration and `configs/sim/llama3_405b.toml` states them explicitly.

Scope: GPU-internal faults scale with GPUs; everything else is counted per host. NOTE: software
causes (bugs, NCCL watchdog, dependencies) are also charged per host, a deliberate assumption: a
rare hang on any one of N ranks stops the whole job, so their rate grows with job size too.

Reach (for per-replica-group recovery): a ``group`` cause stops only the replica group that holds the
failed GPU or host; a ``job`` cause stops every rank whatever the recovery. Job-wide, by assumption:
software bugs and dependencies (every rank runs the same code and reads the same services), the
network (a switch or cable fault breaks the collectives that span the groups), NCCL watchdog
timeouts (a hang of a collective that spans the groups) and silent data corruption (noticed an hour
later, after the gradient exchange has spread the corrupted values into every replica, so every
group rolls back to a checkpoint). Everything on one GPU or one host is group-local.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA3_GPUS = 16_384
LLAMA3_GPUS_PER_HOST = 8
LLAMA3_DAYS = 54.0
LLAMA3_PLANNED = 47
LLAMA3_TOTAL = 466


@dataclass(frozen=True)
class Cause:
    name: str          # config key, e.g. failures.faulty_gpu
    label: str         # as printed in the Llama 3 report
    per: str           # "gpu" or "host": the unit whose count multiplies the rate
    llama3_count: int  # interruptions in the 54-day Llama 3 snapshot
    detect_min: float  # minutes from fault to the job noticing (default)
    hardware: bool     # the host must be swapped for a spare (and repaired)
    reach: str         # "group" (stops one replica group) or "job" (stops every rank)

    @property
    def default_rate(self) -> float:
        """Events per million unit-hours that reproduce ``llama3_count`` in the Llama 3 run."""
        return self.llama3_count / unit_hours(self.per, LLAMA3_GPUS, LLAMA3_GPUS_PER_HOST, LLAMA3_DAYS) * 1e6


def unit_hours(per: str, gpus: int, gpus_per_host: int, days: float) -> float:
    units = gpus if per == "gpu" else gpus / gpus_per_host
    return units * days * 24.0


# Detection times: XID-reported GPU/HBM errors and crashes are seen within a couple of minutes;
# hangs (network, NCCL, GSP) wait for the collective timeout (~10 min); silent data corruption is
# only noticed later (loss spikes, checksums), so its "detection" is long and all of it is wasted.
CATALOG: tuple[Cause, ...] = (
    Cause("faulty_gpu", "Faulty GPU", "gpu", 148, 3.0, True, "group"),
    Cause("hbm3", "GPU HBM3 memory", "gpu", 72, 2.0, True, "group"),
    Cause("software_bug", "Software bug", "host", 54, 5.0, False, "job"),
    Cause("network", "Network switch/cable", "host", 35, 10.0, True, "job"),
    Cause("host_maintenance", "Host maintenance (unplanned)", "host", 32, 2.0, True, "group"),
    Cause("gpu_sram", "GPU SRAM memory", "gpu", 19, 2.0, True, "group"),
    Cause("gpu_system_processor", "GPU system processor", "gpu", 17, 10.0, True, "group"),
    Cause("nic", "NIC", "host", 7, 10.0, True, "group"),
    Cause("nccl_watchdog", "NCCL watchdog timeouts", "host", 7, 10.0, False, "job"),
    Cause("sdc", "Silent data corruption", "gpu", 6, 60.0, True, "job"),
    Cause("gpu_thermal", "GPU thermal interface + sensor", "gpu", 6, 3.0, True, "group"),
    Cause("ssd", "SSD", "host", 3, 5.0, True, "group"),
    Cause("power_supply", "Power supply", "host", 3, 1.0, True, "group"),
    Cause("server_chassis", "Server chassis", "host", 2, 2.0, True, "group"),
    Cause("io_expansion_board", "IO expansion board", "host", 2, 5.0, True, "group"),
    Cause("dependency", "Dependency", "host", 2, 5.0, False, "job"),
    Cause("cpu", "CPU", "host", 2, 2.0, True, "group"),
    Cause("system_memory", "System memory", "host", 2, 2.0, True, "group"),
)

CAUSES: dict[str, Cause] = {c.name: c for c in CATALOG}
