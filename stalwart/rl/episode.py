"""Episodes: one program per response, or a conversation of several (multi-turn tool use).

With ``rl.turns`` = 1 an episode is what it always was: the policy answers the prompt once. With N > 1
it is a conversation, run inside one generation call (so every token of it comes from one weight
version, and a group generated again is the same group, bit for bit):

    prompt -> program 1 -> [sandbox: visible tests] -> feedback 1 -> program 2 -> ... -> program k

After each turn but the last, the turn's program runs in the sandbox (``sandbox/local.py``, or the sandbox
services) on the instance's *visible* test cases (``Instance.visible_cases``, drawn apart from the hidden
ones). If it passes them the episode stops there; otherwise the first failure, two comment lines
(:func:`feedback_text`, cut to ``rl.feedback_tokens`` tokens, the reason kept first), is appended and the policy writes the
next program with everything so far as its context. The episode's reward is its *last* program's on
the hidden tests (``Group.programs``), scored by the reward workers as in one turn.

The response the trainer sees is the whole conversation after the prompt; its mask marks the policy's
own tokens (1) and the feedback (0): the loss, the token counts and the log-probability mismatch cover
the policy's tokens only, and the exact re-scoring (``generator._rescore``) reads the same packed row the
trainer does, so the mismatch stays exactly zero. Turn t > 1 of response j samples with a seed derived
from response j's own (:func:`turn_seed`); turn 1 keeps it, so one turn is bitwise today's episode.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from stalwart.rl import rollout

FIELD_CHARS = 48     # longest input, expected output or reason quoted in a feedback
MIN_CASE_TOKENS = 6  # fewer tokens of a cut case line than this say nothing: it is dropped
CACHE_LIMIT = 50_000  # visible-test verdicts a generator remembers (a program run again gets the same)


@dataclass(frozen=True)
class EpisodeSpec:
    """What a generator needs for multi-turn episodes (``None`` for one turn)."""
    turns: int
    feedback_tokens: int
    visible: dict[str, list[tuple[str, str]]]  # instance key -> visible (input, expected output) cases
    sandbox: tuple  # (SandboxConfig, threads, sandbox service URLs, retry seconds): where they run


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a response's turn ``turn`` (1-based): the response's own seed for the first."""
    return seed if turn == 1 else rollout._seed(seed, "turn", turn)


def _quote(text: str) -> str:
    text = text.strip().replace("\n", "\\n")
    return text if len(text) <= FIELD_CHARS else text[:FIELD_CHARS - 3] + "..."


def feedback_text(reason: str, cases: list[tuple[str, str]]) -> str:
    """The comment lines a failed turn appends: the first failing visible case's input and expected output
    (it is visible), then why it failed, the sandbox's verdict reason ("case 1: wrong answer") without its
    case number, or an uncaught exception's own line without the "exit status 1: " before it. A program
    that does not parse ran no case: its feedback is the one line of its syntax error."""
    m = re.match(r"case (\d+): (.*)$", reason, re.S)
    if not m:
        return f"# {_quote(reason)}\n"
    i, why = int(m.group(1)), m.group(2)
    why = re.sub(r"^exit status 1: (?=\S)", "", why)  # "NameError: ..." names the error; the status adds nothing
    inp, out = cases[min(i, len(cases) - 1)]
    return f"# input {_quote(inp)} output {_quote(out)}\n# {_quote(why)}\n"


def feedback_ids(encode: Callable[[str], list[int]], text: str, limit: int, newline: list[int]) -> list[int]:
    """``text`` as at most ``limit`` tokens, every line ended (``newline``: its tokens). Its last line,
    why the program failed, is kept whole where it fits and cut at its end otherwise; what is cut first is
    the line before it (the case), dropped when fewer than ``MIN_CASE_TOKENS`` of it would be left."""
    ids = encode(text)
    if len(ids) <= limit:
        return ids
    *before, last = text.splitlines(keepends=True)
    lead = encode("".join(line for line in before if not line.strip()))  # a turn's unfinished line, ended
    case = encode("".join(line for line in before if line.strip()))
    why = encode(last)
    if len(lead) + len(why) > limit:
        return lead + why[:limit - len(lead) - len(newline)] + newline
    room = limit - len(why) - len(lead) - len(newline)
    return lead + (case[:room] + newline if case and room >= MIN_CASE_TOKENS else []) + why


