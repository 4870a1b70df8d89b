"""Commands that need an optional extra (pyproject.toml's ``[project.optional-dependencies]``) say so in
one line, before anything imports the missing package.

`make train` builds an environment without extras; `make test` adds ``test`` and ``controller``. A
command that needs one of them checks here first, so a new user reads what to install (exit 2), not
a ``ModuleNotFoundError`` traceback from deep inside the command.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from stalwart.errors import UserError

# module -> (what people call it, the extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("Hugging Face transformers", "test"),
    "monarch": ("Monarch (torchmonarch)", "controller"),
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (Monarch reads its settings on import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_command(extra: str) -> str:
    """The command that adds ``extra`` to the environment this process runs in: from the checkout it
    runs from (editable, as `make` installs it), else from the package index."""
    python = sys.executable
    if not os.path.relpath(python).startswith(".."):
        python = os.path.relpath(python)
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        where = "." if root == Path.cwd().resolve() else str(root)
        return f"{python} -m pip install -e '{where}[{extra}]'"
    return f"{python} -m pip install 'stalwart[{extra}]'"


def require(module: str, what: str) -> None:
    """Refuse ``what`` (e.g. "the inference benchmark"; the CLI prefixes the command's name) in one
    line when ``module``, which an extra provides, is not installed."""
    if installed(module):
        return
    name, extra = EXTRAS[module]
    raise UserError(f"{what} needs {name}, from the '{extra}' extra: {install_command(extra)}")
