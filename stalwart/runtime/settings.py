"""What a command line checks before anything imports torch: the device names a ``device`` setting takes,
and whether a launcher (torchrun, or Stalwart's elastic agent) started this process.

Nothing here imports torch, so a command refuses a bad flag in a fraction of a second
(``tests/test_cli_startup.py``); ``stalwart.runtime.device`` and ``stalwart.runtime.group`` re-export them.
"""

from __future__ import annotations

import os

DEVICES = ("auto", "cpu", "cuda")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
