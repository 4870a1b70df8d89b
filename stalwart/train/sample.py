"""The end-of-training sample: gather the full weights onto rank 0 and sample there from a plain
single-device model through the inference engine (``infer/complete.py``, what `stalwart generate` runs),
so generation issues no collectives whatever the layout."""

from __future__ import annotations

from stalwart.infer.complete import complete
from stalwart.models.llama import Transformer, count_params
from stalwart.train.init import canonical_name


def sample_from_sharded(cfg, core, tokenizer, eos: int, seed: int, is_main: bool) -> str | None:
    """``cfg`` is the ``sample`` section. Collective (every rank calls it); the text on rank 0."""
    if not cfg.prompt or not cfg.max_new_tokens or core.dims.pp > 1:
        return None  # a pipeline rank holds only its stages: use `stalwart generate` on the checkpoint
    args = core.spec.model_args
    if count_params(args) > 2e9:
        return None  # too large to gather on one host for a quick sample
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(core.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    plain = Transformer(args)
    plain.load_state_dict({canonical_name(k): v for k, v in full.items()})
    prompt = tokenizer.encode(cfg.prompt, add_special_tokens=False).ids
    done = complete(plain, prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, seed=seed, eos_id=eos)
    return cfg.prompt + tokenizer.decode(done.tokens)
