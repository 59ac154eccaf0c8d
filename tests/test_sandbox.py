"""The code-reward sandbox: scoring, limits, hostile completions that must not hurt the parent or leave traces, and
forged rewards that must score nothing.

Every test checks (through the autouse fixture) that no sandbox directory is left in the temp dir; the hostile ones
also check the status, the score and that the run returned within its wall-clock limit.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_fast import sandbox
from grpo_fast.sandbox import (
    STATUSES,
    TEMP_PREFIX,
    SandboxLimits,
    SandboxResult,
    code_reward,
    extract_code,
    isolation_layers,
    json_test_list,
    run_tests,
    sandbox_metrics,
)
from grpo_fast.sandbox import landlock
from grpo_fast.train.rewards import reward_metrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox runs on Linux only")

# Runs that end on their own (or on the memory or output limit) take well under a second; these limits are only
# there to stop a broken run, and sit far enough apart and high enough that a loaded machine (CI: 2 cores, many
# jobs) neither hits them nor lets one race the other.
ROOMY = SandboxLimits(timeout_s=10.0, cpu_time_s=20.0, memory_mb=256)
MARGIN_S = 1.5  # start-up, kill and clean-up on top of the wall-clock limit, on a busy 2-core machine
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOUBLE = "def f(x):\n    return 2 * x\n"

LANDLOCK_ABI = landlock.abi_version() if sys.platform.startswith("linux") else 0
needs_landlock = pytest.mark.skipif(
    LANDLOCK_ABI == 0, reason="this kernel offers no Landlock (Linux >= 5.13 with Landlock enabled at boot)")
# The hostile completions below run under every layer, and under Landlock (or seccomp) alone, without the audit
# hook and the namespaces, to show that the kernel refuses them whatever the Python-level layer does.
CONFIGS = {"all-layers": frozenset(), "landlock-alone": frozenset({"audit-hook", "namespaces", "seccomp"})}
SECCOMP_CONFIGS = {"all-layers": frozenset(), "seccomp-alone": frozenset({"audit-hook", "namespaces", "landlock"})}
HAS_SECCOMP = os.uname().machine in ("x86_64", "aarch64") if sys.platform.startswith("linux") else False


def _sandbox_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(TEMP_PREFIX)}


def _sandbox_processes() -> list[int]:
    """Live processes whose environment names a sandbox HOME: every sandbox child, and anything it forked.

    (The completion travels in a job file, not on the command line, so the environment is the marker to look for.)
    """
    marker = f"HOME={os.path.join(tempfile.gettempdir(), TEMP_PREFIX)}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read():
                        pids.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return pids


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed_run(code: str, tests: list[str] | str, limits: SandboxLimits = ROOMY) -> SandboxResult:
    """run_tests, checking that it returned within the wall-clock limit and left no process behind."""
    start = time.monotonic()
    result = run_tests(code, tests, limits)
    assert time.monotonic() - start < limits.timeout_s + MARGIN_S, result
    assert result.status in STATUSES
    assert _sandbox_processes() == []
    return result


@pytest.fixture(autouse=True)
def no_leftover_directories():
    before = _sandbox_dirs()
    yield
    assert _sandbox_dirs() - before == set()


# -------------------------------------------------------------------------------------------------------- scoring


def test_correct_solution_scores_one():
    result = _timed_run(DOUBLE, ["assert f(2) == 4", "assert f(-1) == -2", "assert f(0) == 0"])
    assert (result.passed, result.total, result.status, result.fraction) == (3, 3, "ok", 1.0)


def test_partially_correct_solution_scores_the_fraction_passed():
    tests = ["assert f(2) == 4", "assert f(3) == 7", "assert undefined_name(1)", "assert f(5) == 10"]
    result = _timed_run(DOUBLE, tests)
    assert (result.passed, result.total, result.status) == (2, 4, "failed")
    assert result.fraction == 0.5
    assert "test 1 failed" in result.detail and "test 2 failed" in result.detail


def test_a_string_is_one_test():
    result = _timed_run(DOUBLE, "assert f(1) == 2\nassert f(2) == 5")
    assert (result.passed, result.total, result.status) == (0, 1, "failed")


def test_syntax_error_scores_zero_with_status_error():
    result = _timed_run("def f(x) return x", ["assert f(1) == 1"])
    assert (result.passed, result.total, result.status, result.fraction) == (0, 1, "error", 0.0)
    assert "SyntaxError" in result.detail


def test_code_that_raises_scores_zero_with_status_error():
    result = _timed_run(DOUBLE + "raise ValueError('boom')", ["assert f(1) == 2"])
    assert (result.passed, result.status) == (0, "error")
    assert "ValueError: boom" in result.detail


def test_no_tests_scores_zero():
    result = _timed_run(DOUBLE, [])
    assert (result.passed, result.total, result.status, result.fraction) == (0, 0, "ok", 0.0)


def test_main_block_does_not_run_and_stdlib_helpers_work():
    code = (
        "import asyncio, tempfile, threading\nfrom collections import namedtuple\nfrom dataclasses import dataclass\n"
        "@dataclass\nclass Point:\n    x: int\nPair = namedtuple('Pair', 'a b')\n"
        "async def three():\n    return 3\n"
        "def in_a_thread():\n    box = []\n    t = threading.Thread(target=box.append, args=(1,))\n    t.start()\n"
        "    t.join()\n    return box\n"
        "def temporary_file():\n    with tempfile.NamedTemporaryFile('w+') as f:\n        f.write('x')\n"
        "        f.seek(0)\n        return f.read()\n"
        "if __name__ == '__main__':\n    input()  # stdin is /dev/null: this would raise EOFError\n"
    )
    tests = [
        "assert Point(1).x == 1 and Pair(1, 2).b == 2",
        "assert asyncio.run(three()) == 3",
        "assert in_a_thread() == [1]",
        "assert temporary_file() == 'x'",
    ]
    result = _timed_run(code, tests)
    assert result.status == "ok", result.detail


def test_environment_is_scrubbed_and_isolated(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    code = "import os, sys\nfrom os import environ\nenvironment = dict(os.environ)\n"
    tests = [
        "assert set(environment) <= {'PATH', 'HOME', 'TMPDIR', 'LANG'}, sorted(environment)",
        "assert len({environ['HOME'], environ['TMPDIR'], os.getcwd()}) == 1",
        f"assert os.path.basename(os.getcwd()).startswith({TEMP_PREFIX!r}) is True",
        "assert (sys.flags.isolated, sys.flags.no_site, sys.flags.dont_write_bytecode) == (1, 1, 1)",
        "assert not any('site-packages' in p for p in list(sys.path))",
        "assert os.path.exists('job.json') is False",  # the job file is gone
        "assert sys.stdin.read() == ''",
    ]
    result = _timed_run(code, tests)
    assert result.status == "ok", result.detail


def test_rlimits_are_set_in_the_child():
    limits = SandboxLimits(timeout_s=10.0, cpu_time_s=1.5, memory_mb=200, file_size_mb=1)
    code = (
        "import resource as r\n"
        "def write_past_the_limit():\n    f = open('big', 'wb')\n    try:\n        f.write(b'x' * (2 << 20))\n"
        "        f.flush()\n    except OSError:\n        return 'refused'\n    return 'written'\n"
    )
    tests = [
        "assert r.getrlimit(r.RLIMIT_CPU) == (2, 2)",
        "assert r.getrlimit(r.RLIMIT_AS) == (200 << 20, 200 << 20)",
        "assert r.getrlimit(r.RLIMIT_FSIZE) == (1 << 20, 1 << 20)",
        "assert r.getrlimit(r.RLIMIT_CORE) == (0, 0)",
        "assert r.getrlimit(r.RLIMIT_NOFILE)[1] <= 64",
        "assert write_past_the_limit() == 'refused'",
    ]
    result = _timed_run(code, tests, limits)
    assert result.status == "ok", result.detail


def test_isolation_layers():
    layers = isolation_layers()
    assert {"process-group", "rlimits", "no-new-privs", "no-capabilities", "audit-hook"} <= set(layers)
    assert ("disk-tmpfs" in layers) != ("disk-watchdog" in layers)
    landlock_layers = [layer for layer in layers if layer.startswith("landlock-")]
    assert landlock_layers == ([f"landlock-{LANDLOCK_ABI}"] if LANDLOCK_ABI else [])
    assert ("seccomp" in layers) == HAS_SECCOMP
    others = {"process-group", "rlimits", "no-new-privs", "no-capabilities", "audit-hook", "user-namespace",
              "network-namespace", "disk-tmpfs", "disk-watchdog", "seccomp"}
    assert set(layers) - set(landlock_layers) <= others


# ------------------------------------------------------------------------------------------- hostile completions


def test_infinite_loop_times_out_and_leaves_no_process():
    limits = SandboxLimits(timeout_s=1.5, cpu_time_s=4.0)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_timed_run, "while True:\n    pass\n", ["assert True"], limits)
        deadline = time.monotonic() + limits.timeout_s
        while not _sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _sandbox_processes(), "the process scan does not see a running sandbox"
        result = future.result()
    assert (result.passed, result.status) == (0, "timeout")
    assert "still running after 1.5 s" in result.detail


def test_cpu_limit_kills_a_busy_loop():
    # the wall clock far above the CPU limit: on a loaded machine the child gets a fraction of a core
    result = _timed_run("while True:\n    pass\n", ["assert True"], SandboxLimits(timeout_s=60.0, cpu_time_s=1.0))
    assert (result.passed, result.status) == (0, "killed")
    assert "SIGKILL" in result.detail


def test_tests_passed_before_a_timeout_count():
    # The CPU limit sits well above the wall clock, so the wall clock is what stops the loop (with both at 2 s the
    # kernel's CPU limit could fire first and the run ended "killed"); 3 s leave a loaded machine time to start the
    # interpreter and pass the first test.
    limits = SandboxLimits(timeout_s=3.0, cpu_time_s=6.0)
    code = DOUBLE + "def spin():\n    while True:\n        pass\n"
    result = _timed_run(code, ["assert f(1) == 2", "assert spin() == 0", "assert f(2) == 4"], limits)
    assert (result.passed, result.total, result.status) == (1, 3, "timeout")


def test_fork_bomb_is_blocked():
    result = _timed_run("import os\nwhile True:\n    os.fork()\n", ["assert True"])
    assert (result.passed, result.status) == (0, "error")
    assert "os.fork is not allowed" in result.detail


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(10 ** 10)", "x = []\nwhile True:\n    x.append(bytearray(10 ** 6))"],
    ids=["one-huge-block", "growing-list"],
)
def test_huge_allocation_fails_in_the_child(code):
    before = _resident_bytes()
    result = _timed_run(code, ["assert True"])
    assert result.passed == 0
    assert result.status in ("error", "killed")
    assert result.status == "killed" or "MemoryError" in result.detail
    assert _resident_bytes() - before < 32 << 20


@pytest.mark.parametrize("where", ["tmp", "repo", "home"])
def test_writes_outside_the_working_directory_leave_nothing(where):
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    target = {
        "tmp": os.path.join(tempfile.gettempdir(), name),
        "repo": os.path.join(REPO, name),
        "home": os.path.join(os.path.expanduser("~"), name),
    }[where]
    # "~" in the child is its own working directory, so that write is allowed and goes away with it.
    path_expr = f"os.path.expanduser('~/{name}')" if where == "home" else repr(target)
    try:
        result = _timed_run(f"import os\nwith open({path_expr}, 'w') as f:\n    f.write('x')\n", ["assert True"])
        assert not os.path.exists(target)
    finally:  # should the sandbox ever let it through, do not leave it behind
        if os.path.exists(target):
            os.remove(target)
    if where == "home":
        assert result.status == "ok"
    else:
        assert (result.passed, result.status) == (0, "error")
        assert "PermissionError" in result.detail


def test_file_system_changes_outside_are_blocked(tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("intact")
    os.chmod(canary, 0o644)
    code = (
        "import os\ndef blocked(action):\n    try:\n        action()\n    except PermissionError:\n"
        "        return True\n    return False\n"
    )
    actions = [
        f"lambda: os.remove({str(canary)!r})",
        f"lambda: os.rename({str(canary)!r}, 'stolen')",
        f"lambda: os.truncate({str(canary)!r}, 0)",
        f"lambda: os.chmod({str(canary)!r}, 0o777)",
        f"lambda: os.utime({str(canary)!r}, (0, 0))",
        f"lambda: os.link({str(canary)!r}, 'hardlink')",
        f"lambda: os.mkdir({str(tmp_path / 'new')!r})",
        f"lambda: open({str(canary)!r}, 'a')",
        # through a symlink made inside the working directory
        f"lambda: (os.symlink({str(tmp_path)!r}, 'outside'), open('outside/canary.txt', 'w'))",
        # a directory descriptor, which would let dir_fd-relative calls reach outside
        f"lambda: os.open({str(tmp_path)!r}, os.O_RDONLY)",
    ]
    result = _timed_run(code, [f"assert blocked({action})" for action in actions])
    assert result.status == "ok", result.detail
    assert canary.read_text() == "intact"
    assert canary.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary.txt"]


@pytest.mark.parametrize(
    "probe",
    [
        "import os; os.system('true')",
        "import subprocess; subprocess.run(['true'])",
        "import os; os.execv('/bin/true', ['true'])",
        "import os; os.posix_spawn('/bin/true', ['true'], {})",
        "import pty; pty.fork()",  # (OSError: with Landlock, /dev/ptmx cannot be opened either)
        "import multiprocessing as mp; mp.get_context('spawn').Process(target=print).start()",
        "import sys; del sys.modules['_posixsubprocess']; import _posixsubprocess",
        "import os; os.kill(os.getppid(), 0)",
        "import os, signal; signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0)",
        "import os; os.mknod('node')",
        "import ctypes; ctypes.CDLL(None)",
        "import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
        "import gc; gc.get_objects()",
        "import sys; sys._current_frames()",
        "open('/proc/self/mem', 'rb')",
        "import socket; socket.socket()",
    ],
)
def test_escape_attempts_are_blocked(probe):
    refusal = "OSError" if "pty" in probe else "PermissionError"
    code = (f"def attempt():\n    {probe}\n"
            f"def blocked():\n    try:\n        attempt()\n    except {refusal}:\n        return True\n"
            "    return False\n")
    result = _timed_run(code, ["assert blocked()"])
    assert result.status == "ok", result.detail


def test_completion_cannot_add_audit_hooks():
    # sys.addaudithook swallows the hook's PermissionError: the new hook is just not added.
    code = "import os, sys\nseen = []\nsys.addaudithook(lambda event, args: seen.append(event))\nos.listdir('.')\n"
    result = _timed_run(code, ["assert seen == []"])
    assert result.status == "ok", result.detail


def test_network_connection_is_blocked():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
        result = _timed_run(code, ["assert True"])
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert (result.passed, result.status) == (0, "error")
    assert "PermissionError" in result.detail


# ------------------------------------------------------------------------------ kernel-enforced confinement

# Defined in the completion, used by the attack snippets: refused(action) is True when the action raises what the
# sandbox answers with: PermissionError (the audit hook; Landlock's EACCES and EPERM) or EXDEV (Landlock refuses
# links and renames across the boundary with it), and False when the action succeeds.
ATTACK_HELPERS = """
import ctypes, errno, io, mmap, os, shutil, socket, sqlite3

