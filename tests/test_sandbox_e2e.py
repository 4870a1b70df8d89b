"""The reward sandbox, for real: bubblewrap + rlimits. Hostile programs get reward 0 and leave the
host unharmed; a program cannot change another case's result or forge the runner's report; every
task family's reference program passes its hidden tests; `stalwart rl sandbox` keeps its
one-JSON-line contract. The runner-report parser is checked as pure logic.

The scoring tests run twice: on a local `Sandbox`, and through `stalwart rl sandbox --serve` (one
service process for the module, same limits) with the reward workers' `SandboxClient`: the same
assertions hold both ways. The service's own contract (health, metrics, refusals, back-pressure,
fail-over between services) is checked on that same process."""

import json
import os
import pickle
import shutil
import socket
import subprocess
import threading
import time

import httpx
import pytest
from conftest import REPO, cli_env, popen_cli, run_cli

from stalwart.config.sandbox import SandboxConfig
from stalwart.sandbox.local import (
    ENV,
    KEYRING_FILTER,
    NOBODY,
    Case,
    Run,
    Sandbox,
    SandboxError,
    Verdict,
    _user_processes,
    keyring_filter,
    parse_reports,
)
from stalwart.sandbox.client import SandboxClient
from stalwart.rl.tasks import FAMILIES, Instance

