"""The ``[profile]`` section: a torch.profiler trace (and on CUDA a memory snapshot) of a few steps."""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.config.core import ConfigError, option


def parse_steps(spec: str) -> tuple[int, int] | None:
    """``"10-12"`` -> ``(10, 12)``, ``"7"`` -> ``(7, 7)``, ``""`` -> ``None`` (off)."""
    spec = spec.strip()
    if not spec:
        return None
    first, sep, last = spec.partition("-")
    try:
        a, b = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ConfigError(f"profile.steps: {spec!r} is not a step or a range like '10-12'") from None
    if a < 1 or b < a:
        raise ConfigError(f"profile.steps: {spec!r} must be FIRST-LAST with 1 <= FIRST <= LAST, e.g. '10-12'")
    return a, b


@dataclass
class ProfileConfig:
    steps: str = option(
        "Profile these training steps, e.g. '10-12' (inclusive) or '10'; '' = off. Each rank writes a "
        "torch.profiler Chrome trace to <run>/profile/ (open it in https://ui.perfetto.dev or chrome://tracing); "
        "`stalwart report` links them. Leave a few warm-up steps before the window.", "")
    ranks: list[int] = option("Ranks that profile; empty = every rank.", factory=list)
    memory_snapshot: bool = option(
        "On CUDA, also record the allocator's history over the window and dump a memory snapshot "
        "(<run>/profile/rank-<r>-steps-A-B.memory.pickle, for https://pytorch.org/memory_viz).", True)
    record_shapes: bool = option("Record operator input shapes in the trace.", True)
    with_stack: bool = option("Record Python stacks of operators (larger traces, more overhead).", False)

    def __post_init__(self) -> None:
        parse_steps(self.steps)
        if any(r < 0 for r in self.ranks):
            raise ConfigError(f"profile.ranks: {self.ranks} must be rank numbers >= 0")

    @property
    def window(self) -> tuple[int, int] | None:
        return parse_steps(self.steps)
