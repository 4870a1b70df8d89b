"""The `stalwart serve` command line: the weight source, the CLI-contract flags, and dotted overrides."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.config import ConfigError, help_text, load
from stalwart.config.loading import split_args
from stalwart.config.serve import ServeConfig

if TYPE_CHECKING:
    from stalwart.infer.load import Source

USAGE = """usage: stalwart serve (--run RUN_DIR [--checkpoint DIR] | --hf DIR) [--host 127.0.0.1] [--port P]
                      [--tp N] [--pp N] [--replicas N | --prefill-replicas P --decode-replicas D]
                      [--routing cache-aware|least-load|round-robin] [--device auto|cpu|cuda] [--config FILE]
                      [--dtype float32|bfloat16] [--quantize none|int8]
                      [--section.key VALUE ...]
       stalwart serve --plan [--model.flavor F] [--hosts.preset P] [--target.kind latency|throughput] ...

Serves a run's newest checkpoint (any training layout) or an exported Hugging Face directory over an
OpenAI-compatible API: POST /v1/completions and /v1/chat/completions (stream: true for server-sent
events), GET /v1/models, /health and Prometheus /metrics, and POST /v1/weights {"source": PATH} to
swap weights without a restart. Listens on 127.0.0.1 unless --host says otherwise.
`stalwart serve --plan --help` lists the placement planner's options."""

# CLI-contract flags -> config keys
ALIASES = {"--host": "server.host", "--port": "server.port", "--tp": "layout.tp", "--pp": "layout.pp",
           "--replicas": "layout.replicas", "--device": "engine.device", "--prefill-replicas": "layout.prefill_replicas",
           "--decode-replicas": "layout.decode_replicas", "--routing": "layout.routing",
           "--dtype": "engine.dtype", "--quantize": "engine.quantize"}
# --port-file and --weights-file are internal: `stalwart serve` gives them to the replicas it starts.
PATH_FLAGS = ("--run", "--hf", "--checkpoint", "--config", "--port-file", "--weights-file")


def usage() -> str:
    return USAGE + "\n\nConfiguration (TOML [section] key = value, or --section.key VALUE):\n" + help_text(ServeConfig)


def device_setting(argv: list[str]) -> str:
    """How the user named the device, for a one-line error: the flag if given, else the config key."""
    return "--device" if any(a == "--device" or a.startswith("--device=") for a in argv) else "engine.device"


def parse(argv: list[str]) -> tuple[ServeConfig, Source, Path | None, Path | None]:
    """The config, the weight source, the port file (written once serving) and the record of the weights
    applied (serve/applied.py)."""
    found, overrides = split_args(argv, {name: True for name in (*PATH_FLAGS, *ALIASES)})
    flags = {k: v for k, v in found.items() if k in PATH_FLAGS}
    for alias, key in ALIASES.items():
        if alias in found:
            overrides += [f"--{key}", found[alias]]
    cfg = load(ServeConfig, flags.get("--config"), overrides)
    if ("--run" in flags) == ("--hf" in flags):
        raise ConfigError("give exactly one of --run RUN_DIR or --hf DIR")
    if "--hf" in flags and "--checkpoint" in flags:
        raise ConfigError("--checkpoint applies to --run only")
    for flag in ("--run", "--hf"):
        if flag in flags and not Path(flags[flag]).is_dir():
            raise ConfigError(f"{flag}: {flags[flag]} is not a directory")
    from stalwart.infer.load import Source  # imports torch: only once the command line is valid

    source = (Source(run=Path(flags["--run"]), checkpoint=flags.get("--checkpoint")) if "--run" in flags
              else Source(hf=Path(flags["--hf"])))
    port_file = Path(flags["--port-file"]) if "--port-file" in flags else None
    weights_file = Path(flags["--weights-file"]) if "--weights-file" in flags else None
    return cfg, source, port_file, weights_file
