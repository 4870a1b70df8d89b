"""`stalwart generate --run runs/X --prompt "def " --max-new-tokens 100`: sample from a run's checkpoint
through the inference engine (KV-cached: one forward over the prompt, then one token a step)."""

from __future__ import annotations

import sys
from pathlib import Path

from stalwart.checkpoint.run_checkpoint import load_run_model, run_paths
from stalwart.config.arguments import ArgumentParser, at_least
from stalwart.runtime.settings import DEVICES


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart generate", description=__doc__)
    p.add_argument("--run", required=True, help="run directory (runs/<name>)")
    p.add_argument("--checkpoint", default=None, help="a specific checkpoint directory (default: newest complete)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=at_least(0), default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; at most 2 (the server's range)")
    p.add_argument("--top-k", type=at_least(0), default=40, help="0 = no top-k filtering")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where the model runs (auto = cuda if available); the same seed draws the same tokens "
                        "anywhere up to the device's arithmetic, since sampling runs on the host")
    a = p.parse_args(argv)
    if not 0 <= a.temperature <= 2:  # nan fails the comparison
        p.error(f"--temperature must be a number in [0, 2] (got {a.temperature})")
    try:
        a.prompt.encode("utf-8")  # bytes that are not UTF-8 reach here as lone surrogates
    except UnicodeEncodeError:
        p.error("--prompt is not valid UTF-8 text")
    if not 0 <= a.seed < 2**63:
        p.error(f"--seed must be within [0, 2^63) (got {a.seed})")
    run_paths(Path(a.run))  # not a run directory: one line, before torch loads
    import torch

    from stalwart.data.tokenizer import eos_id
    from stalwart.infer.complete import complete
    from stalwart.runtime.device import resolve_device

    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = resolve_device(a.device)  # a device this machine lacks: one line, before reading anything
    model, tok, cfg, path = load_run_model(Path(a.run), a.checkpoint)
    model.to(device)
    prompt_ids = tok.encode(a.prompt, add_special_tokens=False).ids
    done = complete(model, prompt_ids, a.max_new_tokens, a.temperature, a.top_k, seed=a.seed, eos_id=eos_id(tok))
    print(f"# {path}", file=sys.stderr)
    context = model.args.max_seq_len
    if done.capped:
        print(f"# {len(done.tokens)} new tokens at most: the model's context holds {context} tokens",
              file=sys.stderr)
    if len(done.prompt) < len(prompt_ids):
        print(f"# the prompt's first {len(prompt_ids) - len(done.prompt)} tokens were left out: the model's context "
              f"holds {context} tokens", file=sys.stderr)
    print(a.prompt + tok.decode(done.tokens))
    return 0
