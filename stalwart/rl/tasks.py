"""A verifiable code task: short stdin -> stdout programs from parameterised problem families.

An instance is a family plus its parameters (say "add 7"): a prompt in words, hidden test cases
whose answers come from the family's own rule (never from running a program), and a reference
program. Instances split into training and held-out sets by a seeded hash of their identity, so a
held-out instance is a (family, parameters) pair never seen in fine-tuning or RL. Pure logic: no
I/O, no clocks; equal seeds give equal instances and cases.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from stalwart.sandbox.verdicts import Case

Params = tuple[int, ...]
LETTERS = "abcdefgh"


@dataclass(frozen=True)
class Family:
    name: str
    params: tuple[Params, ...]          # every parameter tuple this family has
    prompt: Callable[[Params], str]     # the task in words
    program: Callable[[Params], str]    # a correct program
    make_input: Callable[[random.Random, Params], str]
    answer: Callable[[str, Params], str]


def _int(r: random.Random, p: Params) -> str:
    return str(r.randint(0, 99))


def _pair(r: random.Random, p: Params) -> str:
    return f"{r.randint(0, 99)} {r.randint(0, 99)}"


def _ints(r: random.Random, p: Params) -> str:
    return " ".join(str(r.randint(0, 99)) for _ in range(r.randint(2, 6)))


def _word(r: random.Random, p: Params) -> str:
    return "".join(r.choice(LETTERS) for _ in range(r.randint(3, 9)))


def _words(r: random.Random, p: Params) -> str:
    return " ".join(_word(r, p) for _ in range(r.randint(1, 5)))


def _ks(lo: int, hi: int) -> tuple[Params, ...]:
    return tuple((k,) for k in range(lo, hi + 1))


def _pairs(chars: str) -> tuple[Params, ...]:
    return tuple((i, j) for i in range(len(chars)) for j in range(len(chars)) if i != j)


def _compare(n: int, k: int) -> str:
    return "yes" if n > k else "no"


FAMILIES: tuple[Family, ...] = (
    Family("add", _ks(1, 9), lambda p: f"print n plus {p[0]}", lambda p: f"print(int(input())+{p[0]})",
           _int, lambda s, p: str(int(s) + p[0])),
    Family("sub", _ks(1, 9), lambda p: f"print n minus {p[0]}", lambda p: f"print(int(input())-{p[0]})",
           _int, lambda s, p: str(int(s) - p[0])),
    Family("mul", _ks(2, 9), lambda p: f"print n times {p[0]}", lambda p: f"print(int(input())*{p[0]})",
           _int, lambda s, p: str(int(s) * p[0])),
    Family("div", _ks(2, 9), lambda p: f"print n divided by {p[0]}", lambda p: f"print(int(input())//{p[0]})",
           _int, lambda s, p: str(int(s) // p[0])),
    Family("mod", _ks(2, 9), lambda p: f"print n modulo {p[0]}", lambda p: f"print(int(input())%{p[0]})",
           _int, lambda s, p: str(int(s) % p[0])),
    Family("square_add", _ks(1, 9), lambda p: f"print n squared plus {p[0]}",
           lambda p: f"n=int(input())\nprint(n*n+{p[0]})", _int, lambda s, p: str(int(s) ** 2 + p[0])),
    Family("greater", _ks(1, 9), lambda p: f"print yes if n is greater than {p[0]}0 else no",
           lambda p: f"print('yes' if int(input())>{p[0]}0 else 'no')", _int,
           lambda s, p: _compare(int(s), p[0] * 10)),
    Family("pair_sum", _ks(0, 9), lambda p: f"print a plus b plus {p[0]}",
           lambda p: f"a,b=map(int,input().split())\nprint(a+b+{p[0]})", _pair,
           lambda s, p: str(sum(map(int, s.split())) + p[0])),
    Family("pair_prod", _ks(1, 9), lambda p: f"print a times b times {p[0]}",
           lambda p: f"a,b=map(int,input().split())\nprint(a*b*{p[0]})", _pair,
           lambda s, p: str(int(s.split()[0]) * int(s.split()[1]) * p[0])),
    Family("list_max", _ks(0, 9), lambda p: f"print the largest number plus {p[0]}",
           lambda p: f"print(max(map(int,input().split()))+{p[0]})", _ints,
           lambda s, p: str(max(map(int, s.split())) + p[0])),
    Family("list_min", _ks(0, 9), lambda p: f"print the smallest number plus {p[0]}",
           lambda p: f"print(min(map(int,input().split()))+{p[0]})", _ints,
           lambda s, p: str(min(map(int, s.split())) + p[0])),
    Family("list_sum", _ks(0, 9), lambda p: f"print the sum of the numbers plus {p[0]}",
           lambda p: f"print(sum(map(int,input().split()))+{p[0]})", _ints,
           lambda s, p: str(sum(map(int, s.split())) + p[0])),
    Family("list_count", _ks(0, 9), lambda p: f"print how many numbers there are plus {p[0]}",
           lambda p: f"print(len(input().split())+{p[0]})", _ints, lambda s, p: str(len(s.split()) + p[0])),
    Family("repeat", _ks(2, 9), lambda p: f"print the word {p[0]} times",
           lambda p: f"print(input()*{p[0]})", _word, lambda s, p: s * p[0]),
    Family("prefix", _ks(1, 9), lambda p: f"print the first {p[0]} letters",
           lambda p: f"print(input()[:{p[0]}])", _word, lambda s, p: s[:p[0]]),
    Family("suffix", _ks(1, 9), lambda p: f"print the last {p[0]} letters",
           lambda p: f"print(input()[-{p[0]}:])", _word, lambda s, p: s[-p[0]:]),
    Family("count_char", tuple((i,) for i in range(len(LETTERS))),
           lambda p: f"print how many times '{LETTERS[p[0]]}' occurs",
           lambda p: f"print(input().count('{LETTERS[p[0]]}'))", _word,
           lambda s, p: str(s.count(LETTERS[p[0]]))),
    Family("replace", _pairs(LETTERS), lambda p: f"print the word with '{LETTERS[p[0]]}' replaced by '{LETTERS[p[1]]}'",
           lambda p: f"print(input().replace('{LETTERS[p[0]]}','{LETTERS[p[1]]}'))", _word,
           lambda s, p: s.replace(LETTERS[p[0]], LETTERS[p[1]])),
    Family("length", _ks(0, 9), lambda p: f"print the length of the word plus {p[0]}",
           lambda p: f"print(len(input())+{p[0]})", _word, lambda s, p: str(len(s) + p[0])),
    Family("word_count", _ks(0, 9), lambda p: f"print how many words there are plus {p[0]}",
           lambda p: f"print(len(input().split())+{p[0]})", _words, lambda s, p: str(len(s.split()) + p[0])),
    Family("reverse", _ks(1, 5), lambda p: f"print the word reversed {p[0]} times",
           lambda p: f"print(input()[::-1]*{p[0]})", _word, lambda s, p: s[::-1] * p[0]),
    Family("upper_prefix", _ks(1, 9), lambda p: f"print the first {p[0]} letters in capitals",
           lambda p: f"print(input()[:{p[0]}].upper())", _word, lambda s, p: s[:p[0]].upper()),
)
BY_NAME = {f.name: f for f in FAMILIES}


@dataclass(frozen=True)
class Instance:
    family: str
    params: Params

    @property
    def key(self) -> str:
        return f"{self.family}:{','.join(map(str, self.params))}"

    @property
    def prompt(self) -> str:
        return BY_NAME[self.family].prompt(self.params)

    @property
    def solution(self) -> str:
        return BY_NAME[self.family].program(self.params)

    def cases(self, n: int, seed: int, tag: str = "", avoid: tuple[Case, ...] = ()) -> list[Case]:
        """n hidden test cases, distinct inputs where the family has enough of them, and at least two
        distinct answers where the instance has them (else a program printing a constant, "no" for
        "greater than 90", "0" for counting a rare letter, would pass every case). ``tag`` draws another
        set (the visible tests), whose inputs stay apart from ``avoid``'s where the family has enough."""
        fam = BY_NAME[self.family]
        rng = random.Random(f"{seed}/{tag}/{self.key}" if tag else f"{seed}/{self.key}")
        inputs: list[str] = []
        taken = {c.input for c in avoid}
        for _ in range(n * 20):
            s = fam.make_input(rng, self.params)
            if s not in inputs and s not in taken:
                inputs.append(s)
            if len(inputs) == n:
                break
        answers = [fam.answer(s, self.params) for s in inputs]
        if n >= 2 and len(set(answers)) == 1:
            for _ in range(n * 200):
                s = fam.make_input(rng, self.params)
                if s not in inputs and s not in taken and fam.answer(s, self.params) != answers[0]:
                    inputs[-1], answers[-1] = s, fam.answer(s, self.params)
                    break
        return [Case(s, a) for s, a in zip(inputs, answers)]

    def visible_cases(self, n: int, seed: int, hidden: int) -> list[Case]:
        """The n test cases a multi-turn episode shows the policy: drawn apart from the ``hidden``
        (count) cases that score it."""
        return self.cases(n, seed, "visible", tuple(self.cases(hidden, seed)))


def all_instances() -> list[Instance]:
    return [Instance(f.name, p) for f in FAMILIES for p in f.params]


def is_held_out(inst: Instance, seed: int, fraction: float) -> bool:
    """A fixed, seeded fraction of each family's instances never appears in fine-tuning or RL."""
    digest = hashlib.sha256(f"{seed}/held-out/{inst.key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split(seed: int, fraction: float) -> tuple[list[Instance], list[Instance]]:
    """(train, held_out); every family keeps at least one instance on each side."""
    train: list[Instance] = []
    held: list[Instance] = []
    for fam in FAMILIES:
        insts = [Instance(fam.name, p) for p in fam.params]
        out = [i for i in insts if is_held_out(i, seed, fraction)]
        if not out:
            out = [min(insts, key=lambda i: hashlib.sha256(f"{seed}/{i.key}".encode()).digest())]
        if len(out) == len(insts):
            out = out[1:]
        held += out
        train += [i for i in insts if i not in out]
    return train, held