SYS = {"x86_64": {"openat": 257, "ptrace": 101, "kill": 62, "io_uring_setup": 425, "fchmodat": 268},
       "aarch64": {"openat": 56, "ptrace": 117, "kill": 129, "io_uring_setup": 425, "fchmodat": 53}}[os.uname().machine]


def refused(action, codes=(errno.EACCES, errno.EPERM, errno.EXDEV)):
    try:
        action()
    except PermissionError:
        return True
    except OSError as e:
        return e.errno in codes
    except sqlite3.OperationalError as e:
        return "unable to open database file" in str(e)
    return False


def syscall(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(SYS[name], *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def libc_open(path, flags):
    fd = ctypes.CDLL(None, use_errno=True).open(path.encode(), flags, 0o644)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return fd


def escape_dir_fd(target, flags):
    # The audit event of os.open carries no dir_fd: it resolves the relative path against the working directory,
    # n levels below the sandbox's directory, where it stays inside; the kernel resolves it against dir_fd, the
    # sandbox's directory, from where the same n levels up reach "/".
    n = os.getcwd().count("/")
    deep = "/".join(["d"] * n)
    os.makedirs(deep, exist_ok=True)
    top = os.open(".", os.O_RDONLY)
    os.chdir(deep)
    try:
        return os.open("../" * n + target.lstrip("/"), flags, dir_fd=top)
    finally:
        os.fchdir(top)
        os.close(top)


def sqlite_outside(path):
    sqlite3.connect(path).execute("create table t (x)")


def touch(name):
    open(name, "w").close()


def socketpair_works():  # asyncio's
    pair = socket.socketpair()
    return pair[0].send(b"x") == 1 and pair[1].recv(1) == b"x"
"""

CREATE = "os.O_CREAT | os.O_WRONLY"


@pytest.fixture
def outside(tmp_path):
    """A directory outside the sandbox with a canary file in it; after the test, it must hold just the canary."""
    canary = tmp_path / "canary.txt"
    canary.write_text("intact")
    os.chmod(canary, 0o644)
    mtime = canary.stat().st_mtime_ns
    yield tmp_path
    assert canary.read_text() == "intact"
    assert canary.stat().st_mode & 0o777 == 0o644
    assert canary.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary.txt"]


@pytest.fixture
def victim():
    """A process outside the sandbox that the completion tries to kill and trace; it must end the test alive."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    try:
        assert proc.poll() is None, "the victim process was killed"
        with open(f"/proc/{proc.pid}/status") as f:
            assert "TracerPid:\t0\n" in f.read(), "the victim process is being traced"
    finally:
        proc.kill()
        proc.wait()


def _attack(attacks: list[str], skip_layers: frozenset[str], limits: SandboxLimits = ROOMY) -> tuple[str, ...]:
    """Run each attack as one test in one child; every attack must be refused. Returns the child's layers."""
    start = time.monotonic()
    result, layers = sandbox._run_child(ATTACK_HELPERS, [f"assert {a}" for a in attacks], limits, skip_layers)
    assert time.monotonic() - start < limits.timeout_s + MARGIN_S, result
    assert _sandbox_processes() == []
    assert (result.status, result.passed, result.total) == ("ok", len(attacks), len(attacks)), result.detail
    for layer, name in (("landlock", f"landlock-{LANDLOCK_ABI}"), ("seccomp", "seccomp"), ("audit-hook", "audit-hook")):
        assert (name in layers) == (layer not in skip_layers), layers
    return layers


@needs_landlock
@pytest.mark.parametrize("config", CONFIGS)
def test_file_system_attacks_are_refused_by_the_kernel(config, outside):
    out, canary = str(outside), str(outside / "canary.txt")
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    attacks = [
        # the probe's escapes: sqlite3 opens files in C, and the audit event of os.open has no dir_fd
        f"refused(lambda: sqlite_outside({out + '/x.db'!r}))",
        f"refused(lambda: escape_dir_fd({out + '/dir_fd'!r}, {CREATE}))",
        "refused(lambda: escape_dir_fd('/proc/self/status', os.O_RDONLY))",
        # raw system calls and libc, past any Python-level check
        f"refused(lambda: syscall('openat', -100, {out + '/raw'!r}.encode(), {CREATE}, 0o644))",
        f"refused(lambda: libc_open({out + '/libc'!r}, {CREATE}))",
        # links, renames and symlinks across the boundary, both ways
        f"refused(lambda: os.link({canary!r}, 'hardlink'))",
        f"refused(lambda: os.rename({canary!r}, 'stolen'))",
        f"(touch('mine'), refused(lambda: os.rename('mine', {out + '/moved'!r})))[1]",
        f"(os.symlink({out!r}, 'out'), refused(lambda: open('out/canary.txt', 'w')))[1]",
        # reading and mapping files outside, other write paths
        f"refused(lambda: open({canary!r}).read())",
        f"refused(lambda: mmap.mmap(os.open({canary!r}, os.O_RDWR), 0))",
        f"refused(lambda: io.FileIO({out + '/fileio'!r}, 'w'))",
        f"(touch('src'), refused(lambda: shutil.copy('src', {out + '/copy'!r})))[1]",
        f"refused(lambda: open('/dev/shm/{name}', 'w'))",
        f"refused(lambda: open(os.path.expanduser('~/../{name}'), 'w'))",
        # the parent's memory, and /proc at all
        "refused(lambda: open(f'/proc/{os.getppid()}/mem', 'rb'))",
        "refused(lambda: open('/proc/self/status'))",
    ]
    _attack(attacks, CONFIGS[config])
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), name))