e2e = [pytest.mark.e2e,
       pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (apt-get install bubblewrap)")]

LIMITS = SandboxConfig(wall_seconds=2.0, cpu_seconds=1, memory_mb=128)
ADD = [Case("1 2\n", "3"), Case("20 22\n", "42")]


UID = NOBODY if os.geteuid() == 0 else os.geteuid()  # the sandbox user, local or in the service
SERVICE = ["--service.port", "0", "--service.concurrency", "2", "--service.queue", "2", "--sandbox.wall_seconds",
           str(LIMITS.wall_seconds), "--sandbox.cpu_seconds", str(LIMITS.cpu_seconds), "--sandbox.memory_mb",
           str(LIMITS.memory_mb)]


@pytest.fixture(scope="module")
def sandbox():
    if not shutil.which("bwrap"):
        pytest.skip("needs bubblewrap (apt-get install bubblewrap)")
    return Sandbox(LIMITS)


@pytest.fixture(scope="module")
def service():
    """`stalwart rl sandbox --serve` with LIMITS, 2 sandboxes at once and 2 waiting: its address."""
    if not shutil.which("bwrap"):
        pytest.skip("needs bubblewrap (apt-get install bubblewrap)")
    proc = popen_cli("rl", "sandbox", "--serve", *SERVICE, cwd=REPO,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("stalwart rl sandbox: serving on http://127.0.0.1:"), line + proc.stdout.read()
        yield line.split()[5]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0 and "stopped" in proc.stdout.read()


@pytest.fixture(scope="module", params=["local", "service"])
def scorer(request):
    """A local sandbox, or the service through the client the reward workers use."""
    if request.param == "local":
        return request.getfixturevalue("sandbox")
    return SandboxClient([request.getfixturevalue("service")], retry_s=60)


@pytest.mark.e2e
def test_every_family_reference_passes_and_a_wrong_program_fails(scorer):
    sandbox = scorer
    for fam in FAMILIES:
        inst = Instance(fam.name, fam.params[-1])
        verdict = sandbox.score(inst.solution, inst.cases(2, seed=3))
        assert verdict.reward == 1.0, (inst.key, verdict)
    assert sandbox.score("print(0)", ADD).reward == 0.0
    unparsable = sandbox.score("print(int(input()", ADD)
    assert unparsable.reward == 0.0 and unparsable.reason.startswith("syntax error: '(' was never closed")


@pytest.mark.e2e
def test_hostile_programs_get_reward_zero_and_leave_the_host_unharmed(scorer, tmp_path):
    sandbox = scorer
    secret = tmp_path / "run" / "metrics.jsonl"
    secret.parent.mkdir()
    secret.write_text("secret")
    outside = tmp_path / "escape.txt"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.1)
        port = server.getsockname()[1]
        before = _user_processes(UID)
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
        while _user_processes(UID) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _user_processes(UID) <= before  # no process of the sandbox user survived


@pytest.mark.e2e
def test_the_process_limit_binds(sandbox):
    forks = ("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(1)\n        os._exit(0)\n"
             "    n += 1\nprint(n)")
    run = sandbox.run(forks, "")
    assert run.returncode == 0 and 0 < int(run.stdout) < LIMITS.processes, run


# Every environment a program can read: its own, and that of each process whose /proc/<pid>/environ
# opens (PID 1 is the runner, non-dumpable: its environ does not open). It prints the variable names
# of its own and of PID 1's (None: unreadable), and the places where the host's secret shows.
ENVIRONMENTS = """import json, os
secret = SECRET.encode()
seen, pid1 = [], None
for pid in ['self'] + os.listdir('/proc'):
    try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
            data = f.read()
    except OSError:
        continue
    seen += [f'/proc/{pid}/environ'] if secret in data else []
    if pid == '1':
        pid1 = sorted(kv.split(b'=')[0].decode() for kv in data.split(b'\\0') if kv)
seen += ['os.environ'] if any(secret in (k + '=' + v).encode() for k, v in os.environ.items()) else []
print(json.dumps({'own': sorted(os.environ), 'pid1': pid1, 'seen': seen}))
"""


@pytest.mark.e2e
def test_no_process_in_the_sandbox_sees_the_hosts_environment(sandbox, monkeypatch):
    secret = f"hunter2-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("STALWART_TEST_SECRET_TOKEN", secret)
    run = sandbox.run(ENVIRONMENTS.replace("SECRET", repr(secret), 1), "")
    assert run.returncode == 0, run
    seen = json.loads(run.stdout)
    assert seen == {"own": sorted([*ENV, "PWD"]), "pid1": None, "seen": []}  # bubblewrap sets PWD


# Fills /tmp and /dev/shm with 1 MiB files (the file-size limit) until a write fails, and tries the
# root and /dev; frees /tmp to print what each got. A second case finds both empty again.
FILL = """import errno, json, os
got = []
for where in ('/tmp', '/dev/shm', '/', '/dev'):
    mib, error = 0, ''
    try:
        while mib < 100:
            with open(f'{where}/fill{mib}', 'wb') as f:
                f.write(bytes(1 << 20))
            mib += 1
    except OSError as e:
        error = errno.errorcode[e.errno]
    got.append([where, mib, error])
for name in os.listdir('/tmp'):
    if name.startswith('fill'):
        os.unlink('/tmp/' + name)
print(json.dumps(got))
"""


@pytest.mark.e2e
def test_files_in_tmp_and_dev_shm_hold_at_most_the_memory_limit():
    if not shutil.which("bwrap"):
        pytest.skip("needs bubblewrap (apt-get install bubblewrap)")
    cap = 32  # sandbox.memory_mb: each of /tmp and /dev/shm is a tmpfs of this size
    runs, failure = Sandbox(SandboxConfig(wall_seconds=5.0, cpu_seconds=2, memory_mb=cap)).execute(FILL, ["", ""])
    assert len(runs) == 2 and not failure, (runs, failure)
    for run in runs:
        assert run.returncode == 0, run
        (tmp, tmp_mib, tmp_error), (shm, shm_mib, shm_error), *read_only = json.loads(run.stdout)
        assert cap - 1 <= tmp_mib <= cap and tmp_error == "ENOSPC", run  # a page may hold the case's output
        assert shm_mib == cap and shm_error == "ENOSPC", run
        assert read_only == [["/", 0, "EROFS"], ["/dev", 0, "EROFS"]], run


@pytest.mark.e2e
def test_a_program_past_its_wall_clock_limit_is_a_timeout():
    if not shutil.which("bwrap"):
        pytest.skip("needs bubblewrap (apt-get install bubblewrap)")
    sandbox = Sandbox(SandboxConfig(wall_seconds=0.5, cpu_seconds=1, memory_mb=128))
    t0 = time.monotonic()
    run = sandbox.run("import os, time\nos.fork()\ntime.sleep(100)", "")
    assert run.returncode is None and run.out_of_time and run.reason == "wall-clock timeout", run
    sleeper = "import time\na, b = map(int, input().split())\nif a != 1:\n    time.sleep(100)\nprint(a + b)"
    assert sandbox.score(sleeper, ADD) == Verdict(0.5, 1, 2, "case 1: wall-clock timeout")
    assert sandbox.score("import time\ntime.sleep(100)", ADD) == Verdict(
        0.0, 0, 2, "case 0: wall-clock timeout (cases 1-1 not run)")
    assert time.monotonic() - t0 < 5  # each sandbox ended at its case's limit, not the whole run's


@pytest.mark.e2e
def test_cli_prints_one_json_line_and_refuses_bad_tests_by_name(tmp_path):
    if not shutil.which("bwrap"):
        pytest.skip("needs bubblewrap (apt-get install bubblewrap)")
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


# Case 0 leaves a process behind that tries, for longer than the whole run, to write a forged report
# and a passing answer through every descriptor in /proc, and to leave files for later cases. Case 1
# prints the answer only if it sees that process or those files: it must fail as a wrong answer.
BACKGROUND = """import os, time
a, b = map(int, input().split())
if a == 1:
    if os.fork() == 0:
        null = os.open('/dev/null', os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        end = time.time() + 3
        while time.time() < end:
            for pid in os.listdir('/proc'):
                if pid.isdigit() and int(pid) != os.getpid():
                    for fd in range(8):
                        try:
                            with open(f'/proc/{pid}/fd/{fd}', 'w') as f:
                                f.write('case 1 exit 0 0.0 3 0\\n42\\n')
                        except OSError:
                            pass
            open('/tmp/work/left', 'w').write('42')
        os._exit(0)
    time.sleep(0.2)
    print(3)
else:
    others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]
    print(42 if others or os.listdir('/tmp/work') else 0)
"""

# Reads and writes of the runner's memory and descriptors (and bubblewrap init's) all fail; the program
# prints the answer only then.
PROC_ACCESS = """import os
ppid, got = os.getppid(), []
for path in (f'/proc/{ppid}/mem', f'/proc/{ppid}/fd/0', f'/proc/{ppid}/fd/1', f'/proc/{ppid}/environ',
             '/proc/1/mem', '/proc/1/fd/0', '/proc/1/fd/1'):
    for mode in ('rb', 'wb'):
        try:
            with open(path, mode) as f:
                f.read(1) if mode == 'rb' else f.write(b'case 0 exit 0 0.0 2 0\\n3\\n')
            got.append(path + ' ' + mode)
        except OSError:
            pass
a, b = map(int, input().split())
print(a + b if not got else got)
"""


@pytest.mark.e2e
def test_no_program_changes_another_cases_result_or_forges_the_report(scorer):
    sandbox = scorer
    t0 = time.monotonic()
    assert sandbox.score(BACKGROUND, ADD) == Verdict(0.5, 1, 2, "case 1: wrong answer")
    assert time.monotonic() - t0 < 2.5  # the process left behind was killed, not waited for
    killer = "import os\na, b = map(int, input().split())\nif a != 1:\n    os.kill(os.getppid(), 9)\nprint(a + b)"
    assert sandbox.score(killer, ADD) == Verdict(0.5, 1, 2, "case 1: sandbox runner killed by SIGKILL")
    assert sandbox.score("import os\nos.kill(os.getppid(), 9)", ADD) == Verdict(
        0.0, 0, 2, "case 0: sandbox runner killed by SIGKILL (cases 1-1 not run)")
    assert sandbox.score(PROC_ACCESS, ADD[:1]) == Verdict(1.0, 1, 1, "passed")


# Leaves all it can behind after printing the answer: a process in a session of its own, files in
# /tmp/work and /dev/shm, and a System V shared memory segment (through ctypes).
LEAVES = """import ctypes, os
a, b = map(int, input().split())
print(a + b, flush=True)
open('/tmp/work/left', 'w').write('x')
open('/dev/shm/left', 'w').write('x')
libc = ctypes.CDLL(None)
assert libc.shmget(1234, 4096, 0o1600) >= 0
if os.fork() == 0:
    os.setsid()
    import time
    time.sleep(30)
"""

# Prints the answer only if nothing of an earlier program is left: no process but itself, its program
# runner and PID 1, nothing in /tmp/work or /dev/shm, no System V IPC object; and the start time of
# PID 1 (the runner), so the test can tell the programs shared one sandbox.
FINDS = """import os
others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]
ipc = [k for k in ('shm', 'sem', 'msg') if open(f'/proc/sysvipc/{k}').read().count(chr(10)) > 1]
left = others + os.listdir('/tmp/work') + os.listdir('/dev/shm') + ipc
a, b = map(int, input().split())
print(a + b if not left else left, open('/proc/1/stat').read().split()[21])
"""


@pytest.mark.e2e
def test_programs_batched_in_one_sandbox_leave_nothing_to_each_other_and_cannot_stop_it(sandbox):
    """One sandbox runs several programs one after another (its runner is PID 1): each program finds
    nothing of the ones before, one that kills its program runner or tries PID 1 fails alone, one past
    its time fails alone, and each verdict equals the program's own sandbox's."""
    kill_all = "import os\nos.kill(1, 9)\nos.kill(-1, 9)\nprint(3)"
    sleeps = "import time\ntime.sleep(60)"
    jobs = [(LEAVES, ADD), (FINDS, ADD), (kill_all, ADD), (FINDS, ADD), (sleeps, ADD), (LEAVES, ADD),
            (FINDS, ADD)]
    t0 = time.monotonic()
    runs = sandbox.execute_many([(src, [c.input for c in cases]) for src, cases in jobs])
    assert time.monotonic() - t0 < 3 * LIMITS.wall_seconds  # a timeout costs its own allowance only
    finds = [runs[i][0] for i in (1, 3, 6)]
    assert [[r.stdout.split()[0] for r in rs] for rs in finds] == [["3", "42"]] * 3, runs
    assert len({r.stdout.split()[1] for rs in finds for r in rs}) == 1  # one runner throughout: PID 1 lived
    assert runs[2] == ([], "sandbox runner killed by SIGKILL") and runs[4][0][0].returncode is None
    answer = FINDS.replace(", open('/proc/1/stat').read().split()[21])", ")")
    jobs = [(answer if src == FINDS else src, cases) for src, cases in jobs]
    verdicts = sandbox.score_many(jobs)
    assert verdicts[2] == Verdict(0.0, 0, 2, "case 0: sandbox runner killed by SIGKILL (cases 1-1 not run)")
    assert [v.reward for v in verdicts] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert verdicts == [sandbox.score(src, cases) for src, cases in jobs]


# Tries to leave a key in the user keyring (shared by every process of the sandbox's user namespace) and
# to find one: every keyring call is refused (EPERM), so nothing passes from one program to the next.
KEYS = """import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
add_key, keyctl = {'x86_64': (248, 250), 'aarch64': (217, 219)}[platform.machine()]
errors = []
for call in ((add_key, b'user', b'left', b'secret', 6, -4), (keyctl, 10, -4, b'user', b'left', 0)):
    errors.append(ctypes.get_errno() if libc.syscall(*call) == -1 else 0)
a, b = map(int, input().split())
print(a + b if errors == [1, 1] else errors)
"""


@pytest.mark.e2e
@pytest.mark.skipif(KEYRING_FILTER is None, reason="no keyring filter for this architecture")
def test_programs_cannot_reach_the_kernel_keyring(sandbox):
    assert sandbox.score_many([(KEYS, ADD), (KEYS, ADD)]) == [Verdict(1.0, 2, 2, "passed")] * 2
    assert keyring_filter("riscv64") is None and len(keyring_filter("aarch64")) == 8 * 9


@pytest.mark.unit
def test_runner_reports_parse_strictly():
    def rec(i, kind="exit", n=0, out=b"3\n", err=b""):
        return f"case {i} {kind} {n} 0.25 {len(out)} {len(err)}\n".encode() + out + err

    two = rec(0) + rec(1, "signal", 24, b"", b"boom")
    assert parse_reports(two, 2, 100) == ([Run("3\n", 0, 0.25), Run("", -24, 0.25, "boom")], True)
    assert parse_reports(rec(0, "timeout"), 1, 100) == ([Run("3\n", None, 0.25)], True)
    assert parse_reports(b"", 2, 100) == ([], True)
    for bad in (rec(0)[:-1],                      # truncated output
                rec(0)[:10],                      # truncated header
                rec(1),                           # out of order
                rec(0) + rec(0),                  # repeated
                rec(0, "exited"),                 # unknown kind
                rec(0, n=300),                    # no such status
                rec(0, out=b"x" * 101),           # more output than the file-size limit allows
                rec(0, err=b"x" * 401),           # more stderr than the tail
                b"case 0 exit 0 nan 2 0\n3\n",   # not a time
                b"case 0 exit 0 0.1 -2 0\n",      # negative size
                b"x" * 10_000,                    # no header line at all
                rec(0) + rec(1) + rec(2)):        # more cases than were sent
        runs, ok = parse_reports(bad, 2, 100)
        assert not ok and len(runs) <= 2 and all(r == Run("3\n", 0, 0.25) for r in runs), bad


SLEEPER = "import time\ntime.sleep(1.0)\nprint(1)"


@pytest.mark.e2e
def test_the_service_reports_health_and_metrics_and_refuses_bad_requests_by_name(service):
    assert httpx.get(f"{service}/health").json() == {"status": "ok", "running": 0, "waiting": 0, "concurrency": 2,
                                                     "queue": 2}
    score = f"{service}/v1/score"
    add = {"program": "print(int(input()) + 1)", "cases": [{"input": "1", "output": "2"}]}
    assert httpx.post(score, json=add).json() == {"reward": 1.0, "passed": 1, "total": 1, "reason": "passed"}
    pickled = httpx.post(score, content=pickle.dumps(add), headers={"content-type": "application/octet-stream"})
    assert pickled.status_code == 400 and "must be JSON" in pickled.json()["error"]  # never unpickled
    bad = httpx.post(score, json={"program": "print(1)", "cases": [{"input": "1"}]})
    assert bad.status_code == 400 and bad.json()["error"] == ('cases: case 0 must be an object with string fields '
                                                             '"input" and "output"')
    surrogate = httpx.post(score, content=b'{"program": "print(1)", "cases": [{"input": "\\ud800", "output": "1"}]}')
    assert surrogate.status_code == 400 and "UTF-8" in surrogate.json()["error"]
    many = httpx.post(score, json={"program": "print(1)", "cases": [{"input": "", "output": "1"}] * 65})
    assert many.status_code == 413 and "service.max_cases" in many.json()["error"]
    huge = httpx.post(score, json={"program": "x" * (5 << 20), "cases": add["cases"]})
    assert huge.status_code == 413 and "service.max_request_mb" in huge.json()["error"]
    metrics = httpx.get(f"{service}/metrics").text
    for line in ('stalwart_sandbox_requests_total{outcome="bad_request"} 3.0',
                 'stalwart_sandbox_requests_total{outcome="too_large"} 2.0', "stalwart_sandbox_running 0.0",
                 "stalwart_sandbox_concurrency 2.0", "stalwart_sandbox_program_seconds_count"):
        assert line in metrics, line


@pytest.mark.e2e
def test_a_batch_through_the_service_runs_in_one_sandbox_with_the_local_verdicts(service, sandbox):
    """The client's score_many sends one request per 32 programs; the service runs each batch in one
    sandbox and answers each program's local verdict; a batch too long or with a malformed program is
    refused by name."""
    instances = [Instance(fam.name, fam.params[0]) for fam in FAMILIES[:5]]
    jobs = [(inst.solution, inst.cases(2, seed=i)) for i, inst in enumerate(instances)]
    jobs += [("print(0)", ADD), ("print(int(input()", ADD), ("import os\nos.kill(os.getppid(), 9)", ADD)]
    client = SandboxClient([service], retry_s=60)
    got = client.score_many(jobs)
    assert got == sandbox.score_many(jobs) == [sandbox.score(src, cases) for src, cases in jobs]
    assert [v.reward for v in got] == [1.0] * 5 + [0.0] * 3
    score = f"{service}/v1/score"
    one = {"program": "print(1)", "cases": [{"input": "", "output": "1"}]}
    assert httpx.post(score, json={"programs": [one] * 2}).json() == {"verdicts": [
        {"reward": 1.0, "passed": 1, "total": 1, "reason": "passed"}] * 2}
    many = httpx.post(score, json={"programs": [one] * 33})
    assert many.status_code == 413 and "service.max_programs" in many.json()["error"]
    bad = httpx.post(score, json={"programs": [one, {"program": 1, "cases": []}]})
    assert bad.status_code == 400 and bad.json()["error"].startswith("programs[1]: ")


@pytest.mark.e2e
def test_a_full_service_answers_429_and_the_client_waits_its_turn(service):
    """Six programs of 1 s at once on 2 sandboxes with 2 places to wait: two are refused at once with
    Retry-After; through the client every one is scored, the refused ones after waiting."""
    sleeper = {"program": SLEEPER, "cases": [{"input": "", "output": "1"}]}
    answers: list = []
    threads = [threading.Thread(target=lambda: answers.append(httpx.post(f"{service}/v1/score", json=sleeper,
                                                                         timeout=30))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 200, 200, 200, 429, 429], codes
    assert all(a.headers["retry-after"] == "1" for a in answers if a.status_code == 429)
    assert 'stalwart_sandbox_requests_total{outcome="busy"} 2.0' in httpx.get(f"{service}/metrics").text
    client = SandboxClient([service], retry_s=60)
    verdicts: list = []
    threads = [threading.Thread(target=lambda: verdicts.append(client.score(SLEEPER, [Case("", "1")])))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert verdicts == [Verdict(1.0, 1, 1, "passed")] * 6


@pytest.mark.e2e
def test_the_client_skips_an_unreachable_service_and_names_them_all_when_none_answers(service):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = SandboxClient([closed, service], retry_s=30)
    for _ in range(3):  # whichever service each call starts at
        assert client.score("print(sum(map(int, input().split())))", ADD) == Verdict(1.0, 2, 2, "passed")
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match=rf"no sandbox service scored a program within .*{closed}: ConnectError"):
        SandboxClient([closed], retry_s=0.5).score("print(3)", ADD)
    assert time.monotonic() - t0 < 5


# Counts the bytes of a marker (given in hex, so the program's own text never holds them) in its own
# memory, every readable mapping (read in place through ctypes: a non-dumpable process cannot open its
# /proc/self/mem): what any process of a later request could read.
SCANS = """import ctypes
needle = bytes.fromhex(input().strip())
count = 0
for line in open('/proc/self/maps'):
    span, perms = line.split()[:2]
    if 'r' not in perms or line.rstrip().endswith(('[vvar]', '[vsyscall]', '[vvar_vclock]')):
        continue
    lo, hi = (int(x, 16) for x in span.split('-'))
    for at in range(lo, hi, 1 << 20):
        count += ctypes.string_at(at, min(hi - at, (1 << 20) + len(needle) - 1)).count(needle)
print(count)
"""


@pytest.mark.e2e
def test_a_warm_sandbox_serves_request_after_request_and_no_request_finds_anything_of_an_earlier_one():
    """What the programs of a reused warm sandbox share is its PID 1 and its namespaces: a program of a
    later request finds no process, file, IPC object of an earlier request, nor its input anywhere in
    its own memory (the count equals the one in a fresh sandbox), and the sandbox is not restarted."""
    fresh = Sandbox(SandboxConfig(**{**LIMITS.__dict__, "warm": 0, "reuse": 1}))
    warm = Sandbox(SandboxConfig(**{**LIMITS.__dict__, "warm": 0, "reuse": 8}))
    marker = os.urandom(12).hex().encode()
    secret = "SECRET" + marker.decode()
    try:
        alone = fresh.run(SCANS, marker.hex() + "\n")
        assert alone.returncode == 0 and int(alone.stdout) >= 1, alone  # its own needle at least
        assert warm.run("print(len(input()))", secret + "\n").stdout.strip() == str(len(secret))
        leaves = warm.run(LEAVES.replace("a, b = map(int, input().split())", "a, b = 1, 2; input()"), secret)
        assert leaves.returncode == 0 and leaves.stdout.strip() == "3", leaves
        found = warm.run(FINDS, "20 22\n")
        assert found.stdout.split()[0] == "42", found  # no process, file or IPC object left
        scanned = warm.run(SCANS, marker.hex() + "\n")
        assert scanned.stdout == alone.stdout, (scanned, alone)  # no copy of the earlier input in memory
        assert warm.pool.started == 1  # every request above ran in the one warm sandbox
        assert fresh.run("print(1)", "").stdout == "1\n" and fresh.pool.started == 2  # reuse 1: one each
    finally:
        fresh.close()
        warm.close()
