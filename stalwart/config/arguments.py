"""Command lines of the tools that take flags rather than a config tree (argparse), held to the same rule
as the config: a bad flag is one line naming it, exit status 2, no usage block to scroll past. The value
types below check a flag's range as argparse parses it, so a benchmark never starts on a value it cannot
use (``type=at_least(1)``: ``--repeats: must be at least 1 (got 0)``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import NoReturn, TypeVar

T = TypeVar("T")


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line: ``<prog>: error: <what> (see <prog> --help)``."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def at_least(low: int | float, kind: type = int) -> Callable[[str], int | float]:
    """A flag's type: a number (``kind``) no smaller than ``low``."""
    def parse(text: str) -> int | float:
        value = _number(text, kind)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low} (got {text})")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def positive(text: str) -> float:
    """A flag's type: a number above 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (got {text})")
    return value


def listed(item: Callable[[str], T], empty: bool = False) -> Callable[[str], list[T]]:
    """A flag's type: comma-separated values, each parsed by ``item`` (a type above, or ``one_of``);
    ``empty``: an empty value is an empty list."""
    def parse(text: str) -> list[T]:
        if empty and not text.strip():
            return []
        parts = [p.strip() for p in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        out = []
        for p in parts:
            try:
                out.append(item(p))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(str(e) if repr(p) in str(e) else f"{p!r}: {e}") from None
        return out
    parse.__name__ = "list"
    return parse


def one_of(choices: Iterable[str]) -> Callable[[str], str]:
    """A flag's type (for ``listed``): one of ``choices``."""
    valid = list(choices)

    def parse(text: str) -> str:
        if text not in valid:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(valid)}")
        return text
    parse.__name__ = "choice"
    return parse