@needs_landlock
@pytest.mark.parametrize("config", CONFIGS)
def test_processes_outside_cannot_be_signalled_or_traced(config, victim):
    attacks = [f"refused(lambda: syscall('ptrace', 16, {victim}, 0, 0))"]  # PTRACE_ATTACH (Landlock, any ABI)
    if LANDLOCK_ABI >= 6:  # signal scoping; below it a process of the same user may signal the victim
        attacks += [f"refused(lambda: syscall('kill', {victim}, 9))",
                    "refused(lambda: syscall('kill', os.getppid(), 0))"]
    _attack(attacks, CONFIGS[config])


@needs_landlock
@pytest.mark.skipif(LANDLOCK_ABI < 4, reason=f"TCP rules need Landlock ABI 4, this kernel offers {LANDLOCK_ABI}")
@pytest.mark.parametrize("config", CONFIGS)
def test_tcp_connect_and_bind_are_refused_by_the_kernel(config):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        attacks = [
            f"refused(lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1))",
            "refused(lambda: socket.socket().bind(('127.0.0.1', 0)))",
        ]
        _attack(attacks, CONFIGS[config])
        listener.settimeout(0.05)
        with pytest.raises(TimeoutError):
            listener.accept()


@needs_landlock
@pytest.mark.skipif(LANDLOCK_ABI < 6, reason=f"socket scoping needs Landlock ABI 6, this kernel has {LANDLOCK_ABI}")
@pytest.mark.parametrize("config", CONFIGS)
def test_abstract_unix_sockets_outside_are_out_of_reach(config):
    address = f"\0grpo-sandbox-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(address)
        listener.listen()
        connect = f"socket.socket(socket.AF_UNIX).connect({address!r})"
        attack = f"refused(lambda: {connect}, (errno.EPERM, errno.ECONNREFUSED))"
        _attack([attack], CONFIGS[config])
        listener.settimeout(0.05)
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.skipif(not HAS_SECCOMP or LANDLOCK_ABI == 0, reason="seccomp filter for x86_64 and aarch64 only")
@pytest.mark.parametrize("config", SECCOMP_CONFIGS)
def test_sockets_landlock_does_not_cover_are_refused_by_seccomp(config, tmp_path):
    # Landlock (up to ABI 7) lets a process connect to a named unix socket anywhere (a Docker or D-Bus socket, say)
    # and send UDP; the seccomp filter refuses socket(2) itself, and io_uring, which could make sockets without it.
    path = str(tmp_path / "listener.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        listener.bind(path)
        listener.listen()
        udp.bind(("127.0.0.1", 0))
        attacks = [
            f"refused(lambda: socket.socket(socket.AF_UNIX).connect({path!r}))",
            f"refused(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', {udp.getsockname()!r}))",
            "refused(lambda: syscall('io_uring_setup', 8, bytes(120)))",
            "socketpair_works()",
        ]
        _attack(attacks, SECCOMP_CONFIGS[config])
        listener.settimeout(0.05)
        udp.settimeout(0.05)
        with pytest.raises(TimeoutError):
            listener.accept()
        with pytest.raises(TimeoutError):
            udp.recv(1)


@pytest.mark.skipif(not HAS_SECCOMP or LANDLOCK_ABI == 0, reason="seccomp filter for x86_64 and aarch64 only")
@pytest.mark.parametrize("config", SECCOMP_CONFIGS)
def test_file_metadata_outside_cannot_be_changed(config, outside):
    # Landlock has no access right for chmod, chown, utime or extended attributes, and the uid maps to itself: a
    # completion run as the owner of files outside (root, often) could change them. The seccomp filter refuses the
    # calls (the outside fixture checks the canary's mode, mtime and content afterwards).
    canary = str(outside / "canary.txt")
    attacks = [
        f"refused(lambda: os.chmod({canary!r}, 0o777))",
        f"refused(lambda: os.chown({canary!r}, os.getuid(), os.getgid()))",
        f"refused(lambda: os.utime({canary!r}, (0, 0)))",
        f"refused(lambda: os.setxattr({canary!r}, 'user.x', b'1'))",
        f"refused(lambda: os.removexattr({canary!r}, 'user.x'))",
        f"refused(lambda: syscall('fchmodat', -100, {canary!r}.encode(), 0o777, 0))",
    ]
    _attack(attacks, SECCOMP_CONFIGS[config])


# fill(size) writes files of size bytes until a write fails; it returns the error's name, the bytes written and the
# files made. empty() removes them.
FILL = """
import errno, os


def fill(size):
    written = files = 0
    try:
        while files < 100000:
            with open(f"f{files}", "wb") as f:
                files += 1
                f.write(b"x" * size)
            written += size
    except OSError as e:
        return errno.errorcode[e.errno], written, files
    return "no limit", written, files


def empty():
    for name in os.listdir("."):
        os.remove(name)
"""


def test_disk_budget_is_a_private_tmpfs():
    if "disk-tmpfs" not in isolation_layers():
        pytest.skip("this kernel refuses unprivileged user namespaces (the watchdog tests cover the fallback)")
    limits = SandboxLimits(timeout_s=5.0, cpu_time_s=10.0, disk_mb=2, max_files=50)
    tests = [
        "assert fill(1 << 20)[0] == 'ENOSPC'\nassert 2 << 20 >= written_so_far() and files_so_far() <= 3",
        "assert empty() is None",
        "assert fill(0) == ('ENOSPC', 0, 50)",  # the probe's "many files", empty: the inodes
    ]
    code = FILL + "def written_so_far():\n    return sum(os.path.getsize(n) for n in os.listdir('.'))\n" \
                  "def files_so_far():\n    return len(os.listdir('.'))\n"
    result = _timed_run(code, tests, limits)
    assert result.status == "ok", result.detail


@pytest.mark.parametrize(("size", "limits"), [
    (0, SandboxLimits(timeout_s=5.0, cpu_time_s=10.0, max_files=50)),
    (100_000, SandboxLimits(timeout_s=5.0, cpu_time_s=10.0, disk_mb=1)),
], ids=["many-files", "many-bytes"])
def test_disk_watchdog_kills_a_child_past_the_budget(size, limits):
    # Without the namespaces the parent's watchdog stops the writer long before the wall clock, the only other
    # limit that could (the CPU limit is higher, and no write fails).
    code = f"i = 0\nwhile True:\n    with open(f'f{{i}}', 'wb') as f:\n        f.write(b'x' * {size})\n    i += 1\n"
    start = time.monotonic()
    result, layers = sandbox._run_child(code, ["assert True"], limits, frozenset({"namespaces"}))
    assert time.monotonic() - start < limits.timeout_s + MARGIN_S
    assert "disk-tmpfs" not in layers
    assert (result.passed, result.status) == (0, "disk_limit"), result.detail
    assert f"the directory passed {limits.max_files} files or {limits.disk_mb} MiB" in result.detail


def test_disk_watchdog_sees_a_writer_quicker_than_one_poll(monkeypatch):
    # 30 MB written and done between two polls (made 60 s apart here, so only the check when the child is done can
    # see it): that check finds the directory over 1 MiB, and the child's own "all passed" does not override it
    monkeypatch.setattr(sandbox, "_POLL_S", 60.0)
    code = "for i in range(300):\n    open(f'f{i}', 'wb').write(b'x' * 100_000)\n"
    limits = SandboxLimits(timeout_s=5.0, cpu_time_s=10.0, disk_mb=1, max_files=1000)
    result, layers = sandbox._run_child(code, ["assert True"], limits, frozenset({"namespaces"}))
    assert "disk-tmpfs" not in layers
    assert (result.passed, result.status) == (0, "disk_limit"), result.detail


def test_an_unreadable_directory_counts_as_over_the_disk_budget(tmp_path, monkeypatch):
    # a child that hides its writes in a directory the parent cannot list (mode 0o300, run as another user) must not
    # pass the watchdog unseen (as root here, the parent lists anything: the refusal is simulated)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: (_ for _ in ()).throw(PermissionError(13, "denied", path))
                        if str(path) == str(hidden) else real_scandir(path))
    assert sandbox._over_disk_budget(str(tmp_path), SandboxLimits(disk_mb=1, max_files=10))
    hidden.rmdir()
    assert not sandbox._over_disk_budget(str(tmp_path), SandboxLimits(disk_mb=1, max_files=10))


