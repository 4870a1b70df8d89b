"""What an RL run is made of before any process starts: the task split, the fine-tuning set, the
tokenizer, the model shape and the row length. Pure functions of the config (no clocks, no processes);
the tokenizer is trained on the training instances' text only, so a held-out instance's prompt is never
seen, not even by the vocabulary's merges.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from stalwart.config.rl import RLConfig
from stalwart.rl.rollout import CHANNELS, MASK, TOKEN, WEIGHT
from stalwart.config.core import ConfigError
from stalwart.rl.tasks import BY_NAME, Instance, split


def prompt_text(inst: Instance) -> str:
    return f"# {inst.prompt}\n"


def _by_family(instances: list[Instance], seed: int, tag: str) -> dict[str, list[Instance]]:
    """Instances grouped by family, each group in a seeded order."""
    out: dict[str, list[Instance]] = {}
    for inst in sorted(instances, key=lambda i: hashlib.sha256(f"{seed}/{tag}/{i.key}".encode()).digest()):
        out.setdefault(inst.family, []).append(inst)
    return out


@dataclass
class TaskSetup:
    train: list[Instance]
    held_out: list[Instance]
    sft: list[Instance]
    evaluated: list[Instance]  # the held-out instances every evaluation measures

    @classmethod
    def of(cls, cfg: RLConfig) -> TaskSetup:
        seed = cfg.run.seed
        train, held = split(seed, cfg.task.held_out_fraction)
        wanted = set(cfg.task.family_names())
        unknown = sorted(wanted - set(BY_NAME))
        if unknown:
            raise ConfigError(f"task.families: unknown famil{'ies' if len(unknown) > 1 else 'y'} "
                              f"{', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
        if wanted:
            train = [i for i in train if i.family in wanted]
            held = [i for i in held if i.family in wanted]
        n = cfg.sft.examples_per_family
        by_family = _by_family(train, seed, "sft")
        sft = [i for fam in sorted(by_family) for i in by_family[fam][:n]]
        m = cfg.task.eval_per_family
        held_by = _by_family(held, seed, "eval")
        evaluated = [i for fam in sorted(held_by) for i in (held_by[fam][:m] if m else held_by[fam])]
        return cls(train, held, sft, evaluated)


def tokenizer_texts(setup: TaskSetup) -> list[str]:
    return [prompt_text(i) + i.solution for i in setup.train]


def build_tokenizer(setup: TaskSetup, vocab_size: int):
    from stalwart.data.tokenizer import train_bpe

    # Digits are single tokens: a constant in the prompt and the same constant in the program are the
    # same tokens, so the policy can learn to copy it rather than memorise one program per instance.
    return train_bpe(tokenizer_texts(setup) * 4, vocab_size, individual_digits=True)


def max_prompt_tokens(tok, instances: list[Instance]) -> int:
    return max(len(tok.encode(prompt_text(i)).ids) for i in instances)


def sft_rows(tok, eos: int, examples: list[Instance], length: int, pad: int, ranks: int) -> list[
        tuple[np.ndarray, np.ndarray]]:
    """One micro-batch per trainer rank (examples dealt round-robin): inputs and packed rows whose mask
    covers the program and its end token, weighted so the ranks' losses add up to the token mean."""
    seqs = [(tok.encode(prompt_text(i)).ids, tok.encode(i.solution).ids + [eos]) for i in examples]
    weight = ranks / max(sum(len(c) for _, c in seqs), 1)
    out = []
    for r in range(ranks):
        mine = seqs[r::ranks]
        x = np.full((len(mine), length), pad, dtype=np.int64)
        rows = np.zeros((len(mine), length, CHANNELS), dtype=np.float64)
        rows[..., TOKEN] = pad
        for j, (p, c) in enumerate(mine):
            seq = p + c
            if len(seq) - 1 > length:
                raise ConfigError(f"rl.max_tokens is too small for the fine-tuning examples: one of {len(seq)} tokens "
                                  f"needs {len(seq) - 1 - length} more than a row's {length} positions; raise "
                                  f"rl.max_tokens by that much")
            x[j, :len(seq) - 1] = seq[:-1]
            rows[j, :len(seq) - 1, TOKEN] = seq[1:]
            rows[j, len(p) - 1:len(seq) - 1, MASK] = 1.0
            rows[j, :, WEIGHT] = weight
        out.append((x, rows))
    return out
