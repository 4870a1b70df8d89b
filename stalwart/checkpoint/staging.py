"""Getting a consistent copy of the live training state without stopping the loop for it.

A save or snapshot copies the state on a background thread while the loop goes on computing the
next forward/backward; ``StepHold`` keeps the optimizer's next step (the only thing that writes the
weights and the optimizer state) waiting until the copy is done.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from stalwart.runtime.device import accelerator_in_use


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class HostStager:
    """Copies a state dict into host (pinned on CUDA) buffers, reused while the structure is unchanged.

    Two halves, so the copy can run off the training loop: ``prepare`` (cheap: the staged dict's
    structure, its buffers and plain values, enough to plan a save) and ``copy`` (the tensor bytes,
    safe on a background thread as long as nothing writes the live tensors meanwhile: the caller
    holds the optimizer's next step until it is done).

    Memory cost: one extra copy of this rank's model + optimizer shard, held for the whole run.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._signature: Any = None

    @staticmethod
    def _sig(state: dict[str, Any]) -> Any:
        def walk(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.dtype)
            if isinstance(x, dict):
                return tuple((k, walk(v)) for k, v in x.items())
            if isinstance(x, (list, tuple)):
                return tuple(walk(v) for v in x if isinstance(v, (torch.Tensor, dict, list, tuple)))
            return None
        return walk(state)

    def prepare(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        """(the staged state dict, the (source, buffer) tensor pairs ``copy`` fills it from)."""
        from torch.distributed._state_dict_utils import _create_cpu_state_dict

        sig = self._sig(state)
        if self._buffers is None or sig != self._signature:
            pin = accelerator_in_use()
            self._buffers = _create_cpu_state_dict(state, pin_memory=pin)
            self._signature = sig
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def walk(src: Any, buf: Any) -> Any:
            if isinstance(src, torch.Tensor):
                pairs.append((_local(src), _local(buf)))
                return buf
            if isinstance(src, dict):
                return {k: walk(v, buf[k]) for k, v in src.items()}
            if isinstance(src, (list, tuple)):
                return type(src)(walk(v, b) for v, b in zip(src, buf))
            return src  # plain values (lr, betas, ...) are the fresh ones from `state`

        return walk(state, self._buffers), pairs

    @staticmethod
    def copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for src, buf in pairs:
                buf.copy_(src.detach())
        if accelerator_in_use():
            torch.cuda.synchronize()

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Both halves on the calling thread."""
        staged, pairs = self.prepare(state)
        self.copy(pairs)
        return staged


class StepHold:
    """Holds the optimizer's next step until a background copy of the live state is done (``done``).

    The copy runs while the loop computes the next forward/backward, which never write the weights or
    the optimizer state; only ``optimizer.step`` does. Time spent waiting is stall (``waited_s``).
    ``close`` waits for the copy and removes the hook (a hook cannot remove itself while the
    optimizer iterates its hooks)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.done = threading.Event()
        self.waited_s = 0.0
        self._loop = threading.get_ident()  # only the loop's thread is held
        self._hook = optimizer.register_step_pre_hook(self._hold)

    def _hold(self, *_: Any) -> None:
        if not self.done.is_set() and threading.get_ident() == self._loop:
            t0 = time.perf_counter()
            self.done.wait()
            self.waited_s += time.perf_counter() - t0

    def close(self) -> float:
        """Wait for the copy, remove the hook; returns the seconds the loop waited for it."""
        self._hold()
        self._hook.remove()
        return self.waited_s