def test_without_landlock_the_warning_and_metrics_say_so(monkeypatch, caplog):
    skip_landlock = frozenset({"landlock"})
    monkeypatch.setattr(sandbox, "_run_child", lambda code, tests, limits: _real_run_child(code, tests, limits,
                                                                                          skip_landlock))
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        layers = isolation_layers.__wrapped__()
    assert not any(layer.startswith("landlock-") for layer in layers)
    assert "the code sandbox runs without Landlock" in caplog.text
    monkeypatch.setattr(sandbox, "isolation_layers", lambda: layers)
    assert sandbox_metrics()["landlock_abi"] == 0.0


_real_run_child = sandbox._run_child


def test_metrics_report_the_layers_in_force():
    metrics = sandbox_metrics()
    assert metrics == {"landlock_abi": float(LANDLOCK_ABI), "disk_tmpfs": float("disk-tmpfs" in isolation_layers())}
    assert reward_metrics([code_reward]) == {f"rewards/code_reward/{k}": v for k, v in metrics.items()}
    assert reward_metrics([lambda prompts, completions, **kw: []]) == {}


def test_json_test_lists():
    assert json_test_list('["assert f(1) == 2", "assert f(2) == 4"]') == ["assert f(1) == 2", "assert f(2) == 4"]
    assert json_test_list("assert f(1) == 2") is None
    assert json_test_list("[1, 2]") is None
    assert json_test_list("['assert True']") is None  # a Python literal, not JSON
    assert json_test_list('"assert True"') is None


