"""The reward sandbox, for real: bubblewrap + rlimits. Hostile programs get reward 0 and leave the
host unharmed; every task family's reference program passes its hidden tests; `stalwart rl sandbox`
keeps its one-JSON-line contract."""

import json
import os
import shutil
import socket
import time

import pytest
from conftest import run_cli

from stalwart.config.rl import SandboxConfig
from stalwart.rl.sandbox import Case, Sandbox, _user_processes
from stalwart.rl.tasks import FAMILIES, Instance

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (apt-get install bubblewrap)")]

LIMITS = SandboxConfig(wall_seconds=2.0, cpu_seconds=1, memory_mb=128)
ADD = [Case("1 2\n", "3"), Case("20 22\n", "42")]


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS)


def test_every_family_reference_passes_and_a_wrong_program_fails(sandbox):
    for fam in FAMILIES:
        inst = Instance(fam.name, fam.params[-1])
        verdict = sandbox.score(inst.solution, inst.cases(2, seed=3))
        assert verdict.reward == 1.0, (inst.key, verdict)
    assert sandbox.score("print(0)", ADD).reward == 0.0
    unparsable = sandbox.score("print(int(input()", ADD)
    assert unparsable.reward == 0.0 and unparsable.reason.startswith("syntax error: '(' was never closed")


def test_hostile_programs_get_reward_zero_and_leave_the_host_unharmed(sandbox, tmp_path):
    secret = tmp_path / "run" / "metrics.jsonl"
    secret.parent.mkdir()
    secret.write_text("secret")
    outside = tmp_path / "escape.txt"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.1)
        port = server.getsockname()[1]
        before = _user_processes(sandbox.uid)
        hostile = {
            "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "memory bomb": "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))",
            "infinite loop": "while True:\n    pass",
            "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint(3)",
            "write outside": f"open({str(outside)!r}, 'w').write('x')\nopen('/usr/x', 'w').write('x')\nprint(3)",
            "read the run directory": f"print(open({str(secret)!r}).read())",
            "kill its parent": f"import os, signal\nos.kill(os.getppid(), 9)\nos.kill({os.getpid()}, 9)\nprint(3)",
            "endless output": "import sys\nwhile True:\n    sys.stdout.write('3' * 65536)",
        }
        for name, program in hostile.items():
            verdict = sandbox.score(program, ADD)
            assert verdict.reward == 0.0 and verdict.passed == 0, (name, verdict)
            with pytest.raises(socket.timeout):
                server.accept()  # nothing reached the host's loopback
        assert not outside.exists() and not os.path.exists("/usr/x")
        assert secret.read_text() == "secret"
        deadline = time.monotonic() + 10  # killed sandboxes take a moment to be reaped
        while _user_processes(sandbox.uid) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _user_processes(sandbox.uid) <= before  # no process of the sandbox user survived


def test_the_process_limit_binds(sandbox):
    forks = ("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(1)\n        os._exit(0)\n"
             "    n += 1\nprint(n)")
    run = Sandbox(SandboxConfig(wall_seconds=20, processes=LIMITS.processes)).run(forks, "")
    assert run.returncode == 0 and 0 < int(run.stdout) < LIMITS.processes, run


def test_cli_prints_one_json_line_and_refuses_bad_tests_by_name(tmp_path):
    program = tmp_path / "add.py"
    program.write_text("a, b = map(int, input().split())\nprint(a + b)\n")
    tests = tmp_path / "tests.json"
    tests.write_text(json.dumps([{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "5"}]))
    out = run_cli("rl", "sandbox", "--program", str(program), "--tests", str(tests)).stdout.strip()
    assert json.loads(out) == {"reward": 0.5, "passed": 1, "total": 2, "reason": "case 1: wrong answer"}
    tests.write_text(json.dumps([{"input": "1 2"}]))
    bad = run_cli("rl", "sandbox", "--program", str(program), "--tests", str(tests), check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (f'stalwart rl: error: --tests {tests}: case 0 must be an object with string '
                                  'fields "input" and "output"')
    slow = run_cli("rl", "sandbox", "--program", str(program), "--tests", str(tests), "--sandbox.wall_second", "1",
                   check=False)
    assert slow.returncode == 2 and "did you mean 'sandbox.wall_seconds'" in slow.stderr
