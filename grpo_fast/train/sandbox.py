"""Run untrusted Python completions against test snippets: the sandbox behind the trainer's ``code`` reward.

In RL training the policy writes code and the reward is the fraction of tests it passes, so the code run here is
untrusted by construction: it may loop forever, fork, allocate without bound, flood its output, write files, open
sockets or print fake pass markers. :func:`run_tests` runs one completion and its tests in a fresh interpreter behind
these layers (:func:`isolation_layers` says which are active on this machine):

* **process**: ``sys.executable -I -S -B`` (isolated mode, no site-packages, no bytecode writes) in a session of its
  own, in a fresh temporary directory that is also its ``HOME`` and ``TMPDIR`` and is removed afterwards, with a
  scrubbed environment and stdin from ``/dev/null``. The parent enforces the wall-clock timeout and the output cap,
  and ends every run by sending SIGKILL to the child's whole process group.
* **rlimits** (set in the child, soft = hard): CPU time, address space, file size, open files, no core dumps.
* **audit hook** (:func:`sys.addaudithook`; Python code cannot remove one): blocks creating and signalling
  processes, every socket operation but creating an AF_UNIX socket (asyncio needs a socket pair), file-system changes
  and directory opens outside the working directory, opens under ``/proc``, ctypes, changing rlimits and walking the
  heap; reading files elsewhere stays allowed (the standard library needs it). Unlike ``RLIMIT_NPROC`` it also holds
  for root. The few dangerous calls that raise no audit event (``os.mknod``, ``os.mkfifo``, ``os.pidfd_open``,
  ``signal.pidfd_send_signal``, ``_posixsubprocess.fork_exec``) become stubs that raise.
* **network namespace**: where ``unshare(CLONE_NEWNET)`` is allowed (as root, usually) the child gets a network
  namespace of its own, whose only device is a loopback that is down.

Results come back on a pipe the completion is not told about, each line prefixed with a random per-run nonce, so
printing "PASS" gains nothing.

These layers are guard rails against what a policy does by accident or by naive reward hacking, not a security
boundary: the audit hook runs in the interpreter it guards, and code written to defeat it (by patching the stdlib
functions it calls, or by walking stack frames up to the harness) can. Tests that run in the completion's own
process can also be gamed from inside (say, by returning an object equal to everything). Where that matters, run the
trainer itself in a container or VM.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["SandboxLimits", "SandboxResult", "code_reward", "extract_code", "isolation_layers", "run_tests"]

# How a run ended (SandboxResult.status).
STATUSES = ("ok", "failed", "error", "timeout", "killed", "output_limit")

TEMP_PREFIX = "grpo-sandbox-"  # name prefix of the per-run directories under tempfile.gettempdir()
_JOB_FILE = "job.json"  # what the child runs; it reads and deletes this file before running any of it
_MAX_OPEN_FILES = 64  # RLIMIT_NOFILE of the child
_MAX_WORKERS = 4  # most sandboxes code_reward runs at once (and at most one per CPU)
_READ_CHUNK = 1 << 16
_POLL_S = 0.05  # how often the parent checks whether the child has exited while it waits for output
_DRAIN_S = 1.0  # after the kill, how long the parent keeps reading what the pipes still hold
_DETAIL_CHARS = 500  # the most stderr characters kept in SandboxResult.detail
_MAX_REPORT_LINE = 256  # the most bytes kept of a report line the child has not ended yet
_PYTHON_FENCE_TAGS = frozenset({"", "python", "python3", "py"})

# The first code the child interpreter runs: ``python -I -S -B -c _BOOTSTRAP JOB_FILE``. It sets the limits, enters
# a network namespace where it may, stubs the unaudited calls, installs the audit hook and runs the job. Everything
# after that shares the interpreter with the completion, so the hook and the test loop bind what they use beforehand.
_BOOTSTRAP = r'''
import json, os, resource, sys
import signal, _posixsubprocess  # loaded now so that stub_unaudited_calls can stub their C functions

CLONE_NEWNET = 0x40000000
AF_UNIX = 1  # socket.AF_UNIX on Linux; importing socket just for it would slow every run down


def set_rlimits(rlimits):
    """Apply each limit as both soft and hard limit, capped at the current hard limit (only root may raise it)."""
    for name, value in rlimits.items():
        which = getattr(resource, name)
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def unshare_network():
    """Move into a network namespace of our own (a loopback device, down); False where the kernel refuses."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) == 0
    except (OSError, AttributeError):
        return False