@pytest.mark.parametrize("data", ['[{"input": "1", "output": "2"}]', "[1, 2]", '{"a": 1}', "123", "None", "'x'"])
def test_code_reward_refuses_tests_strings_that_hold_data(data):
    """A tests string that holds data, not code, would run as one always-passing test: refused, with its index."""
    with pytest.raises(ValueError, match=r"code_reward: tests\[1\]: a tests string must be test code"):
        code_reward(["p", "p"], ["x = 1", "x = 1"], [["assert x == 1"], data])


def test_code_reward_reads_tests_stored_as_strings():
    """JSON and Python-repr lists of snippets (parquet, pandas and CSV round trips) are those lists; plain code is one
    test; None is unscored."""
    code = "def f(x):\n    return x + 1\n"
    tests = ['["assert f(1) == 2", "assert f(2) == 4"]', "['assert f(1) == 2', 'assert f(2) == 4']",
             "assert f(1) == 2", None]
    assert code_reward(["p"] * 4, [code] * 4, tests) == [0.5, 0.5, 1.0, None]


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut_off(stream):
    before = _resident_bytes()
    result = _timed_run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 10000)\n", ["assert True"])
    assert result.passed == 0
    assert result.status in ("output_limit", "timeout")
    assert len(result.detail) < 1000
    assert _resident_bytes() - before < 32 << 20


def test_fake_pass_markers_gain_nothing():
    # what reached the report channel breaks the report: every test fails
    code = (
        "import os\nprint('PASS')\nprint('PASS: 0')\n"
        "for fd in range(3, 64):\n"
        "    try:\n        os.write(fd, b'pass 0\\nPASS 0\\n0 pass 0\\ndone\\n')\n    except OSError:\n        pass\n"
    )
    result = _timed_run(code, ["assert False", "assert 1 == 2"])
    assert (result.passed, result.status) == (0, "error")
    assert "the sandbox's report broke protocol" in result.detail


REPORT_TESTS = ["assert f(1) == 2", "import math\nassert g(1) == 3 and g(2) == 4"]
LAYERS_LINE, CODE_OK = b'{"layers":["rlimits"]}\n', b'{"code":"ok"}\n'
TEST_0, TEST_1 = b'{"i":0,"r":[["v",2]]}\n', b'{"i":1,"r":[["v",3],["v",4]]}\n'


@pytest.mark.parametrize(("stream", "passed", "status", "broken"), [
    (LAYERS_LINE + CODE_OK + TEST_0 + TEST_1, 2, "ok", None),
    (LAYERS_LINE + CODE_OK + TEST_0 + b'{"i":1,"r":[["v",3],["x","KeyError: 2"]]}\n', 1, "failed", None),
    (LAYERS_LINE + CODE_OK + TEST_0 + b'{"i":1,"e":"ImportError: no math"}\n', 1, "failed", None),
    (LAYERS_LINE + b'{"code":"error"}\n', 0, "error", None),
    (LAYERS_LINE + CODE_OK + TEST_0, 1, "error", None),  # the child exited before answering test 1
    (LAYERS_LINE + CODE_OK + TEST_1, 0, "error", "test 0's line missing or out of order"),
    (LAYERS_LINE + CODE_OK + TEST_0 + TEST_0 + TEST_1, 0, "error", "test 1's line missing or out of order"),
    (LAYERS_LINE + CODE_OK + TEST_0 + TEST_1 + TEST_1, 0, "error", "a line after the last one"),
    (LAYERS_LINE + b'{"code":"error"}\n' + TEST_0, 0, "error", "a line after the last one"),
    (LAYERS_LINE + CODE_OK + b'{"i":false,"r":[["v",2]]}\n', 0, "error", "test 0's line missing or out of order"),
    (LAYERS_LINE + CODE_OK + b'{"i":0,"r":[["v",2],["v",2]]}\n', 0, "error", "test 0's line is not 1 outcomes"),
    (LAYERS_LINE + CODE_OK + b'{"i":0,"r":[["v",{"object":[]}]]}\n', 0, "error", "test 0's values do not parse"),
    (LAYERS_LINE + CODE_OK + b'{"i":0,"r":[["ok",2]]}\n', 0, "error", "test 0's values do not parse"),
    (LAYERS_LINE + CODE_OK + b'{"i":0,"r":[["v",2]],"pass":true}\n', 0, "error", "test 0's line is not 1 outcomes"),
    (LAYERS_LINE + CODE_OK + b'pass 0\n', 0, "error", "a line that is not JSON"),
    (CODE_OK + TEST_0, 0, "error", "a first line other than the layers"),
    (LAYERS_LINE + TEST_0, 0, "error", "a second line other than how the completion ran"),
    (LAYERS_LINE + CODE_OK + TEST_0 + b"[" * (2 << 20), 0, "error", "a line longer than the 1051648 bytes it may take"),
], ids=["in-order", "a-hole-raised", "imports-raised", "code-error", "unanswered", "skipped", "repeated", "extra",
        "after-error", "bool-index", "wrong-length", "bad-value", "bad-outcome", "extra-key", "not-json", "no-layers",
        "no-code-line", "too-long"])
def test_the_report_is_the_results_in_order_or_nothing(stream, passed, status, broken):
    # what the parent makes of a report channel carrying `stream`, whole and cut anywhere, from a child that exited 0
    for chunk in (len(stream), 7):
        reports = sandbox._Reports(sandbox.parse_tests(REPORT_TESTS, "tests"), judge_s=5.0)
        for start in range(0, len(stream), chunk):
            reports.feed(stream[start : start + chunk])
        assert reports.broken is None if broken is None else reports.broken.startswith(broken), reports.broken
        assert len(reports._pending) <= 1 << 16  # a broken report keeps nothing of what follows
        streams = types.SimpleNamespace(output_bytes=0, stderr_tail=b"")
        result = sandbox._verdict(0, None, streams, reports, len(REPORT_TESTS), ROOMY)
        assert (result.passed, result.status) == (passed, status), result.detail
        if broken is not None:
            assert f"the sandbox's report broke protocol ({broken}" in result.detail


def test_rebinding_builtins_does_not_fake_passes():
    code = "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\nbuiltins.BaseException = object\n"
    result = _timed_run(code, ["assert False"])
    assert (result.passed, result.status) == (0, "failed")


def test_early_exit_scores_zero():
    result = _timed_run("import os\nos._exit(0)\n", ["assert True"])
    assert (result.passed, result.status) == (0, "error")


