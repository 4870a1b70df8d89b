"""Incremental detokenization with stop strings.

Token ids become text only once they decode to complete characters (a byte-level BPE token may end
inside a UTF-8 sequence), and text that could be the start of a stop string is held back until it
cannot be, so a streaming client never sees part of a stop string. Before ``min_tokens`` tokens no stop
string ends the output (text shown meanwhile stays shown).
"""

from __future__ import annotations


class TextTail:
    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0  # characters already handed out

    def push(self, generated: list[int], final: bool = False) -> tuple[str, bool]:
        """(text newly safe to show, whether a stop string ended the output). No tokenizer: ids only."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(generated)
        if self.stop and len(generated) >= self.min_tokens:
            hits = [i for i in (text.find(s, max(0, self.sent - self.hold)) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                delta, self.sent = text[self.sent:end], max(self.sent, end)
                return delta, True
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":  # an incomplete character so far
                end -= 1
            end = max(self.sent, end - self.hold)
        delta, self.sent = text[self.sent:end], end
        return delta, False
