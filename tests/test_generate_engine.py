"""`stalwart generate` and the end-of-training sample run through the inference engine (infer/complete.py):
the same tokens as the plain full-forward loop for the same seed, the fused projections read in place;
int8 quantized weights (infer/quant.py): close to float32, weight updates quantized again, refused
where they cannot run."""

from __future__ import annotations

import pytest
import torch
from plain_generate import sample

from stalwart.errors import UserError
from stalwart.infer.complete import complete, fit_context
from stalwart.infer.load import build_model, copy_full_state
from stalwart.models.flavors import TransformerArgs
from stalwart.models.fused import back_to_back
from stalwart.models.llama import Transformer
from stalwart.train.init import materialize_and_init

# A large init spreads the logits, so choices are far from ties and sequences do not collapse.
ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_hidden=128, max_seq_len=64,
                       init_std=0.4)

pytestmark = pytest.mark.unit


def build(seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize_and_init(model, torch.device("cpu"), seed)
    return model.eval()


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 0), (0.8, 5), (1.5, 3)])
def test_the_engine_draws_the_plain_loops_tokens_for_the_same_seed(temperature, seed):
    prompt = [5, 17, 3, 60, 2]
    reference = sample(build(), prompt, 40, ARGS.max_seq_len, temperature, 40, seed=seed)
    model = build()
    done = complete(model, prompt, 40, temperature, 40, seed=seed)
    assert done.tokens == reference and len(reference) == 40 and not done.capped
    # The engine laid the packed projections back to back: no weight is concatenated per call.
    attn, ffn = model.layers["0"].attention, model.layers["0"].feed_forward
    assert back_to_back([attn.wq.weight, attn.wk.weight, attn.wv.weight]) is not None
    assert back_to_back([ffn.w1.weight, ffn.w3.weight]) is not None


def test_an_end_of_text_token_ends_the_output_and_is_not_shown():
    prompt = [5, 17, 3]
    free = sample(build(), prompt, 20, ARGS.max_seq_len, 0.0, 0)
    eos = free[6]
    done = complete(build(), prompt, 20, 0.0, 0, eos_id=eos)
    assert done.tokens == free[:free.index(eos)]


def test_the_context_bounds_prompt_and_new_tokens():
    assert fit_context([], 5, 64, 7) == ([7], 5, False)  # an empty prompt starts from end-of-text
    assert fit_context([], 5, 64, None) == ([0], 5, False)
    assert fit_context(list(range(100)), 10, 64, None) == (list(range(46, 100)), 10, False)
    assert fit_context([1, 2], 100, 64, None) == ([2], 63, True)
    done = complete(build(), [1, 2, 3], 100, 0.0, 0)
    assert done.capped and done.prompt == [3] and len(done.tokens) == 63


def _loaded(model: Transformer):
    from stalwart.infer.load import Loaded

    return Loaded(ARGS, None, None, {k: v.clone() for k, v in model.state_dict().items()}, None)


def _logits(model, tokens):
    return model(torch.tensor([tokens]))[0].float()


def test_int8_layers_stay_close_to_float32_and_take_weight_updates():
    from stalwart.infer.quant import Int8Linear, weight_bytes

    cpu = torch.device("cpu")
    source = build()
    fp32 = build_model(_loaded(source), torch.float32, cpu)
    int8 = build_model(_loaded(source), torch.float32, cpu, quantize="int8")
    linears = [m for m in int8.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per block and the (tied) output head
    assert weight_bytes(int8) < 0.7 * weight_bytes(fp32)
    tokens = [5, 17, 3, 60, 2, 9, 41, 33]
    with torch.no_grad():
        a, b = _logits(fp32, tokens), _logits(int8, tokens)
        assert (a - b).abs().max() < 0.1 * a.abs().max()  # int8 error (~6 % here), not a different model
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
        # state_dict has the float model's names and shapes; a weight update is quantized again.
        assert {k: v.shape for k, v in int8.state_dict().items()} == {k: v.shape for k, v in fp32.state_dict().items()}
        other = build(seed=1)
        copy_full_state(int8, other.state_dict())
        c = _logits(other, tokens)
        assert (_logits(int8, tokens) - c).abs().max() < 0.1 * c.abs().max()
    # Generation through the engine on int8 weights: tokens mostly agree with float32's (greedy).
    got = complete(int8, [5, 17, 3], 30, 0.0, 0).tokens
    want = complete(build_model(_loaded(other), torch.float32, cpu), [5, 17, 3], 30, 0.0, 0).tokens
    assert len(got) == 30 and got[:5] == want[:5]


def test_int8_is_refused_where_it_cannot_run():
    from stalwart.infer.quant import check_quantize

    cpu = torch.device("cpu")
    with pytest.raises(UserError, match="engine.dtype = float32"):
        check_quantize("int8", torch.bfloat16, cpu, 1)
    with pytest.raises(UserError, match="layout.tp = 1"):
        check_quantize("int8", torch.float32, cpu, 2)
    with pytest.raises(UserError, match="CPU kernels"):
        check_quantize("int8", torch.float32, torch.device("meta"), 1)
    check_quantize("none", torch.bfloat16, torch.device("meta"), 4)
