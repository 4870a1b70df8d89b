"""The weights a replica serves, kept across its restarts.

`stalwart serve` gives every replica it may start again (a tensor- or pipeline-parallel group, or a
replica behind the router) a record file (``--weights-file``, in the command's own temporary
directory). After each weight update the replica's rank 0 writes there, atomically, the version and
where those weights are on disk: the checkpoint or Hugging Face directory it read (a run directory is
pinned to the checkpoint it named then, not whichever is newest later), or, for a live update (weights
received from a training run, on no disk), a Hugging Face snapshot written beside the record (the
previous snapshot is removed). A replica started again with a record loads those weights as that
version instead of its command line's, so it comes back serving what it served; the router reads the
records to give a replica that missed an update the weights the others serve.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from stalwart.atomic import write_json_atomic
from stalwart.errors import UserError
from stalwart.infer.load import Source, save_hf, source_from


@dataclass
class AppliedWeights:
    path: Path  # the record: {"source": PATH, "version": N}

    def read(self) -> tuple[Source, int] | None:
        """The weights last applied and their version; None before any update, or (said in one line)
        when they are gone from disk (a checkpoint a training run has since removed)."""
        record = self.source()
        if record is None:
            return None
        try:
            return source_from(record["source"]), record["version"]
        except UserError as e:
            print(f"stalwart serve: the weights last applied (version {record['version']}) cannot be read ({e}); "
                  "starting with those the command line names", file=sys.stderr, flush=True)
            return None

    def source(self) -> dict | None:
        """The record as a weight update's body (``source``, ``version``), or None."""
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return {"source": record["source"], "version": int(record["version"])}

    def record(self, version: int, origin: Path) -> None:
        """Record ``origin`` as version ``version``; snapshots other than ``origin`` are removed."""
        origin = Path(origin).resolve()
        write_json_atomic(self.path, {"source": str(origin), "version": version})
        for old in self.path.parent.glob(f"{self.path.name}.v*"):
            if old.resolve() != origin:
                shutil.rmtree(old, ignore_errors=True)

    def snapshot(self, version: int, state: dict[str, torch.Tensor], args, tokenizer, eos_id: int | None) -> None:
        """Write a live update's weights beside the record and record them."""
        out = self.path.with_name(f"{self.path.name}.v{version}")
        save_hf(state, args, tokenizer, eos_id, out)
        self.record(version, out)

    def keep(self, version: int, where: str | None, origin: Path | None, state: dict | None, engine) -> None:
        """Record an update just applied (``origin`` read from ``where``, or a live ``state``). A failure
        to record is printed, not raised: the update itself succeeded."""
        try:
            if state is not None:
                self.snapshot(version, state, engine.args, engine.tokenizer, engine.eos_id)
            elif origin is not None:
                self.record(version, origin)
        except Exception as e:  # noqa: BLE001 - the weights are served; only a restart would miss them
            print(f"stalwart serve: could not record weight version {version} for a restart ({type(e).__name__}: "
                  f"{e}); a restarted replica would serve older weights", file=sys.stderr, flush=True)
