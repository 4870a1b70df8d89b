"""The one sampler drawing many rows at once: `generate.next_tokens` draws each row's token as
`torch.multinomial` draws it alone, and `sampling.sample_rows` gives, bit for bit, the tokens and
log-probabilities of `sample_row` row by row, for every kind of request a batch can mix."""

from __future__ import annotations

import pytest
import torch

from stalwart.generate import TokenDraws, next_tokens
from stalwart.infer.sampling import SamplingParams, sample_row, sample_rows

pytestmark = pytest.mark.unit


def test_each_row_draws_what_multinomial_draws_for_it_alone():
    torch.manual_seed(0)
    for vocab in (7, 512, 32000):
        logits = torch.randn(24, vocab) * 3
        probs = torch.softmax(logits, dim=-1)
        seeds = list(range(100, 124))
        got = next_tokens(logits, 1.0, 0, 1.0, [lambda s=s: torch.Generator().manual_seed(s) for s in seeds])
        want = [int(torch.multinomial(p, 1, generator=torch.Generator().manual_seed(s))) for p, s in zip(probs, seeds)]
        assert got == want
    with pytest.raises(RuntimeError, match="probability tensor"):
        next_tokens(torch.full((2, 5), float("nan")), 1.0, 0, 1.0, [torch.Generator] * 2)


def test_rows_sampled_together_equal_rows_sampled_alone_bit_for_bit():
    torch.manual_seed(1)
    vocab, eos = 512, 3
    kinds = [SamplingParams(), SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.7, logprobs=0),
             SamplingParams(top_k=5, logprobs=0), SamplingParams(top_p=0.9), SamplingParams(logprobs=3),
             SamplingParams(logit_bias={5: 2.0}, logprobs=0), SamplingParams(presence_penalty=0.5, min_tokens=4)]
    rows, alone = [], []
    logits = torch.randn(40, vocab) * 4
    for i in range(40):
        params = kinds[i % len(kinds)]
        draws, generated = TokenDraws(1000 + i), [7, 7, 9][: i % 4]
        allowed = (torch.arange(vocab) % 3 == 0) if i % 11 == 0 else None
        rows.append((params, lambda d=draws, g=generated: d.at(len(g)), generated, allowed))
        gen = TokenDraws(1000 + i).at(len(generated)) if params.temperature > 0 else None
        alone.append(sample_row(logits[i], params, gen, generated, eos, allowed))
    together = sample_rows(logits, rows, eos)
    assert [(c.token, c.logprob, c.top) for c in together] == [(c.token, c.logprob, c.top) for c in alone]
    assert len({c.token for c in together}) > 10 and all(c.logprob is not None for c in together[1:4])