@dataclass
class Conversation:
    """One response of an episode: the tokens after the prompt, their log-probabilities (0.0 for the
    feedback's) and the policy mask."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    done: bool = False   # its program passed the visible tests (or it had its last turn)

    def add_turn(self, tokens: list[int], logprobs: list[float]) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.mask += [1] * len(tokens)
        self.turns += 1

    def add_feedback(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def program(self) -> list[int]:
        return rollout.last_turn(self.tokens, self.mask)


def segments(tokens: list[int], mask: list[int]) -> list[tuple[bool, list[int]]]:
    """A conversation cut into its turns and feedbacks: (the policy's?, tokens), in order."""
    out: list[tuple[bool, list[int]]] = []
    for tok, m in zip(tokens, mask):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(tok)
        else:
            out.append((bool(m), [tok]))
    return out


class VisibleTests:
    """A generator's side of the tool: runs programs on an instance's visible tests (its own sandboxes or
    the sandbox services, like a reward worker) and words the feedback."""

    def __init__(self, spec: EpisodeSpec, tok: Any, eos: int) -> None:
        from stalwart.sandbox.client import open_sandbox

        cfg, threads, urls, retry_s = spec.sandbox
        self.spec, self.tok, self.eos = spec, tok, eos
        self.sandbox = open_sandbox(cfg, urls, retry_s)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="visible-tests")
        self.threads = threads
        self.verdicts: dict[tuple[str, str], Any] = {}
        self.newline = tok.encode("\n").ids

    def text(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens[:-1] if tokens and tokens[-1] == self.eos else tokens)

    def check(self, jobs: list[tuple[str, list[int]]]) -> list[Any]:
        """(instance key, program tokens) -> the sandbox's verdict on its visible tests, in order."""
        from stalwart.sandbox.local import Case, score_spread

        keys = [(key, self.text(prog)) for key, prog in jobs]
        todo = list(dict.fromkeys(k for k in keys if k not in self.verdicts))
        if len(self.verdicts) + len(todo) > CACHE_LIMIT:
            self.verdicts.clear()
        jobs = [(prog, [Case(i, o) for i, o in self.spec.visible[key]]) for key, prog in todo]
        self.verdicts.update(zip(todo, score_spread(self.sandbox, self.pool, jobs, self.threads)))
        return [self.verdicts[k] for k in keys]

    def feedback(self, key: str, verdict: Any, after: list[int]) -> list[int]:
        """The feedback's tokens after a turn that ended with ``after`` (a line break first if that turn
        did not end with the end-of-text token), cut to ``rl.feedback_tokens``. NOTE: the task's prompt is
        not repeated after it: measured on the code task, a restated prompt made the second program no
        better than the first, while the feedback alone let RL make the second turn pay (docs/rl.md)."""
        text = feedback_text(verdict.reason, self.spec.visible[key])
        if after and after[-1] != self.eos:
            text = "\n" + text
        return feedback_ids(lambda s: self.tok.encode(s).ids, text, self.spec.feedback_tokens, self.newline)


def sample(engine: Any, items: list[tuple[str, list[int], Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Run ``items`` (request id, prompt, sampling parameters) to the end on ``engine``: each request's
    tokens and their log-probabilities."""
    for rid, prompt, params in items:
        engine.add(rid, prompt, params)
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid, _, _ in items}
    while engine.has_work():
        for o in engine.step():
            for c in o.choices:
                out[o.rid][0].append(c.token)
                out[o.rid][1].append(c.logprob)
    return out


def run_episodes(engine: Any, requests: list[Any], prompts: list[list[int]], sampling: dict[str, Any],
                 version: int, tests: VisibleTests | None, turns: int = 1) -> tuple[list[Any], dict[str, Any]]:
    """Every request's group of episodes on ``engine`` (the current weights, ``version``): turn by turn,
    each turn's responses sampled together; the visible tests run between turns (``tests``). Returns the
    groups and, for several turns, the figures of the episodes."""
    from stalwart.infer.sampling import SamplingParams

    s = sampling

    def params(seed: int) -> Any:
        return SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"], top_k=s["top_k"], seed=seed,
                              logprobs=0)

    convs = {(g, j): Conversation() for g, req in enumerate(requests) for j in range(len(req.seeds))}
    fig = {"episodes": len(convs), "episode_turns": 0, "feedback_tokens": 0, "visible_passed": 0}
    for t in range(1, turns + 1):
        live = [(g, j) for (g, j), c in convs.items() if not c.done]
        suffix = "" if t == 1 else f"@{t}"
        items = [(f"{requests[g].gid}#{j}{suffix}", prompts[g] + convs[g, j].tokens,
                  params(turn_seed(requests[g].seeds[j], t))) for g, j in live]
        got = sample(engine, items)
        for (g, j), (rid, _, _) in zip(live, items):
            convs[g, j].add_turn(*got[rid])
        if t == turns or tests is None:
            break
        verdicts = tests.check([(requests[g].instance.key, convs[g, j].program()) for g, j in live])
        for (g, j), v in zip(live, verdicts):
            c = convs[g, j]
            if v.passed == v.total:
                c.done = True
                fig["visible_passed"] += 1
                continue
            ids = tests.feedback(requests[g].instance.key, v, c.tokens)
            c.add_feedback(ids)
            fig["feedback_tokens"] += len(ids)
    groups = []
    for g, (req, prompt) in enumerate(zip(requests, prompts)):
        cs = [convs[g, j] for j in range(len(req.seeds))]
        groups.append(rollout.Group(req, list(prompt), [c.tokens for c in cs], [c.logprobs for c in cs], version,
                                    masks=[c.mask for c in cs] if tests is not None else None))
    fig["episode_turns"] = sum(c.turns for c in convs.values())
    return groups, (fig if tests is not None else {})
