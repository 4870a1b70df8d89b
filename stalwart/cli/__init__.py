"""The `stalwart` command: a thin dispatcher to one module per subcommand.

Each subcommand lives in its own module exposing ``main(argv: list[str]) -> int`` and is imported
only when invoked, so `stalwart simulate` never pays for importing torch.
"""

from __future__ import annotations

import importlib
import sys

from stalwart.errors import UserError

# name -> (module, one-line summary). Keep sorted by how often people type them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("stalwart.cli.train", "train a model (launches workers itself, runs under torchrun, or --controller)"),
    "rl": ("stalwart.cli.rl", "RL post-training (GRPO on one controller)"),
    "sandbox": ("stalwart.cli.sandbox", "run untrusted programs against tests, isolated (run); the sandbox service (serve)"),
    "generate": ("stalwart.cli.generate", "sample text from a run's newest checkpoint"),
    "serve": ("stalwart.cli.serve", "serve a model over an OpenAI-compatible API (batched, KV-cached, --tp/--replicas)"),
    "export": ("stalwart.cli.export", "export a run's checkpoint as a Hugging Face Llama model (--format hf)"),
    "index": ("stalwart.cli.index", "a retrieval index: build, add (crash-safe), delete, query (one tenant), stats"),
    "data": ("stalwart.cli.data", "tokenize a corpus once into token shards (prepare); describe them (inspect)"),
    "bench": ("stalwart.cli.bench", "benchmarks of every subsystem against peers and the hardware (bench --help lists them)"),
    "simulate": ("stalwart.cli.simulate", "simulate failures and recovery of a large job (ETTR)"),
    "plan": ("stalwart.cli.plan", "rank parallel layouts for a model on a cluster (MFU, memory)"),
    "dashboard": ("stalwart.cli.dashboard", "serve a live web dashboard of a run directory (localhost)"),
    "report": ("stalwart.cli.report", "write a static HTML report, PNG plots and (--trace) a Perfetto trace"),
    "diagnose": ("stalwart.cli.diagnose", "analyse flight-recorder dumps: which rank hung, and where"),
    "compare": ("stalwart.cli.compare", "the first step (and tensor) where two runs' training states differ"),
    "chaos": ("stalwart.cli.chaos", "a clean run and the same run under faults sent from outside; compare them"),
    "goodput": ("stalwart.cli.goodput", "split a run's wall time: productive, lost, detection, restart (ETTR)"),
    "doctor": ("stalwart.cli.doctor", "per-rank compute/communication health check; flags outlier ranks"),
}

USAGE = "usage: stalwart <command> [options]   (stalwart <command> --help for details)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        print("\ncommands:")
        for name, (_, summary) in COMMANDS.items():
            print(f"  {name:<10} {summary}")
        return 0
    if argv[0] in ("-V", "--version"):
        from stalwart import __version__

        print(f"stalwart {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        guess = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        print(f"stalwart: unknown command '{name}'{hint}. {USAGE}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except UserError as e:
        print(f"stalwart {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stalwart {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`stalwart plan | head`): stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
