"""Cache-aware routing: which replica holds a request's prompt prefix in its KV cache.

A replica's engine registers every full block of a computed prompt under a hash chain over every token
up to the block's end (``infer/blocks.py: block_digest``), and keeps a freed block's keys and values,
and its digest, until the block is handed out again. The router computes the same chain over a
request's prompt tokens (the replica's own tokenizer and chat template, so the tokens are the ones the
replica will compute) and keeps, per replica, the digests it holds: what the replica last reported
(``GET /v1/cache``, router only, polled every probe), plus the digests of what the router sent it since
(those blocks will be there once computed: SGLang's router inserts on routing the same way). A request
goes to the replica that holds the longest prefix of its prompt, unless that would unbalance the load
(SGLang's rule: the busiest replica has more than ``balance_abs`` requests in flight above the idlest
and more than ``balance_rel`` times as many; then the least loaded). A prompt no replica holds goes to
the least loaded. A conversation's next turn starts with the previous turns, so it sticks to the replica
that served them while that pays, and leaves it when the load says so.

Policies (``layout.routing``): ``cache-aware``; ``least-load`` (fewest requests in flight, the router's
behaviour before); ``round-robin`` (each request to the next replica in turn).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

from stalwart.infer.blocks import block_digest

POLICIES = ("cache-aware", "least-load", "round-robin")
SENT_TTL_S = 30.0  # a routed prompt's blocks count as held this long even if a report does not list them yet
SENT_MAX = 1 << 16  # digests remembered per replica beyond its reports


def pick(in_flight: list[int], up: list[bool] | None = None) -> list[int]:
    """Replicas in the order to try them: up before down, then least loaded, then lowest index."""
    up = up if up is not None else [True] * len(in_flight)
    return sorted(range(len(in_flight)), key=lambda i: (not up[i], in_flight[i], i))


def prompt_digests(tokens: list[int], block_size: int) -> list[bytes]:
    """The digest of each full block of ``tokens``, as the engine registers them."""
    out, digest = [], b""
    for k in range(len(tokens) // block_size):
        digest = block_digest(digest, tokens[k * block_size:(k + 1) * block_size])
        out.append(digest)
    return out


class PrefixView:
    """Per replica: the block digests it holds (reported, plus sent since). Pure logic; ``now`` injected."""

    def __init__(self, replicas: int) -> None:
        self.held: list[set[bytes]] = [set() for _ in range(replicas)]
        self.sent: list[OrderedDict[bytes, float]] = [OrderedDict() for _ in range(replicas)]
        self.block_size: int | None = None  # from the first report (every replica serves one config)

    def matched(self, i: int, digests: list[bytes]) -> int:
        """Leading blocks of ``digests`` replica ``i`` holds."""
        n = 0
        for d in digests:
            if d not in self.held[i] and d not in self.sent[i]:
                break
            n += 1
        return n

    def routed(self, i: int, digests: list[bytes], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        sent = self.sent[i]
        for d in digests:
            sent[d] = now
            sent.move_to_end(d)
        while len(sent) > SENT_MAX:
            sent.popitem(last=False)

    def reported(self, i: int, digests: set[bytes], now: float | None = None) -> None:
        """Replica ``i`` holds ``digests`` now; what was sent there long ago and is not among them is gone."""
        now = time.monotonic() if now is None else now
        self.held[i] = digests
        sent = self.sent[i]
        while sent and next(iter(sent.values())) < now - SENT_TTL_S:
            sent.popitem(last=False)

    def forget(self, i: int) -> None:
        """Replica ``i`` was started again: its cache is empty."""
        self.held[i], self.sent[i] = set(), OrderedDict()


class Policy:
    """The order in which to try replicas for a request."""

    def __init__(self, name: str, replicas: int, balance_abs: int, balance_rel: float) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
        self.name, self.balance_abs, self.balance_rel = name, balance_abs, balance_rel
        self.view = PrefixView(replicas)
        self.next = 0  # round-robin's turn
        self.requests = self.hits = 0  # requests routed with a prompt known; of them, sent where a prefix was held
        self.prompt_blocks = self.matched_blocks = 0

    def order(self, in_flight: list[int], usable: list[bool], digests: list[bytes] | None,
              among: list[int] | None = None) -> list[int]:
        """Replicas ``among`` (default all) in the order to try them: usable first; then by the policy."""
        ranked = [i for i in pick(in_flight, usable) if among is None or i in among]  # least loaded
        live = [i for i in ranked if usable[i]]
        if not live:
            return ranked
        if self.name == "round-robin":
            turn = sorted(live)
            k = self.next % len(turn)
            self.next += 1
            return turn[k:] + turn[:k] + [i for i in ranked if not usable[i]]
        if self.name == "least-load" or digests is None:
            return ranked
        loads = [in_flight[i] for i in live]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return ranked  # unbalanced: the least loaded, whatever it holds
        matched = {i: self.view.matched(i, digests) for i in live}
        return sorted(live, key=lambda i: (-matched[i], in_flight[i], i)) + [i for i in ranked if not usable[i]]

    def chose(self, i: int, digests: list[bytes] | None) -> None:
        """The request went to replica ``i``: count its hit, and its blocks will be there."""
        if digests is None:
            return
        matched = self.view.matched(i, digests)
        self.requests += 1
        self.hits += matched > 0
        self.prompt_blocks += len(digests)
        self.matched_blocks += matched
        self.view.routed(i, digests)

    def stats(self) -> dict:
        return {"policy": self.name, "requests": self.requests, "prefix_hits": self.hits,
                "prompt_blocks": self.prompt_blocks, "matched_blocks": self.matched_blocks}


class Prompts:
    """A request body's prompt tokens as its replica will compute them (the served tokenizer and chat
    template): what the router hashes. None for a body it cannot read (the replica will say why)."""

    def __init__(self, tokenizer_file: Path, chat_dir: Path | None) -> None:
        from tokenizers import Tokenizer

        from stalwart.serve.chat import ChatFormat

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.chat = ChatFormat.of_dir(chat_dir)

    def tokens(self, path: str, body: dict) -> list[list[int]] | None:
        from stalwart.serve.protocol import ChatRequest, CompletionRequest

        try:
            if path.endswith("/chat/completions"):
                return [ChatRequest.model_validate(body).token_prompt(self.tokenizer, self.chat)]
            return CompletionRequest.model_validate(body).token_prompts(self.tokenizer)
        except Exception:  # noqa: BLE001 - any body the replica refuses: routed without a prefix
            return None


def tokenizer_file(run: Path | None, hf: Path | None) -> Path:
    """Where a served source keeps its tokenizer."""
    from stalwart.paths import RunPaths

    return hf / "tokenizer.json" if hf is not None else RunPaths(run).tokenizer