def test_directories_without_permissions_are_removed():
    # without the namespaces: with them the files live in the child's private tmpfs, which the parent never sees
    # (made with mkdir's mode: the seccomp filter refuses chmod)
    code = "import os\nos.mkdir('a')\nos.mkdir('a/b', 0)\nos.mkdir('c', 0)\nopen('d', 'w').close()\nos.mkdir('e', 0o300)\n"
    result, layers = sandbox._run_child(code, ["assert True"], ROOMY, frozenset({"namespaces"}))
    assert "disk-tmpfs" not in layers
    assert result.status == "ok", result.detail


# ------------------------------------------------------------------------------------------------------ forgeries

# Completions that try to score without computing f, g and h. The sandbox sees only the holes (f(2), g('abc'), ...),
# never the expected values, which avoid the guessable ones (True, 0, 1, None, '', []). Each forgery runs under every
# layer and under none: the verdict is the parent's, so it must not rest on any layer of the child.
FORGERY_TESTS = [
    "assert f(2) == 4",
    "assert f(3) == 6 and f(-1) == -2",
    "assert g('abc') == 'cba'",
    "assert sorted(h([3, 1, 2])) == [1, 2, 3]",
    "assert len(h([5, 6, 7])) == 3",
    "assert abs(f(1.25) - 2.5) < 1e-9",
    "import math\nassert math.isclose(f(1.5), 3.0)",
    "assert g('xy') in ('yx', 'YX')",
]
SOLUTION = "def f(x):\n    return 2 * x\ndef g(s):\n    return s[::-1]\ndef h(xs):\n    return list(reversed(xs))\n"
LAYER_CONFIGS = {"all-layers": frozenset(), "no-layers": frozenset({"audit-hook", "namespaces", "landlock", "seccomp"})}

# What the forgeries share: the harness's frame (found from the completion's own), and a report in the right form for
# every test (one outcome per hole, read from the harness's compiled steps) claiming the value `guess` throughout.
FORGE = '''
import json, os, sys

GUESS = True


def harness(frame):
    while frame is not None and not ("send" in frame.f_locals and "steps" in frame.f_locals):
        frame = frame.f_back
    if frame is None:
        raise LookupError("no harness frame")
    return frame.f_locals


def report(steps, guess=GUESS):
    return [{"code": "ok"}] + [{"i": i, "r": [["v", guess] for kind, _ in test if kind == "eval"]}
                               for i, test in enumerate(steps)]


def forged_lines(steps, guess=GUESS):
    return b"".join(json.dumps(message).encode() + b"\\n" for message in report(steps, guess))
'''

FORGERIES = {
    # the probe's own forgery, verbatim: the reporting function, channel and line builder it used are gone
    "probe": "import sys\nL = sys._getframe(1).f_locals\nL['write'](L['channel'], L['line']('pass', '0'))\n"
             "L['write'](L['channel'], L['line']('done'))\nL['exit_now'](0)\n",
    # the harness's own send, found by walking the frames, with a report in the right form, then an exit before the
    # harness writes its own
    "frames": FORGE + "L = harness(sys._getframe())\nfor m in report(L['steps']):\n    L['send'](m)\n"
                      "L['exit_now'](0)\n",
    "traceback": FORGE + "try:\n    raise RuntimeError\nexcept RuntimeError as e:\n"
                         "    L = harness(e.__traceback__.tb_frame)\n"
                         "for m in report(L['steps'], 'PASS'):\n    L['send'](m)\nos._exit(0)\n",
    "inspect": FORGE + "import inspect\nL = harness(inspect.currentframe())\n"
                       "assert any('send' in fi.frame.f_locals for fi in inspect.stack())\n"
                       "os.write(L['channel'], forged_lines(L['steps'], 0))\nos._exit(0)\n",
    "gc": FORGE + "import gc\nobjects = gc.get_objects()\n"
                  "send = next(o for o in objects if getattr(o, '__name__', '') == 'send' and callable(o))\n"
                  "steps = next(o for o in objects if type(o) is list and o and all(type(t) is list for t in o) and "
                  "all(type(s) is tuple and s[:1] in (('exec',), ('eval',)) for t in o for s in t))\n"
                  "assert gc.get_referrers(send)\nfor m in report(steps, None):\n    send(m)\nos._exit(0)\n",
    # builtins, math, os.write and the JSON encoder replaced: every report the harness writes claims True
    "monkeypatch": FORGE + (
        "import builtins, math\n"
        "builtins.len = lambda x: 3\nbuiltins.sorted = lambda x, **k: [1, 2, 3]\nbuiltins.abs = lambda x: 0\n"
        "math.isclose = lambda *a, **k: True\n"
        "real_write, real_encode = os.write, json.JSONEncoder.encode\n"
        "def forged_write(fd, data):\n    return real_write(fd, data.replace(b'\"x\"', b'\"v\"'))\n"
        "def forged_encode(self, o):\n"
        "    if type(o) is dict and 'r' in o:\n        o = {'i': o['i'], 'r': [['v', True] for _ in o['r']]}\n"
        "    return real_encode(self, o)\n"
        "os.write, json.JSONEncoder.encode = forged_write, forged_encode\n"
        "def f(x):\n    return 'forged'\ng = h = f\n"),
    # a thread that writes reports (even one holding test 0's right value) to every descriptor while the tests run
    "thread": "import os, threading, time\n"
              "def spam():\n    while True:\n        for fd in range(3, 32):\n            try:\n"
              "                os.write(fd, b'{\"i\": 0, \"r\": [[\"v\", 4]]}\\n{\"code\": \"ok\"}\\n')\n"
              "            except OSError:\n                pass\n        time.sleep(0.001)\n"
              "threading.Thread(target=spam, daemon=True).start()\ntime.sleep(0.05)\n"
              "def f(x):\n    time.sleep(0.01)\n    return 'forged'\ng = h = f\n",
    "atexit": FORGE + "import atexit\nL = harness(sys._getframe())\n"
                      "atexit.register(lambda: os.write(L['channel'], forged_lines(L['steps'])))\nsys.exit(0)\n",
    # a trace (or profile) function rewrites the harness's message before it is sent
    "settrace": FORGE + "def tracer(frame, event, arg):\n    m = frame.f_locals.get('message')\n"
                        "    if type(m) is dict and 'r' in m:\n"
                        "        frame.f_locals['message'] = {'i': m['i'], 'r': [['v', GUESS] for _ in m['r']]}\n"
                        "    return tracer\nsys.settrace(tracer)\nsys._getframe(1).f_trace = tracer\n",
    "setprofile": FORGE + "def profiler(frame, event, arg):\n    m = frame.f_locals.get('message')\n"
                          "    if event == 'call' and type(m) is dict and 'r' in m:\n"
                          "        frame.f_locals['message'] = {'i': m['i'], 'r': [['v', GUESS] for _ in m['r']]}\n"
                          "sys.setprofile(profiler)\n",
    # objects that are equal to, less and greater than, and as long as everything
    "lying-object": "class Liar:\n    def __eq__(self, other):\n        return True\n"
                    "    def __ne__(self, other):\n        return False\n"
                    "    __lt__ = __le__ = __gt__ = __ge__ = __eq__\n"
                    "    def __hash__(self):\n        return 0\n    def __bool__(self):\n        return True\n"
                    "    def __repr__(self):\n        return '4'\n    def __len__(self):\n        return 3\n"
                    "    def __sub__(self, other):\n        return 0\n    __rsub__ = __sub__\n"
                    "    def __abs__(self):\n        return 0\n    def __float__(self):\n        return 3.0\n"
                    "    def __contains__(self, item):\n        return True\n"
                    "def f(x):\n    return Liar()\ng = h = f\n",
    "lying-subclasses": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                        "    __hash__ = int.__hash__\n    __class__ = property(lambda self: int)\n"
                        "class S(str):\n    def __eq__(self, other):\n        return True\n"
                        "    __hash__ = str.__hash__\n"
                        "class L(list):\n    def __eq__(self, other):\n        return True\n"
                        "    def __len__(self):\n        return 3\n"
                        "def f(x):\n    return I(0)\ndef g(s):\n    return S('')\ndef h(xs):\n    return L()\n",
    "os-exit": "import os\nos._exit(0)\n",
    "sys-exit": "import sys\nsys.exit(0)\n",
    "exit-in-a-test": "def f(x):\n    import os\n    os._exit(0)\ng = h = f\n",
    # the right values, printed as report lines on stdout and stderr (which are never read for results)
    "print": "import sys, json\n"
             "lines = [{'code': 'ok'}, {'i': 0, 'r': [['v', 4]]}, {'i': 1, 'r': [['v', 6], ['v', -2]]}]\n"
             "for m in lines:\n    print(json.dumps(m))\n    print(json.dumps(m), file=sys.stderr)\n"
             "print('pass 0\\ndone')\n",
    "every-fd": "import os, json\nold = b'pass 0\\npass 1\\ndone\\n'\n"
                "new = b'{\"code\": \"ok\"}\\n' + b''.join(json.dumps({'i': i, 'r': [['v', True]] * 2}).encode() + "
                "b'\\n' for i in range(8))\n"
                "for fd in range(256):\n    try:\n        os.write(fd, old + new)\n    except OSError:\n        pass\n"
                "def f(x):\n    return 'forged'\ng = h = f\n",
    "del": "class Bomb:\n    def __del__(self):\n        import os\n        for fd in range(3, 16):\n            try:\n"
           "                os.write(fd, b'{\"i\": 0, \"r\": [[\"v\", 4]]}\\n')\n            except OSError:\n"
           "                pass\n        raise SystemExit(0)\n"
           "def f(x):\n    return Bomb()\ng = h = f\n",
    "huge-values": "def f(x):\n    return 'x' * (64 << 20)\ndef g(s):\n    return list(range(10 ** 6))\n"
                   "def h(xs):\n    return iter(lambda: 1, 2)  # an endless iterator\n",
    "huge-line": FORGE + "L = harness(sys._getframe())\nos.write(L['channel'], b'[' * (16 << 20))\nos._exit(0)\n",
    # no expected value is anywhere the completion can look: the frames, the heap, the process's memory
    "search-memory": (
        "import gc, re, sys\nfrom types import CodeType\n"
        "MARK = re.compile('zq-expected-[0-9a-f]{6}')  # matches neither this line nor its own pattern\n"
        "def strings(value, seen, depth=0):\n    if id(value) in seen or depth > 6:\n        return\n"
        "    seen.add(id(value))\n    if type(value) is str:\n        yield value\n"
        "    elif type(value) in (list, tuple, set, frozenset):\n"
        "        for item in list(value):\n            yield from strings(item, seen, depth + 1)\n"
        "    elif type(value) is dict:\n        for item in (*value.keys(), *value.values()):\n"
        "            yield from strings(item, seen, depth + 1)\n"
        "    elif type(value) is CodeType:\n        yield from strings(value.co_consts, seen, depth + 1)\n"
        "def everything():\n    frame = sys._getframe()\n    while frame is not None:\n"
        "        yield frame.f_locals\n        yield frame.f_globals\n        yield frame.f_code\n"
        "        frame = frame.f_back\n    yield dict(sys.modules)\n"
        "    try:\n        yield gc.get_objects()\n    except PermissionError:\n        pass\n"
        "def memory():  # the whole address space, where /proc is open to it (no Landlock, no audit hook)\n"
        "    try:\n        maps = open('/proc/self/maps').read().splitlines()\n"
        "        mem = open('/proc/self/mem', 'rb')\n    except OSError:\n        return\n"
        "    for line in maps:\n        start, end = (int(a, 16) for a in line.split()[0].split('-'))\n"
        "        try:\n            mem.seek(start)\n            chunk = mem.read(min(end - start, 1 << 26))\n"
        "        except (OSError, OverflowError, ValueError):\n            continue\n"
        "        found = re.search(MARK.pattern.encode(), chunk)\n        if found:\n"
        "            yield found.group().decode()\n"
        "def f(x):\n    seen = set()\n    for root in everything():\n        for text in strings(root, seen):\n"
        "            if MARK.fullmatch(text):\n                return text\n"
        "    for text in memory():\n        return text\n    return None\ng = h = f\n"),
}
MARKER_TEST = "assert f(0) == 'zq-expected-7f3a9c'"  # search-memory's f returns the first 'zq-...' string it finds