def stub_unaudited_calls():
    """Replace the dangerous calls that raise no audit event with stubs that raise, in the C module and wherever it
    is re-exported; the audit hook then refuses to import those C modules afresh."""
    def blocked(*args, **kwargs):
        raise PermissionError("sandbox: this call is not allowed")

    for c_module, py_module, names in (
        ("posix", "os", ("mknod", "mkfifo", "pidfd_open")),
        ("_signal", "signal", ("pidfd_send_signal",)),
        ("_posixsubprocess", None, ("fork_exec",)),
    ):
        for module in (sys.modules[c_module], sys.modules.get(py_module)):
            for name in names:
                if module is not None and hasattr(module, name):
                    setattr(module, name, blocked)


def make_audit_hook(workdir):
    """The audit hook that confines this interpreter to ``workdir``. It fails closed: an error inside it blocks the
    event. Everything it uses is bound here, as the completion may rebind module attributes and builtins later."""
    realpath, isdir, isabs, join, fsdecode, readlink = (
        os.path.realpath, os.path.isdir, os.path.isabs, os.path.join, os.fsdecode, os.readlink)
    is_instance, devnull = isinstance, os.devnull
    blocked_events = frozenset({
        # creating or signalling processes
        "os.exec", "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.posix_spawn", "os.system", "subprocess.Popen",
        # leaving the namespaces (3.12+), raising the limits, adding hooks
        "os.setns", "os.unshare", "resource.prlimit", "resource.setrlimit", "sys.addaudithook",
        # walking the heap or other threads' stacks, where the harness lives
        "gc.get_objects", "gc.get_referents", "gc.get_referrers", "sys._current_frames",
    })
    stubbed_modules = frozenset({"posix", "_signal", "_posixsubprocess"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # events that change the file system -> ((index of a path argument, index of its dir_fd argument or None), ...)
    path_events = {
        "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.link": ((0, 2), (1, 3)), "os.mkdir": ((0, 2),),
        "os.remove": ((0, 1),), "os.removexattr": ((0, None),), "os.rename": ((0, 2), (1, 3)),
        "os.rmdir": ((0, 1),), "os.setxattr": ((0, None),), "os.symlink": ((1, 2),), "os.truncate": ((0, None),),
        "os.utime": ((0, 3),),
    }

    def resolve(path, dir_fd=None):
        """The absolute path an event's path argument names (an int is an open file descriptor)."""
        if is_instance(path, int):
            return readlink(f"/proc/self/fd/{path}")
        path = fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not isabs(path):
            path = join(readlink(f"/proc/self/fd/{dir_fd}"), path)
        return realpath(path)

    def inside(path):
        return path == workdir or path.startswith(workdir + "/")

    def deny(event, path=None):
        where = "" if path is None else f" on {path!r}"
        raise PermissionError(f"sandbox: {event}{where} is not allowed")

    def hook(event, args):
        if event in blocked_events or event.startswith("ctypes."):
            deny(event)
        elif event.startswith("socket.") and not (event == "socket.__new__" and args[1] == AF_UNIX):
            deny(event)
        elif event == "import" and args[0] in stubbed_modules:
            deny(event, args[0])
        elif event == "open" and not is_instance(args[0], int):  # re-wrapping a descriptor we hold is fine
            target, flags = resolve(args[0]), args[2]
            if target == "/proc" or target.startswith("/proc/"):
                deny(event, target)
            # a directory descriptor would let the *at() calls (dir_fd=...) reach outside
            if not inside(target) and target != devnull and (flags & write_flags or isdir(target)):
                deny(event, target)
        elif event in path_events:
            for path_index, dir_fd_index in path_events[event]:
                target = resolve(args[path_index], None if dir_fd_index is None else args[dir_fd_index])
                if not inside(target):
                    deny(event, target)

    return hook


def run(code, tests, channel, nonce, layers):
    """Run the completion, then each test in its namespace, reporting on the channel as "<nonce> <words>" lines."""
    def line(*words):
        return (" ".join((nonce,) + words) + "\n").encode()

    # Bind every callable used after the completion has run and build every report line now: the completion shares
    # builtins and modules with this function and could otherwise rebind, say, builtins.exec.
    write, run_code, exit_now, failure = os.write, exec, os._exit, BaseException
    plan = [(test, line("pass", str(i)), f"sandbox: test {i} failed\n".encode()) for i, test in enumerate(tests)]
    code_error, done = line("code-error"), line("done")
    module = type(sys)("solution")  # a module of its own, so that dataclasses and pickle find the completion's
    sys.modules["solution"] = module
    namespace = module.__dict__
    write(channel, line("layers", ",".join(layers)))
    try:
        run_code(compile(code, "<completion>", "exec"), namespace)
    except failure as exc:
        namespace.clear()  # free what the code allocated (a huge list, say) before reporting
        try:
            message = f"sandbox: the completion raised {type(exc).__name__}: {exc}"[:1000]
        except failure:
            message = "sandbox: the completion raised an exception"
        write(channel, code_error)
        write(2, message.encode(errors="replace") + b"\n")
    else:
        for test, passed, failed in plan:
            try:
                run_code(test, namespace)
            except failure:
                write(2, failed)
            else:
                write(channel, passed)
    write(channel, done)
    exit_now(0)  # skip interpreter teardown: threads the completion started must not keep the process alive


def main(job_file):
    """Read and delete the job file, confine this interpreter, then run the job."""
    with open(job_file, encoding="utf-8") as f:
        job = json.load(f)
    os.remove(job_file)
    set_rlimits(job["rlimits"])
    layers = ["rlimits"]
    if unshare_network():
        layers.append("network-namespace")
    stub_unaudited_calls()
    sys.addaudithook(make_audit_hook(os.path.realpath(os.getcwd())))
    layers.append("audit-hook")
    run(job["code"], job["tests"], job["channel"], job["nonce"], layers)


main(sys.argv[1])
'''


def _check_limit(name: str, value: object, integer: bool) -> None:
    expected = "a positive int" if integer else "a positive, finite number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"SandboxLimits.{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if not (value > 0 and (integer or math.isfinite(value))):
        raise ValueError(f"SandboxLimits.{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use.

    Attributes:
        timeout_s: wall-clock seconds for the whole run (interpreter start-up, the code and every test); past it the
            parent kills the child's process group and the status is ``"timeout"``.
        cpu_time_s: CPU seconds the child may use (``RLIMIT_CPU``, rounded up to whole seconds); past it the kernel
            kills the child and the status is ``"killed"``.
        memory_mb: address space of the child in MiB (``RLIMIT_AS``); allocations past it raise ``MemoryError``.
        file_size_mb: largest file the child may write, in MiB (``RLIMIT_FSIZE``); larger writes raise ``OSError``.
        max_output_bytes: most bytes the child may write to stdout and stderr together; past it the parent kills it
            and the status is ``"output_limit"``. The parent keeps only a short tail of stderr, never the output.
    """

    timeout_s: float = 5.0
    cpu_time_s: float = 4.0
    memory_mb: int = 512
    file_size_mb: int = 1
    max_output_bytes: int = 65536

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_time_s"):
            _check_limit(name, getattr(self, name), integer=False)
        for name in ("memory_mb", "file_size_mb", "max_output_bytes"):
            _check_limit(name, getattr(self, name), integer=True)


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    Attributes:
        passed: tests that reported passing (before the end, for a run that was stopped).
        total: tests given.
        status: how the run ended, one of :data:`STATUSES`: ``"ok"`` (every test passed), ``"failed"`` (the tests
            ran, some failed), ``"error"`` (the code did not compile or raised, so no test ran; or the interpreter
            exited early), ``"timeout"`` (past ``timeout_s``), ``"killed"`` (a signal ended it: the CPU-time limit,
            a crash) or ``"output_limit"`` (past ``max_output_bytes``).
        detail: the reason, if the run was stopped, and the last characters of the child's stderr.
    """

    passed: int
    total: int
    status: str
    detail: str

    @property
    def fraction(self) -> float:
        """``passed / total``, 0.0 when there are no tests."""
        return self.passed / self.total if self.total else 0.0


def run_tests(code: str, tests: list[str] | str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code``, then each test, in one sandboxed interpreter and count the tests that pass.

    A test is a Python snippet such as ``"assert f(2) == 4"``, run in the namespace the code defined; it passes when
    it raises nothing. A string is a single test, a list holds one test per item. Tests run one after the other, each
    on its own (one failing does not stop the next); a run that is stopped keeps the passes reported before it.
    The code runs as a module named ``solution``, so an ``if __name__ == "__main__":`` block in it does not run,
    and only the standard library is importable (the interpreter starts without site-packages).
    """
    _require_linux()
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    snippets = [tests] if isinstance(tests, str) else list(tests)
    if not all(isinstance(test, str) for test in snippets):
        raise TypeError("tests must be a str or a list of str")
    return _run_child(code, snippets, limits)[0]


def extract_code(completion: str) -> str:
    """The code in a completion: its last fenced block tagged python (or untagged), else the whole text.

    A block the completion opens but never closes (a generation cut off at the length limit) runs to the end.
    """
    blocks: list[tuple[str, list[str]]] = []
    body: list[str] | None = None  # the lines of the open block, None outside blocks
    for text_line in completion.splitlines():
        fence = text_line.strip()
        if body is None and fence.startswith("```"):
            body = []
            blocks.append((fence[3:].strip().lower(), body))
        elif body is not None and fence.startswith("```"):
            body = None
        elif body is not None:
            body.append(text_line)
    python_blocks = [lines for tag, lines in blocks if tag in _PYTHON_FENCE_TAGS]
    return "\n".join(python_blocks[-1]) if python_blocks else completion


def code_reward(
    prompts: list[Any],
    completions: list[str | list[dict[str, Any]]],
    tests: list[list[str] | str | None],
    *,
    limits: SandboxLimits | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """TRL-style reward: the fraction of its tests the code in each completion passes.

    ``completions[i]`` is a string or a chat-message list (its last message's content counts); the code is
    :func:`extract_code` of it and ``tests[i]`` (a dataset column) is what :func:`run_tests` takes, or None or empty
    for a sample without tests, which scores None. ``prompts`` and other columns in ``kwargs`` are part of the
    reward-function signature and unused. Up to ``min(os.cpu_count(), 4)`` sandboxes run at once.
    """
    _require_linux()
    if len(tests) != len(completions):
        raise ValueError(f"code_reward got {len(completions)} completions but {len(tests)} test lists")
    limits = SandboxLimits() if limits is None else limits

    def score(completion: str | list[dict[str, Any]], case_tests: list[str] | str | None) -> float | None:
        if not case_tests:
            return None
        return run_tests(extract_code(_completion_text(completion)), case_tests, limits).fraction

    with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, _MAX_WORKERS)) as pool:
        return list(pool.map(score, completions, tests))


@cache
def isolation_layers() -> tuple[str, ...]:
    """The isolation layers active on this machine, found by running an empty program in the sandbox (once).

    ``"process-group"`` (fresh directory, scrubbed environment, wall-clock and output limits, the group kill),
    ``"rlimits"`` and ``"audit-hook"`` are always there; ``"network-namespace"`` where the kernel lets the child
    unshare its network namespace (usually only as root).
    """
    _require_linux()
    result, layers = _run_child("", [], SandboxLimits())
    if not layers:
        raise RuntimeError(f"the sandbox could not start an interpreter ({result.status}): {result.detail}")
    return ("process-group", *layers)


# ----------------------------------------------------------------------------------------------------- internals


def _require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            "grpo_fast.train.sandbox runs completions on Linux only (it relies on rlimits, process groups, /proc "
            f"and network namespaces); this platform is {sys.platform!r}"
        )


def _completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion: the string itself, or the content of the last message of a chat-message list."""
    if isinstance(completion, str):
        return completion
    return (completion[-1]["content"] or "") if completion else ""


class _Reports:
    """What the child said on its report channel; only lines that start with this run's nonce count."""

    def __init__(self, nonce: str, total: int) -> None:
        self._prefix = f"{nonce} ".encode()
        self._total = total
        self._pending = b""  # the start of a line the child has not ended yet
        self.passed: set[int] = set()
        self.layers: tuple[str, ...] = ()
        self.code_error = False
        self.done = False

    def feed(self, data: bytes) -> None:
        *lines, pending = (self._pending + data).split(b"\n")
        self._pending = pending[-_MAX_REPORT_LINE:]  # bounded, whatever the child writes
        for line in lines:
            if line.startswith(self._prefix):
                self._handle(line[len(self._prefix) :].decode("ascii", "replace").split())

    def _handle(self, words: list[str]) -> None:
        match words:
            case ["pass", index] if index.isdigit() and int(index) < self._total:
                self.passed.add(int(index))
            case ["layers", names]:
                self.layers = tuple(names.split(","))
            case ["code-error"]:
                self.code_error = True
            case ["done"]:
                self.done = True


class _Streams:
    """Reads the child's stdout, stderr and report channel, keeping only what the verdict needs."""

    def __init__(self, proc: subprocess.Popen, channel: int, reports: _Reports) -> None:
        self._stderr = proc.stderr.fileno()
        self._channel = channel
        self._reports = reports
        self._selector = selectors.DefaultSelector()
        for fd in (proc.stdout.fileno(), self._stderr, channel):
            self._selector.register(fd, selectors.EVENT_READ)
        self.output_bytes = 0  # stdout and stderr together
        self.stderr_tail = b""

    @property
    def open(self) -> bool:
        """Whether a stream has not reached end of file yet."""
        return bool(self._selector.get_map())

    def pump(self, timeout: float) -> None:
        """Read what arrives within ``timeout`` seconds."""
        for key, _ in self._selector.select(timeout):
            data = os.read(key.fd, _READ_CHUNK)
            if not data:
                self._selector.unregister(key.fd)
            elif key.fd == self._channel:
                self._reports.feed(data)
            else:
                self.output_bytes += len(data)
                if key.fd == self._stderr:
                    self.stderr_tail = (self.stderr_tail + data)[-4 * _DETAIL_CHARS :]

    def close(self) -> None:
        self._selector.close()


def _run_child(code: str, tests: list[str], limits: SandboxLimits) -> tuple[SandboxResult, tuple[str, ...]]:
    """Run one job in a fresh sandboxed interpreter; returns the result and the layers the child reported."""
    workdir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    channel_read, channel_write = os.pipe()
    try:
        nonce = secrets.token_hex(16)
        job_file = os.path.join(workdir, _JOB_FILE)
        with open(job_file, "w", encoding="utf-8") as f:
            json.dump({"code": code, "tests": tests, "channel": channel_write, "nonce": nonce,
                       "rlimits": _rlimits(limits)}, f)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, job_file],
                cwd=workdir,
                env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(channel_write,),
                start_new_session=True,  # its own process group, which the parent kills as a whole
            )
        finally:
            os.close(channel_write)  # the child holds the only write end now: end of file means it is gone
        with proc:
            reports = _Reports(nonce, len(tests))
            streams = _Streams(proc, channel_read, reports)
            try:
                timed_out = _supervise(proc, streams, reports, limits)
            finally:
                # Kill before reaping: while the leader is unreaped its pid, the group id, cannot be reused.
                _kill_group(proc.pid)
                deadline = time.monotonic() + _DRAIN_S
                while streams.open and (left := deadline - time.monotonic()) > 0:
                    streams.pump(left)
                streams.close()
        return _verdict(proc.returncode, timed_out, streams, reports, len(tests), limits), reports.layers
    finally:
        os.close(channel_read)
        _remove_tree(workdir)


def _rlimits(limits: SandboxLimits) -> dict[str, int]:
    """The child's rlimits by ``resource`` constant name (the parent does not import the POSIX-only module)."""
    return {
        "RLIMIT_CPU": math.ceil(limits.cpu_time_s),
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_FSIZE": limits.file_size_mb << 20,
        "RLIMIT_NOFILE": _MAX_OPEN_FILES,
        "RLIMIT_CORE": 0,
    }


def _supervise(proc: subprocess.Popen, streams: _Streams, reports: _Reports, limits: SandboxLimits) -> bool:
    """Read the child's output until it reports done, exits or passes a limit; True if the wall clock ran out."""
    deadline = time.monotonic() + limits.timeout_s
    while not (streams.output_bytes > limits.max_output_bytes or reports.done or _has_exited(proc.pid)):
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        streams.pump(min(left, _POLL_S))
    return False


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # something else in this process reaped it
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _verdict(
    returncode: int, timed_out: bool, streams: _Streams, reports: _Reports, total: int, limits: SandboxLimits
) -> SandboxResult:
    """Turn what the run left behind into a result; the checks go from the most to the least telling."""
    passed = len(reports.passed)
    if streams.output_bytes > limits.max_output_bytes:
        status, reason = "output_limit", f"the output passed {limits.max_output_bytes} bytes"
    elif reports.done:
        status, reason = ("error" if reports.code_error else "ok" if passed == total else "failed"), ""
    elif timed_out:
        status, reason = "timeout", f"still running after {limits.timeout_s:g} s"
    elif returncode < 0:
        status, reason = "killed", f"killed by {_signal_name(-returncode)}"
    else:
        status, reason = "error", f"the interpreter exited with code {returncode} before running every test"
    tail = streams.stderr_tail.decode("utf-8", "replace").strip()[-_DETAIL_CHARS:]
    return SandboxResult(passed, total, status, "\n".join(part for part in (reason, tail) if part))


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _remove_tree(path: str) -> None:
    """Delete a run's directory, also when the child left directories it took the permissions from."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):  # top-down: each directory is made readable before the walk enters it
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)
