"""`stalwart serve --quantize int8` through the real CLI, from an exported Hugging Face directory: the same
API on int8 weights (echo log-probabilities as lm-evaluation-harness asks for them, close to float32's but
not equal to them; a structured output; speculative decoding on top), and settings it cannot run with
refused in one line before anything starts. One trained run, one export, one server."""

from __future__ import annotations

import math
import re
import urllib.request

import pytest
import torch

from conftest import run_cli, tiny_hf
from test_serve_e2e import Server

pytestmark = pytest.mark.e2e

REGEX = r"[0-9]{3}-[a-z]{2,5}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    hf = tiny_hf(root, 4)
    server = Server(root, "--hf", str(hf), "--quantize", "int8", "--engine.speculative", "ngram")
    yield server, hf
    server.stop()


def float32_logprobs(hf, ids: list[int]) -> list[float]:
    """Each token's log-probability after the first, from the float32 model of the same directory."""
    from stalwart.infer.load import build_model, read_source, source_from

    model = build_model(read_source(source_from(hf)), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        logp = model(torch.tensor([ids]))[0, :-1].float().log_softmax(-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_int8_serves_echo_structured_outputs_and_speculative_decoding(served):
    server, hf = served
    c = server.client
    ids = [int(x) for x in torch.randint(0, 384, (48,), generator=torch.Generator().manual_seed(0))]
    # lm-evaluation-harness's loglikelihood request: echo, logprobs, no new tokens.
    r = c.completions.create(model=None, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    got = r.choices[0].logprobs.token_logprobs[1:]
    want = float32_logprobs(hf, ids)
    assert len(got) == len(want) == 47 and all(math.isfinite(x) for x in got)
    assert got != want  # int8 weights, not float32's
    assert abs(sum(got) - sum(want)) < 0.03 * abs(sum(want)), (sum(got), sum(want))
    # A structured output is honoured on the quantized weights.
    for seed in (0, 1):
        text = c.completions.create(model=None, prompt="def f(x):", max_tokens=12, seed=seed, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": REGEX}}).choices[0].text
        assert re.fullmatch(REGEX, text), text
    # Speculative decoding (prompt lookup) drafts on a looping prompt and the output is complete.
    out = c.completions.create(model=None, prompt="a b a b a b a b a b", max_tokens=24, temperature=0,
                               extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 24
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    proposed = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("stalwart_serve_speculative_drafts{") and 'kind="proposed"' in line]
    assert proposed and proposed[0] > 0, [line for line in text.splitlines() if "specul" in line][:10]


def test_settings_int8_cannot_run_with_are_one_line(served):
    _, hf = served
    both = "set engine.dtype = float32 and layout.tp = 1"
    for flags, says in ((["--quantize", "int8", "--dtype", "bfloat16"], both), (["--quantize", "int8", "--tp", "2"], both),
                        (["--quantize", "int4"], "'int4' is not one of 'none', 'int8'")):
        proc = run_cli("serve", "--hf", str(hf), "--port", "0", *flags, check=False, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
