"""Prefill and decode on separate replicas: which split P:D of ``replicas`` one-process replicas serves a
workload best (``stalwart serve --plan --target.replicas N``; serve/disagg.py serves it).

Pure functions over the serving planner's step model (planner/serving.py ``step_s``). A request costs a
prefill of its prompt (``ttft``) and ``output_tokens`` decode steps of a batch of ``b`` sequences (``tpot``).
- Colocated, every replica does both: a batch of ``b`` lives ``output_tokens`` steps and stalls for each
  member's prefill, which the engine cuts into chunks of at most ``max_batch_tokens`` tokens between
  decode steps; a decode step that carries a chunk takes the step plus that chunk, so the slowest tokens
  (p99) take ``tpot + chunk``.
- P:D: prefill replicas serve ``P / ttft`` requests a second, decode replicas ``D * b / (output_tokens *
  tpot)``; the fleet serves the smaller, and no decode step carries a prompt (p99 = ``tpot``).
Where the replicas outnumber the host's cores (``cores``), each runs at cores/replicas of a core while
all are busy (the CPU's case here); a prefill replica is busy only the share of the time its prompts
take, so it slows the decode replicas by that share.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.planner.serving import HostSpec, ServingRequest, step_s
from stalwart.planner.shapes import ModelShape


@dataclass(frozen=True)
class Split:
    prefill: int  # 0: colocated
    decode: int
    tokens_per_s: float
    tpot_p99_s: float
    bound: str  # what limits it: "prefill", "decode" or "both" (colocated)

    @property
    def name(self) -> str:
        return f"{self.prefill}:{self.decode}" if self.prefill else f"colocated x{self.decode}"


def splits(shape: ModelShape, hosts: HostSpec, req: ServingRequest, replicas: int, batch: int,
           chunk_tokens: int, cores: float) -> list[Split]:
    """Colocated and every P:D of ``replicas``, predicted (best first: throughput, then p99 TPOT)."""
    mid = req.prompt_tokens + req.output_tokens / 2
    ttft = step_s(shape, hosts, req, 1, 1, 1, req.prompt_tokens, req.prompt_tokens / 2, seqs=1)[0]
    tpot = step_s(shape, hosts, req, 1, 1, 1, batch, mid)[0]
    chunk = min(req.prompt_tokens, chunk_tokens)
    stall = step_s(shape, hosts, req, 1, 1, 1, chunk, chunk / 2, seqs=1)[0]
    slow = max(1.0, replicas / cores)  # every replica busy: each gets cores / replicas of a core
    per = batch * req.output_tokens / (req.output_tokens * tpot + batch * ttft) / slow
    out = [Split(0, replicas, replicas * per, (tpot + stall) * slow, "both")]
    for p in range(1, replicas):
        d = replicas - p
        prefill_rate = p / (ttft * slow)  # requests/s
        decode_rate = d * batch / (req.output_tokens * tpot * slow)
        rate = min(prefill_rate, decode_rate)
        busy = rate / prefill_rate  # share of the time prefill replicas compute
        share = max(1.0, (d + p * busy) / cores)  # decode replicas' slowdown from everything running
        out.append(Split(p, d, rate * req.output_tokens, tpot * share,
                         "prefill" if prefill_rate < decode_rate else "decode"))
    return sorted(out, key=lambda s: (-s.tokens_per_s, s.tpot_p99_s))


def choose(candidates: list[Split], max_tpot_s: float = 0.0, within: float = 0.9) -> Split:
    """Among the splits that meet ``max_tpot_s`` (0: no bound; none: all), the least p99 time per token of
    those within ``within`` of the most throughput: moving prompts off the decode replicas costs some
    throughput (the split's sides are rarely balanced) and buys the decode steps that carry no prompt."""
    ok = [c for c in candidates if not max_tpot_s or c.tpot_p99_s <= max_tpot_s] or candidates
    most = max(c.tokens_per_s for c in ok)
    return min((c for c in ok if c.tokens_per_s >= within * most), key=lambda c: (c.tpot_p99_s, -c.tokens_per_s))
