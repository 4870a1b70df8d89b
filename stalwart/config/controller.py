"""The ``[controller]`` section: `stalwart train --controller`, its hang bound, spares and recovery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stalwart.config.core import option


@dataclass
class ControllerConfig:
    step_timeout_s: float = option(
        "stalwart train --controller: a command (a training step, a restore) still running on an actor after this "
        "many seconds counts as a hang; the controller kills that actor (SIGKILL), names it, and recovers.",
        300.0, min=1.0)
    supervision_poll_s: float = option(
        "How often Monarch polls the actor processes for deaths (HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY); "
        "a killed actor is reported within about this long.", 0.5, min=0.05, max=60.0)
    spares: int = option("Started spare actors (their imports done) that take a failed actor's place at once; "
                         "each is one idle process. 0 = start a new process per failure.", 1, min=0)
    max_recoveries: int = option("Actor failures the controller recovers from before it gives up (exit 75).", 3,
                                 min=0)
    recover_from: Literal["memory", "disk"] = option(
        "What a recovery restores before replaying the command journal: 'memory' keeps the surviving actors and "
        "restores every actor from the newest in-memory snapshot (checkpoint.memory_interval); 'disk' respawns "
        "every actor and loads the newest disk checkpoint (what a restart of an SPMD job does). Without a state "
        "of either kind the journal is replayed from the seeded initialisation.", "memory")
