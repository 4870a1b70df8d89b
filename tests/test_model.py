import ast
import contextlib
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from stalwart.models.flavors import FLAVORS, ModelShapeError
from stalwart.models.llama import Transformer, count_params, flops_per_token
from stalwart.train.init import materialize_and_init

pytestmark = pytest.mark.unit

ARGS = dataclasses.replace(FLAVORS["debug"], max_seq_len=64)


def build(args=ARGS, seed=0):
    with torch.device("meta"):
        m = Transformer(args)
    materialize_and_init(m, torch.device("cpu"), seed)
    return m


def test_model_code_never_imports_torch_distributed():
    model_file = Path(inspect.getfile(Transformer)).resolve()
    files = sorted(model_file.parent.rglob("*.py"))  # the package the model lives in, wherever it moves
    assert model_file in files
    for f in files:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from torch import distributed` too
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            assert not any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names), (
                f"{f.name} imports {names}")


def test_forward_shapes_and_param_count():
    m = build()
    logits = m(torch.randint(0, ARGS.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, ARGS.vocab_size)
    assert sum(p.numel() for p in m.parameters()) == count_params(ARGS)


def test_published_llama3_parameter_counts():
    assert abs(count_params(FLAVORS["llama3-8B"]) / 1e9 - 8.03) < 0.01
    assert abs(count_params(FLAVORS["llama3-70B"]) / 1e9 - 70.55) < 0.05
    assert abs(count_params(FLAVORS["llama3-405B"]) / 1e9 - 405.85) < 0.1
    assert abs(count_params(FLAVORS["llama3-1B"]) / 1e9 - 1.236) < 0.01


def test_seeded_init_is_reproducible_and_seed_dependent():
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n


def test_causal_no_future_leakage():
    m = build()
    x = torch.randint(0, ARGS.vocab_size, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % ARGS.vocab_size
    assert torch.allclose(m(x)[0, :8], m(y)[0, :8], atol=1e-6)
    assert not torch.allclose(m(x)[0, 8:], m(y)[0, 8:], atol=1e-6)


def test_sliding_window_limits_context():
    args = dataclasses.replace(ARGS, sliding_window=4, n_layers=1)
    m = build(args)
    x = torch.randint(0, args.vocab_size, (1, 16))
    y = x.clone()
    y[0, 0] = (y[0, 0] + 1) % args.vocab_size  # position 0 is outside the window of positions >= 4
    out_x, out_y = m(x)[0], m(y)[0]
    assert torch.allclose(out_x[4:], out_y[4:], atol=1e-6)
    assert not torch.allclose(out_x[:4], out_y[:4], atol=1e-6)
    # A window at least as long as the sequence is plain causal attention.
    full = build(dataclasses.replace(args, sliding_window=0))
    wide = build(dataclasses.replace(args, sliding_window=16))
    assert torch.allclose(full(x), wide(x), atol=1e-6)


def test_parallel_block_and_gqa_train():
    args = dataclasses.replace(ARGS, parallel_block=True, n_heads=4, n_kv_heads=1)
    m = build(args)
    assert m.layers["0"].ffn_norm is None
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, args.vocab_size, (4, 16))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_tied_embeddings_share_storage():
    m = build()
    assert m.output.weight is m.tok_embeddings.weight
    untied = build(dataclasses.replace(ARGS, tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_pipeline_stage_is_model_minus_layers():
    m = build()
    del m.layers["1"]
    m.norm = None
    m.output = None
    h = m(torch.randint(0, ARGS.vocab_size, (1, 8)))
    assert h.shape == (1, 8, ARGS.dim)


def test_flops_per_token_formula():
    a = FLAVORS["llama3-8B"]
    n = count_params(a, include_embedding=False)
    assert flops_per_token(a, 8192) == 6 * n + 12 * a.n_layers * a.dim * 8192
    win = dataclasses.replace(a, sliding_window=1024)
    assert flops_per_token(win, 8192) == 6 * n + 12 * a.n_layers * a.dim * 1024


def test_bad_shapes_are_rejected():
    with pytest.raises(ModelShapeError, match="divisible by model.n_heads"):
        Transformer(dataclasses.replace(ARGS, n_heads=3))


def test_packed_projections_train_bit_for_bit_like_the_concatenation():
    """The fused q/k/v and gate/up projections read their back-to-back weights in place, and their
    hand-written backward passes (RoPE on q and k, SwiGLU) write the pieces' gradients into one tensor:
    loss, gradients and AdamW updates are the bits of autograd's own graph of the concatenating forward
    (``torch.cat`` of the weights every call, the output split, RoPE and ``silu(gate) * up``)."""
    import copy

    import torch.nn.functional as F

    from stalwart.models import fused

    packed = build()
    attention = packed.layers["0"].attention
    assert fused.back_to_back([attention.wq.weight, attention.wk.weight, attention.wv.weight]) is not None
    plain = copy.deepcopy(packed)
    for block in plain.layers.values():  # each weight its own storage again: the concatenating path
        for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1,
                    block.feed_forward.w3):
            lin.weight.data = lin.weight.detach().clone()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, packed)]
    for _ in range(2):
        losses = []
        for model, mode in ((plain, fused.plain_autograd), (packed, contextlib.nullcontext)):
            with mode():
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            losses.append(loss)
        assert torch.equal(*losses)
        for (name, a), b in zip(plain.named_parameters(), packed.parameters()):
            assert torch.equal(a.grad, b.grad), name
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for a, b in zip(plain.parameters(), packed.parameters()):
        assert torch.equal(a, b)
    assert fused.back_to_back([attention.wq.weight, attention.wk.weight, attention.wv.weight]) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hand_written_backward_passes_equal_autograds_bit_for_bit(dtype):
    """RotaryQKV and SwiGLU against autograd's graph of the same expressions, gradient by gradient, in
    fp32 and bf16 (RoPE computes in fp32 either way), with grouped-query heads and a non-contiguous
    output gradient (as attention's backward hands it)."""
    from stalwart.models import fused

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 24, generator=gen).to(dtype)
    lin = [torch.nn.Linear(24, n, bias=False).to(dtype) for n in (32, 16, 16, 40, 40)]
    rope = torch.randn(5, 4, 2, generator=gen)
    grads = {}
    for name, mode in (("plain", fused.plain_autograd), ("hand", contextlib.nullcontext)):
        xx = x.clone().requires_grad_()
        with mode():
            q, k, v = fused.project_qkv(xx, tuple(lin[:3]), rope, 8)
            h = fused.swiglu(xx, lin[3], lin[4])
        out = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        assert out[0].shape == (2, 5, 4, 8) and out[1].shape == (2, 5, 2, 8)
        g = torch.randn(2, 5, 4 * 8 + 2 * 2 * 8 + 40, generator=torch.Generator().manual_seed(2)).to(dtype)
        torch.autograd.backward([*out, h], [g[..., :32].unflatten(-1, (4, 8)).transpose(1, 2).contiguous().transpose(1, 2),
                                            g[..., 32:48].unflatten(-1, (2, 8)), g[..., 48:64].unflatten(-1, (2, 8)),
                                            g[..., 64:]])
        grads[name] = [xx.grad] + [m.weight.grad for m in lin]
        for m in lin:
            m.weight.grad = None
    for a, b in zip(grads["plain"], grads["hand"]):
        assert a.dtype == dtype and torch.equal(a, b)