@pytest.mark.parametrize(("config", "where"), [("all-layers", "objects"), ("no-layers", "objects"),
                                               ("no-layers", "memory")])
def test_the_memory_search_finds_what_the_sandbox_holds(config, where):
    # The control for search-memory: a string the sandbox does hold (in a hole: an argument) is found, by the walk
    # over frames, modules and the heap, and (where /proc is open to it) by reading the process's memory alone.
    code = FORGERIES["search-memory"]
    if where == "memory":
        code = code.replace("    for root in everything():", "    for root in ():")
    tests = [MARKER_TEST, "assert g('zq-expected-7f3a9c') == 1"]
    result, _ = sandbox._run_child(code, tests, ROOMY, LAYER_CONFIGS[config])
    assert result.passed == 1, result.detail
    assert "test 1 failed: assert g('zq-expected-7f3a9c') == 1: it is False (with g('zq-expected-7f3a9c') = " \
           "'zq-expected-7f3a9c')" in result.detail


@pytest.mark.parametrize("config", LAYER_CONFIGS)
def test_the_solution_scores_one_under_every_configuration(config):
    result, _ = sandbox._run_child(SOLUTION, FORGERY_TESTS, ROOMY, LAYER_CONFIGS[config])
    assert (result.passed, result.total, result.status) == (len(FORGERY_TESTS), len(FORGERY_TESTS), "ok"), result.detail


@pytest.mark.parametrize("config", LAYER_CONFIGS)
@pytest.mark.parametrize("forgery", FORGERIES)
def test_forgeries_score_zero(forgery, config):
    before = _resident_bytes()
    start = time.monotonic()
    tests = [*FORGERY_TESTS, MARKER_TEST]
    result, layers = sandbox._run_child(FORGERIES[forgery], tests, ROOMY, LAYER_CONFIGS[config])
    assert time.monotonic() - start < ROOMY.timeout_s + MARGIN_S, result
    assert _sandbox_processes() == []
    assert (result.passed, result.total) == (0, len(tests)), result.detail
    assert result.fraction == 0.0
    assert result.status in ("failed", "error", "output_limit"), result.detail
    assert _resident_bytes() - before < 32 << 20  # a huge value or line costs the parent nothing
    assert ("audit-hook" in layers) == (config == "all-layers")


