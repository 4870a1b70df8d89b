"""Every `stalwart` command the README shows works, in order, through the real CLI.

Each README command is run in a cheap form: a tiny run stands in for `runs/default` (what `make
train` leaves), commands that would run for minutes or serve until stopped show their `--help`, and
the two that need an optional extra run in the environment `make train` builds (the extra's modules
hidden), where they must say what to install in one line and exit 2. A README command this file
does not know fails the test, so a new one gets its cheap form here.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_RUN, cli_env

pytestmark = pytest.mark.e2e

RUN, HELP, WITHOUT_EXTRAS = "run", "help", "without extras"
# (README command prefix, how it runs here); the first prefix that matches a command wins.
FORMS: list[tuple[str, str]] = [
    ("train --config debug --run.dir", HELP),  # multi-process layouts: minutes; parity tests cover them
    ("train --config debug --model.flavor", HELP),
    ("train --config debug", RUN),  # stands in for `make train`: the run the commands below read
    ("train --config default", RUN),
    ("train --help", RUN),
    ("generate", RUN),
    ("bench throughput", HELP),
    ("dashboard", HELP),  # serves until stopped
    ("report", RUN),
    ("diagnose", RUN),
    ("doctor", HELP),
    ("export", RUN),
    ("goodput", RUN),
    ("simulate", RUN),
    ("plan", RUN),
    ("bench collectives", HELP),
    ("serve --plan", RUN),
    ("serve", HELP),  # serves until stopped; tests/test_serve_e2e.py serves
    ("bench inference", WITHOUT_EXTRAS),
    ("rl sandbox", RUN),
    ("rl --config", WITHOUT_EXTRAS),
    ("bench sandbox", HELP),
    ("chaos", HELP),  # a clean run and a run under faults: minutes; tests/test_chaos_drill_e2e.py runs it
]
# The module each WITHOUT_EXTRAS command needs, and the extra that installs it.
EXTRA = {"bench inference": ("transformers", "test"), "rl --config": ("monarch", "controller")}

HIDE = """import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Absent())
"""


def readme_commands() -> list[list[str]]:
    """The arguments of every `.venv/bin/stalwart ...` line in the README's code blocks, in order."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == [".venv/bin/stalwart"]:
                out.append(words[1:])
    return out


def _form(command: str) -> tuple[str, str]:
    for prefix, how in FORMS:
        if command.startswith(prefix):
            return prefix, how
    raise AssertionError(f"README command `stalwart {command}` has no cheap form in {__file__}")


def _stalwart(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stalwart", *args], capture_output=True, text=True,
                          env=env or cli_env(), cwd=REPO, timeout=timeout)


def _args(command: list[str], tmp: Path, how: str = RUN) -> list[str]:
    """The README command with its run directories and outputs moved under ``tmp``."""
    if how == HELP and "--" in command:  # the words after `--` are another command's (chaos: train's)
        command = command[:command.index("--")]
    words = []
    for w in command:
        for name in ("runs/default", "runs/try", "hf/"):
            if w == name:
                w = str(tmp / name.strip("/").replace("/", "-"))
        words.append(w)
    if words[0] == "train" and "--help" not in words and how == RUN:
        words += [*TINY_RUN, "--training.steps", "2", "--launch.nproc_per_node", "1"]
        if "--run.dir" not in words:
            words += ["--run.dir", str(tmp / "runs-default")]
        else:  # later overrides win: keep the README's run directory last
            i = words.index("--run.dir")
            words += words[i:i + 2]
    if words[:2] == ["rl", "sandbox"]:
        (tmp / "p.py").write_text("print(int(input()) * 2)\n")
        (tmp / "t.json").write_text('[{"input": "3", "output": "6"}, {"input": "5", "output": "10"}]')
        words = ["rl", "sandbox", "--program", str(tmp / "p.py"), "--tests", str(tmp / "t.json")]
    if words[0] == "report":
        words += ["--out", str(tmp / "report")]
    return words


def test_every_readme_command_works_in_order(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 20 and commands[0][:3] == ["train", "--config", "debug"]
    for words in commands:
        command = " ".join(words)
        prefix, how = _form(command)
        if how == HELP:
            proc = _stalwart([*_args(words, tmp_path, HELP), "--help"])
            assert proc.returncode == 0 and "usage" in proc.stdout.lower(), (command, proc.stderr[-2000:])
        elif how == WITHOUT_EXTRAS:
            module, extra = EXTRA[prefix]
            hide = tmp_path / f"without-{module}"
            hide.mkdir()
            (hide / "sitecustomize.py").write_text(HIDE.format(absent={module}))
            env = {**cli_env(), "PYTHONPATH": str(hide)}
            proc = _stalwart(words, env=env)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, (command, proc.stderr[-2000:])
            assert f"from the '{extra}' extra: " in lines[0] and f"[{extra}]" in lines[0], lines[0]
        elif command.startswith("rl sandbox") and not shutil.which("bwrap"):
            continue  # the sandbox needs bubblewrap; tests/test_sandbox_e2e.py says so too
        else:
            proc = _stalwart(_args(words, tmp_path))
            assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
            if prefix == "diagnose":  # a healthy run: no dumps, and says so
                assert proc.stdout.startswith("nothing wrong: no flight-recorder dumps"), proc.stdout
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "report" / "trace.json").is_file()
    assert (tmp_path / "runs-default" / "tokenizer.json").is_file()
