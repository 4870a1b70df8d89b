"""Optimizers (AdamW, LAMB), learning-rate schedules (warmup + cosine / WSD / constant), gradient
clipping, and the gated optimizer that decides whether a step's update is applied."""

from __future__ import annotations

import math

import torch
from torch import nn

from stalwart.ft.gate import Decision, Gate, StepOutcome


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith("norm.weight") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019): Adam moments with a per-parameter trust ratio ||w|| / ||update||.

    Norms are taken over the *whole* parameter; with FSDP/TP sharded parameters (DTensor) the norm is
    reduced across shards, so every layout applies the same ratio.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * p
                w_norm = _full_norm(p)
                u_norm = _full_norm(update)
                ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * ratio)


def _full_norm(t: torch.Tensor) -> float:
    n = t.norm()
    if hasattr(n, "full_tensor"):
        n = n.full_tensor()
    return float(n)


def build_optimizer(cfg, model: nn.Module, elementwise: bool = False) -> torch.optim.Optimizer:
    """``cfg`` is the ``optimizer`` config section. ``elementwise``: every element's update must not depend
    on how the parameter is split (``training.elastic_exact``): the foreach AdamW, whose bits are the
    same on a whole tensor and on its shards; the fused CPU kernel's are not (measured: it rounds the
    elements of a vector's tail another way)."""
    groups = _param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    # fused: one kernel for the whole update (about 4x faster than foreach on CPU, same math).
    kwargs = {"foreach": True} if elementwise else {"fused": True} if cfg.fused else {"foreach": False}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs)


class LRSchedule:
    """lr(step) as a pure function of the step; the state is just the step counter."""

    def __init__(self, cfg, peak_lr: float, total_steps: int) -> None:
        self.kind, self.warmup = cfg.kind, min(cfg.warmup_steps, total_steps)
        self.min_ratio, self.decay_fraction = cfg.min_lr_ratio, cfg.decay_fraction
        self.peak, self.total = peak_lr, total_steps
        self.step_count = 0

    def factor(self, step: int) -> float:
        """Multiplier of the peak lr for optimizer step number ``step`` (0-based)."""
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.kind == "cosine":
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        # WSD: stable at peak, then linear decay over the last decay_fraction of training.
        decay_start = 1.0 - self.decay_fraction
        if progress <= decay_start or self.decay_fraction == 0:
            return 1.0
        return 1.0 - (1 - self.min_ratio) * (progress - decay_start) / self.decay_fraction

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        lr = self.peak * self.factor(self.step_count)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def advance(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by device mesh in first-seen order (foreach kernels cannot mix meshes: experts
    under expert parallel live on another mesh than the FSDP-sharded rest)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """2-norm of all gradients, reduced per mesh in parameter order (the same collectives on every rank)."""
    norms = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group=None,
                   total: torch.Tensor | None = None) -> float:
    """Global gradient norm over all shards and pipeline stages (clipped in place when max_norm > 0).
    ``total``: the norm, computed by the caller (``training.elastic_exact``'s layout-independent one)."""
    grads = [p.grad for p in params if p.grad is not None]
    if total is None:
        total = _total_norm(grads) if grads else torch.zeros(())
    if pp_group is not None:
        import torch.distributed as dist

        sq = (total.float() ** 2).reshape(1)
        dist.all_reduce(sq, group=pp_group)
        total = sq[0].sqrt()
    if not grads:
        return float(total)
    if max_norm > 0:
        for group in _by_mesh([p for p in params if p.grad is not None]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return float(total)


class GatedOptimizer:
    """The optimizer behind a gate: ``step`` applies the update only if every gate agrees.

    Gates are registered from outside the training step (fault tolerance registers one that skips
    non-finite steps on every rank together, or asks for a rollback). A gate that decides collectively
    must be registered on every rank, so all ranks take the same decision. With no gate every step
    commits.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.gates: list[Gate] = []

    def step(self, step: int, local_loss: torch.Tensor | None, grad_norm: float, compute_s: float) -> Decision:
        outcome = StepOutcome(step, local_loss, grad_norm, compute_s)
        decision = Decision()
        for gate in self.gates:
            d = gate(outcome)
            decision = Decision(decision.commit and d.commit,
                                d.mean_loss if d.mean_loss is not None else decision.mean_loss)
        if decision.commit:
            self.optimizer.step()
        return decision

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