def test_forgeries_say_why_they_failed():
    # the reasons, for the forgeries each kind of defence stops
    cases = {
        "frames": "test 0 failed: assert f(2) == 4: it is False (with f(2) = True)",
        "lying-object": "test 0 failed: assert f(2) == 4: f(2) not plain: a Liar is not plain data",
        "lying-subclasses": "f(2) not plain: a I is not plain data",
        "every-fd": "the sandbox's report broke protocol",
        "thread": "the sandbox's report broke protocol",
        "huge-values": "g('abc') not plain: the values of one test take more than 1048576 characters once encoded",
        "huge-line": "the sandbox's report broke protocol (a line longer than the",
        "exit-in-a-test": "the interpreter exited with code 0 before answering every test",
        "gc": "gc.get_objects is not allowed",
    }
    for forgery, reason in cases.items():
        result = _timed_run(FORGERIES[forgery], FORGERY_TESTS)
        assert result.passed == 0 and reason in result.detail, (forgery, result.detail)


@pytest.mark.parametrize("noise", [
    "import sys\nprint('{\"code\": \"ok\"}')\nprint('pass 0\\ndone', file=sys.stderr)\n",
    "import atexit, os\natexit.register(os.write, 1, b'pass 0\\n')\n",
    "import threading, time\nthreading.Thread(target=lambda: [time.sleep(0.001) or print('x') for _ in range(50)],"
    " daemon=True).start()\n",
    "class Noisy:\n    def __del__(self):\n        raise RuntimeError('from __del__')\n"
    "junk = [Noisy() for _ in range(3)]\ndel junk\n",
], ids=["fake-lines-on-stdout", "atexit", "thread", "del-raises"])
def test_a_correct_solution_with_noise_still_scores_one(noise):
    result = _timed_run(noise + SOLUTION, FORGERY_TESTS)
    assert (result.passed, result.status) == (len(FORGERY_TESTS), "ok"), result.detail


def test_a_constant_answer_gets_only_the_checks_it_answers():
    # The sandbox evaluates is_even(7) for `assert not is_even(7)`: it never sees the `not`, so an is_even that
    # always says True passes the positive check and fails the negative one (the parent wants False there).
    tests = ["assert is_even(10)", "assert not is_even(7)", "assert is_even(7) == False", "assert is_even(4) is True"]
    always = _timed_run("def is_even(n):\n    return True\n", tests)
    assert (always.passed, always.status) == (2, "failed")
    # 1 and 0: where the test takes a truth value they are not True or False; `== False` compares as Python does
    truthy = _timed_run("def is_even(n):\n    return 1 - n % 2\n", tests)
    assert truthy.passed == 1
    assert "test 1 failed: assert not is_even(7): a truth value must be True or False, got 0 (int)" in truthy.detail
    right = _timed_run("def is_even(n):\n    return n % 2 == 0\n", tests)
    assert right.passed == 4


def test_values_of_every_plain_type_come_back():
    values = ("(None, True, -3, 2 ** 100, 0.5, float('inf'), 1 + 2j, 'é\\n\"', b'\\x00\\xff', [1, [2]], (3,), "
              "{'a': (1, 2), 3: None}, {1, 2}, frozenset({'x'}), range(1, 9, 2))")
    code = f"def values():\n    return {values}\ndef gen():\n    yield from range(3)\n"
    tests = [f"assert values() == {values}",
             "assert list(gen()) == [0, 1, 2]",
             "assert gen() != [0, 1, 2]",  # an iterator, as in Python: not equal to a list
             "assert math.isnan(float('nan')) and values()[5] > 10 ** 300"]
    result = _timed_run(code, tests)
    assert result.status == "ok", result.detail


def test_a_test_the_parent_cannot_judge_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"tests\[1\] must be assert statements the parent can judge \(and imports\): "
                                         r"the For statement on line 1 would run in the sandbox"):
        run_tests(DOUBLE, ["assert f(1) == 2", "for x in range(3):\n    assert f(x) == 2 * x"])
    with pytest.raises(ValueError, match=r"code_reward: tests\[1\]\[0\] must be assert statements .*both sides of "
                                         r"'f\(1\) == f\(2\)' come from the sandbox"):
        code_reward(["p", "p"], [DOUBLE, DOUBLE], [["assert f(1) == 2"], ["assert f(1) == f(2)"]])


# -------------------------------------------------------------------------------------------------- code_reward


def test_code_reward_on_strings_chat_messages_and_missing_tests():
    completions = [
        "Here you go:\n```python\ndef f(x):\n    return x + 1\n```\n",
        [{"role": "assistant", "content": "```python\ndef f(x):\n    return x\n```"}],
        "def f(x):\n    return x + 1\n",
        "no tests for this one",
        "nor for this one",
        "def f(x):\n    return x + 1\n",
        "nor for this one, whose empty list is stored as a JSON string",
    ]
    tests = [["assert f(1) == 2", "assert f(2) == 3"], ["assert f(1) == 2", "assert f(0) == 0"], "assert f(0) == 1",
             None, [], '["assert f(0) == 1", "assert f(0) == 2"]', "[]"]  # lists stored as JSON strings
    rewards = code_reward(["prompt"] * 7, completions, tests, limits=ROOMY, answer=[None] * 7)
    assert rewards == [1.0, 0.5, 1.0, None, None, 0.5, None]


def test_code_reward_checks_lengths():
    with pytest.raises(ValueError, match="2 completions but 1 test lists"):
        code_reward(["p", "p"], ["a", "b"], [["assert True"]])


def test_other_platforms_raise(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(RuntimeError, match="Linux only"):
        run_tests(DOUBLE, ["assert f(1) == 2"])
    with pytest.raises(RuntimeError, match="Linux only"):
        code_reward(["p"], ["c"], [["assert True"]])


# ------------------------------------------------------------------------------------------ limits and helpers


@pytest.mark.parametrize(
    ("field", "value", "error", "expected"),
    [
        ("timeout_s", 0, ValueError, "a positive, finite number"),
        ("timeout_s", float("inf"), ValueError, "a positive, finite number"),
        ("cpu_time_s", -1.0, ValueError, "a positive, finite number"),
        ("cpu_time_s", "4", TypeError, "a positive, finite number"),
        ("memory_mb", 0, ValueError, "a positive int"),
        ("memory_mb", 1.5, TypeError, "a positive int"),
        ("file_size_mb", True, TypeError, "a positive int"),
        ("max_output_bytes", -5, ValueError, "a positive int"),
    ],
)
def test_limits_validation_names_the_field(field, value, error, expected):
    with pytest.raises(error, match=re.escape(f"SandboxLimits.{field} must be {expected}, got {value!r}")):
        SandboxLimits(**{field: value})


def test_result_fraction():
    assert SandboxResult(2, 3, "failed", "").fraction == pytest.approx(2 / 3)
    assert SandboxResult(0, 0, "ok", "").fraction == 0.0


def test_extract_code_picks_the_last_python_block():
    text = (
        "Try:\n```python\nx = 1\n```\nShell:\n```bash\nrm -rf /\n```\n"
        "Final:\n```python\ndef f():\n    return 2\n```\nDone."
    )
    assert extract_code(text) == "def f():\n    return 2"
    assert extract_code("```\nuntagged = True\n```") == "untagged = True"
    assert extract_code("```py\na = 1\n```\n```bash\nls\n```") == "a = 1"
    assert extract_code("no fences at all\nx = 1") == "no fences at all\nx = 1"
    assert extract_code("```python\ncut = 'off at the length limit'") == "cut = 'off at the length limit'"


def test_parallel_runs_stay_independent():
    barrier = threading.Barrier(3)

    def run(value: int) -> SandboxResult:
        barrier.wait()
        return run_tests(f"v = {value}", [f"assert v == {value}"], ROOMY)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, range(3)))
    assert [r.status for r in results] == ["ok"] * 3
