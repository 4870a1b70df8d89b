"""Loading a verified checkpoint into a model and optimizer, and the RNG state a checkpoint carries.

The bytes come from :func:`~stalwart.checkpoint.verify.verify_checkpoint` (read once, checked against
the manifest); DCP reads them from memory, as they arrive from the disk, through the allow-listed
reader and planner, so nothing is unpickled beyond plain data. Every digest is compared before the
loaded state is accepted; a load that fails (a bad checksum, a refused or mismatched checkpoint) may
have written part of the state into the model and optimizer already, so its caller falls back to
another checkpoint (``CheckpointManager.load_resume``) or stops.
"""

from __future__ import annotations

import base64
import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from stalwart.checkpoint.safe_io import SafeLoadPlanner, UnsafeCheckpointError, describe_load_failure
from stalwart.checkpoint.verify import CheckpointError, MemoryFileSystemReader, VerifiedFiles
from stalwart.checkpoint.writer import TRAINER_STATE


@dataclass
class LoadedState:
    path: Path
    step: int
    trainer_state: dict[str, Any]
    files_checked: tuple[str, ...] = ()  # shard files this rank read whole and checked
    files_in_part: tuple[str, ...] = ()  # shard files another rank checks, of which this one read records
    bytes_in_part: int = 0  # what this rank read of those files


def rng_state() -> dict[str, str]:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, str]) -> None:
    import numpy as np

    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["cpu"]), dtype=np.uint8).copy()))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(
            np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy()))


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' single-process mode even when asked for it explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_verified(files: VerifiedFiles, rank: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None) -> LoadedState:
    """Load ``files`` (from ``verify_checkpoint(keep=True)``) into ``model`` (and ``optimizer``, if
    given) and restore this rank's RNG state once every shard file has passed its checksum. The bytes
    are released as soon as they are loaded."""
    path = files.path
    try:
        trainer_state = json.loads((path / TRAINER_STATE).read_text())
        int(trainer_state["step"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: file {TRAINER_STATE} is malformed ({e})") from None
    no_dist = not (dist.is_available() and dist.is_initialized())
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_state_dict(model, [], options=StateDictOptions())[0]}
    checked: tuple[str, ...] = ()
    in_part: tuple[str, ...] = ()
    bytes_in_part = 0
    try:
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=MemoryFileSystemReader(files), planner=SafeLoadPlanner(),
                         no_dist=no_dist)
        except UnsafeCheckpointError as e:
            files.check()  # a corrupt file is named as corrupt, not as what its bytes made DCP do
            raise CheckpointError(f"checkpoint {path}: refused: {e}") from None
        except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures (a BaseException)
            files.check()
            raise CheckpointError(describe_load_failure(path, e)) from None
        files.check()  # every digest, before the loaded state is accepted
        checked = tuple(name for name, (_, want) in files.reads.items() if want is not None)
        in_part = tuple(name for name, (_, want) in files.reads.items() if want is None)
        bytes_in_part = sum(read.bytes_to_read for read, want in files.reads.values() if want is None)
    finally:
        files.release()
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    rng_file = path / f"rng-rank{rank}.json"
    if rng_file.is_file():
        try:
            set_rng_state(json.loads(rng_file.read_text()))
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: file {rng_file.name} is malformed ({e})") from None
    return LoadedState(path=path, step=int(trainer_state["step"]), trainer_state=trainer_state,
                       files_checked=checked, files_in_part=in_part, bytes_in_part=bytes_in_part)
