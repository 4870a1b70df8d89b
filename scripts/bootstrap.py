#!/usr/bin/env python3
"""Create the project's virtual environment with the right torch, then install Stalwart into it.

Why a script: the torch requirement must never be resolved by pip on its own (an unpinned torch
pulls a multi-gigabyte CUDA build). Where a torch >= 2.11 is already importable by the Python that
runs this (a GPU machine), the venv sees it through --system-site-packages and it is reused;
otherwise the pinned CPU build torch==2.13.0 is installed first.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path

PINNED_TORCH = "torch==2.13.0"
MIN_TORCH = (2, 11)


def importable_torch() -> str | None:
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    version = out.stdout.strip()
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    return version if (major, minor) >= MIN_TORCH else None


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--venv", default=".venv")
    parser.add_argument("--extras", default="test")
    args = parser.parse_args()
    if sys.version_info < (3, 11):
        print(f"error: Stalwart needs Python 3.11 or newer (this is {sys.version.split()[0]})", file=sys.stderr)
        return 1
    root = Path(__file__).resolve().parent.parent
    env_dir = Path(args.venv)
    py = env_dir / "bin" / "python"
    reuse = importable_torch()
    if not py.exists():
        print(f"creating {env_dir} ({'reusing torch ' + reuse if reuse else 'will install ' + PINNED_TORCH})")
        venv.EnvBuilder(with_pip=True, system_site_packages=bool(reuse)).create(env_dir)
    has_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode == 0
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if not has_torch:
        run(pip + [PINNED_TORCH])
    target = f"{root}[{args.extras}]" if args.extras else str(root)
    run(pip + ["-e", target])
    return 0


if __name__ == "__main__":
    sys.exit(main())
