"""`stalwart rl`: reinforcement-learning post-training.

`stalwart rl sandbox ...` is the older name of `stalwart sandbox run|serve` (``cli/sandbox.py``).
"""

from __future__ import annotations

from stalwart.cli.extras import require
from stalwart.config import ConfigError, help_text, load
from stalwart.config.loading import find_config, split_args
from stalwart.config.rl import RLConfig

USAGE = """usage: stalwart rl --config FILE|NAME [--device auto|cpu|cuda] [--section.key VALUE ...]
       stalwart rl sandbox --program FILE --tests FILE [--sandbox.key VALUE ...]
       stalwart rl sandbox --serve [--service.port N] [--service.key VALUE ...] [--sandbox.key VALUE ...]

`stalwart rl --config rl_code` fine-tunes a small policy on a few examples of a verifiable code task, then
trains it with GRPO on one controller driving generator, trainer and reward-worker actor meshes; it writes
a run directory (metrics.jsonl with reward_mean per step, summary.json with final_reward_mean on held-out
problem instances). It needs Monarch, from the 'controller' extra (`make train` does not install it).

`stalwart rl sandbox` is `stalwart sandbox run` under its older name, and `stalwart rl sandbox --serve` is
`stalwart sandbox serve` (`stalwart sandbox --help`: the sandbox and its service are a package of their
own, which RL's reward workers use)."""


def main(argv: list[str]) -> int:
    if argv and argv[0] == "sandbox":
        from stalwart.cli.sandbox import alias_main

        return alias_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nOptions (--section.key VALUE):\n" + help_text(RLConfig))
        return 0
    if not argv[0].startswith("-"):
        raise ConfigError(f"unknown rl command '{argv[0]}'. {USAGE.splitlines()[0]}")
    found, overrides = split_args(argv, {"--config": True, "--device": True})
    if "--device" in found:  # the short form every model-running command takes; the setting is workers.device
        overrides = [*overrides, "--workers.device", str(found["--device"])]
    config = found.get("--config")
    cfg = load(RLConfig, find_config(config) if isinstance(config, str) else None, overrides)
    require("monarch", "RL post-training (one controller driving actor meshes)")
    from stalwart.rl.driver import run_rl_job

    return run_rl_job(cfg)
