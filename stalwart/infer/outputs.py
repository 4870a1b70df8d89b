"""What the engine gives back: each request's ``Output`` of a step, and ``RequestError`` for a request it
cannot take."""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.errors import UserError
from stalwart.infer.sampling import Choice


class RequestError(UserError, ValueError):
    """A request the engine cannot take (too long, bad parameters); the message says why, ``param``
    names the request field to change."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Output:
    """What one step produced for one request."""

    rid: str
    choices: list[Choice]  # tokens generated this step (0 or 1)
    text: str  # text newly safe to show (stop strings held back until they cannot match)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "handoff" (to another engine)
    weight_version: int = 0
    prompt: list[Choice] | None = None  # the prompt's log-probabilities (asked for), with the first output
    kv: object = None  # a handed-off request's keys and values (torch.Tensor; infer/handoff.py)
