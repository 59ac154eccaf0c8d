"""The code-reward sandbox: scoring, limits, and hostile completions that must not hurt the parent or leave traces.

Every test checks (through the autouse fixture) that no sandbox directory is left in the temp dir; the hostile ones
also check the status, the score and that the run returned within its wall-clock limit.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_fast.train.sandbox import (
    STATUSES,
    TEMP_PREFIX,
    SandboxLimits,
    SandboxResult,
    code_reward,
    extract_code,
    isolation_layers,
    run_tests,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox runs on Linux only")

FAST = SandboxLimits(timeout_s=2.0, cpu_time_s=2.0, memory_mb=256)
MARGIN_S = 1.5  # start-up, kill and clean-up on top of the wall-clock limit, on a busy 2-core machine
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOUBLE = "def f(x):\n    return 2 * x\n"


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


def _timed_run(code: str, tests: list[str] | str, limits: SandboxLimits = FAST) -> SandboxResult:
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
        "import asyncio, threading\nfrom collections import namedtuple\nfrom dataclasses import dataclass\n"
        "@dataclass\nclass Point:\n    x: int\nPair = namedtuple('Pair', 'a b')\n"
        "async def three():\n    return 3\n"
        "if __name__ == '__main__':\n    input()  # stdin is /dev/null: this would raise EOFError\n"
    )
    tests = [
        "assert Point(1).x == 1 and Pair(1, 2).b == 2",
        "assert asyncio.run(three()) == 3",
        "box = []\nt = threading.Thread(target=box.append, args=(1,))\nt.start()\nt.join()\nassert box == [1]",
        "import tempfile; f = tempfile.NamedTemporaryFile('w'); f.write('x'); f.flush()",
    ]
    result = _timed_run(code, tests)
    assert result.status == "ok", result.detail


def test_environment_is_scrubbed_and_isolated(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    tests = [
        "import os; assert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG'}, sorted(os.environ)",
        "import os; assert os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd()",
        f"import os; assert os.path.basename(os.getcwd()).startswith({TEMP_PREFIX!r})",
        "import sys; assert sys.flags.isolated and sys.flags.no_site and sys.flags.dont_write_bytecode",
        "import sys; assert not any('site-packages' in p for p in sys.path)",
        "import os; assert not os.path.exists('job.json')",  # the job file (which holds the nonce) is gone
        "import sys; assert sys.stdin.read() == ''",
    ]
    result = _timed_run("", tests)
    assert result.status == "ok", result.detail


def test_rlimits_are_set_in_the_child():
    limits = SandboxLimits(timeout_s=2.0, cpu_time_s=1.5, memory_mb=200, file_size_mb=1)
    tests = [
        "import resource as r; assert r.getrlimit(r.RLIMIT_CPU) == (2, 2)",
        "import resource as r; assert r.getrlimit(r.RLIMIT_AS) == (200 << 20, 200 << 20)",
        "import resource as r; assert r.getrlimit(r.RLIMIT_FSIZE) == (1 << 20, 1 << 20)",
        "import resource as r; assert r.getrlimit(r.RLIMIT_CORE) == (0, 0)",
        "import resource as r; assert r.getrlimit(r.RLIMIT_NOFILE)[1] <= 64",
        "f = open('big', 'wb')\ntry:\n    f.write(b'x' * (2 << 20)); f.flush()\nexcept OSError:\n    pass\n"
        "else:\n    raise AssertionError('wrote past RLIMIT_FSIZE')",
    ]
    result = _timed_run("", tests, limits)
    assert result.status == "ok", result.detail


def test_isolation_layers():
    layers = isolation_layers()
    assert {"process-group", "rlimits", "audit-hook"} <= set(layers)
    assert set(layers) <= {"process-group", "rlimits", "audit-hook", "network-namespace"}


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
    result = _timed_run("while True:\n    pass\n", ["assert True"], SandboxLimits(timeout_s=5.0, cpu_time_s=1.0))
    assert (result.passed, result.status) == (0, "killed")
    assert "SIGKILL" in result.detail


def test_tests_passed_before_a_timeout_count():
    # The CPU limit sits well above the wall clock, so the wall clock is what stops the loop (with both at 2 s the
    # kernel's CPU limit could fire first and the run ended "killed").
    limits = SandboxLimits(timeout_s=1.5, cpu_time_s=4.0)
    result = _timed_run(DOUBLE, ["assert f(1) == 2", "while True:\n    pass", "assert f(2) == 4"], limits)
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
        "import pty; pty.fork()",
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
    code = f"def attempt():\n    {probe}\n"
    result = _timed_run(code, ["try:\n    attempt()\nexcept PermissionError:\n    pass\nelse:\n    assert False"])
    assert result.status == "ok", result.detail


def test_completion_cannot_add_audit_hooks():
    # sys.addaudithook swallows the hook's PermissionError: the new hook is just not added.
    test = "import os, sys\nseen = []\nsys.addaudithook(lambda event, args: seen.append(event))\nos.listdir('.')\n"
    result = _timed_run("", [test + "assert seen == []"])
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


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut_off(stream):
    before = _resident_bytes()
    result = _timed_run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 10000)\n", ["assert True"])
    assert result.passed == 0
    assert result.status in ("output_limit", "timeout")
    assert len(result.detail) < 1000
    assert _resident_bytes() - before < 32 << 20


def test_fake_pass_markers_gain_nothing():
    code = (
        "import os\nprint('PASS')\nprint('PASS: 0')\n"
        "for fd in range(3, 64):\n"
        "    try:\n        os.write(fd, b'pass 0\\nPASS 0\\n0 pass 0\\ndone\\n')\n    except OSError:\n        pass\n"
    )
    result = _timed_run(code, ["assert False", "assert 1 == 2"])
    assert (result.passed, result.status) == (0, "failed")


def test_rebinding_builtins_does_not_fake_passes():
    code = "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\nbuiltins.BaseException = object\n"
    result = _timed_run(code, ["assert False"])
    assert (result.passed, result.status) == (0, "failed")


def test_early_exit_scores_zero():
    result = _timed_run("import os\nos._exit(0)\n", ["assert True"])
    assert (result.passed, result.status) == (0, "error")


def test_directories_without_permissions_are_removed():
    code = "import os\nos.makedirs('a/b')\nos.chmod('a/b', 0)\nos.chmod('a', 0)\nos.mkdir('c', 0)\n"
    result = _timed_run(code, ["assert True"])
    assert result.status == "ok", result.detail


# -------------------------------------------------------------------------------------------------- code_reward


def test_code_reward_on_strings_chat_messages_and_missing_tests():
    completions = [
        "Here you go:\n```python\ndef f(x):\n    return x + 1\n```\n",
        [{"role": "assistant", "content": "```python\ndef f(x):\n    return x\n```"}],
        "def f(x):\n    return x + 1\n",
        "no tests for this one",
        "nor for this one",
    ]
    tests = [["assert f(1) == 2", "assert f(2) == 3"], ["assert f(1) == 2", "assert f(0) == 0"], "assert f(0) == 1",
             None, []]
    rewards = code_reward(["prompt"] * 5, completions, tests, limits=FAST, answer=[None] * 5)
    assert rewards == [1.0, 0.5, 1.0, None, None]


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
        return run_tests(f"v = {value}", [f"assert v == {value}"], FAST)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, range(3)))
    assert [r.status for r in results] == ["ok"] * 3
