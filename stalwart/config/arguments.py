"""Command lines of the tools that take flags rather than a config tree (argparse), held to the same rule
as the config: a bad flag is one line naming it, exit status 2, no usage block to scroll past."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line: ``<prog>: error: <what> (see <prog> --help)``."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)
