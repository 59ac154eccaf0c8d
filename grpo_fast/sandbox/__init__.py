"""Run untrusted Python completions against tests: the sandbox behind the trainer's ``code`` reward.

In RL training the policy writes code and the reward is the fraction of tests it passes, so the code run here is
untrusted by construction: it may loop forever, fork, allocate without bound, flood its output, write files, open
sockets or print fake pass markers. :func:`run_tests` runs one completion and its tests in a fresh interpreter behind
these layers (:func:`isolation_layers` says which are active on this machine):

* **process**: ``sys.executable -I -S -B`` (isolated mode, no site-packages, no bytecode writes) in a session of its
  own, in a fresh temporary directory that is also its ``HOME`` and ``TMPDIR`` and is removed afterwards, with a
  scrubbed environment and stdin from ``/dev/null``. The parent enforces the wall-clock timeout and the output cap,
  and ends every run by sending SIGKILL to the child's whole process group.
* **rlimits** (set in the child, soft = hard): CPU time, address space, file size, open files, no core dumps.
* **namespaces and a disk budget**: where the kernel allows unprivileged user namespaces, the child moves into user,
  mount and network namespaces of its own (uid and gid mapped to themselves; a network with only a loopback device,
  down) and its directory becomes a tmpfs of ``disk_mb`` MiB and ``max_files`` inodes (``ENOSPC`` past either),
  which nobody else sees and which vanishes with the child. Elsewhere the parent's watchdog counts the directory's
  files and bytes at every poll and kills the child past either budget (status ``"disk_limit"``); a network
  namespace alone is still taken where allowed (as root).
* **Landlock** (:mod:`grpo_fast.sandbox.landlock`, Linux >= 5.13), after ``PR_SET_NO_NEW_PRIVS``: the kernel lets the
  child write only under its directory and read only the interpreter's trees and the system libraries; nothing
  executes; TCP bind and connect are refused (ABI >= 4); signals and abstract unix sockets cannot reach outside
  the sandbox (ABI >= 6); no process outside can be traced. A **seccomp** filter then refuses ``socket(2)`` and
  ``io_uring_setup(2)`` (Landlock leaves named unix sockets and UDP open; ``socketpair``, which asyncio needs,
  stays), and the child drops every capability.
* **audit hook** (:func:`sys.addaudithook`; Python code cannot remove one), a second layer with readable errors:
  blocks creating and signalling processes, every socket operation but creating an AF_UNIX socket (asyncio needs a
  socket pair), file-system changes and directory opens outside the working directory, opens under ``/proc``,
  ctypes, changing rlimits and walking the heap. The few dangerous calls that raise no audit event (``os.mknod``,
  ``os.mkfifo``, ``os.pidfd_open``, ``signal.pidfd_send_signal``, ``_posixsubprocess.fork_exec``) become stubs
  that raise.

**No reward is decided inside the sandbox.** The parent reads each test (:mod:`grpo_fast.sandbox.asserts`) and sends the
child only the expressions that use the completion (``f(2)`` of ``assert f(2) == 4``); the child evaluates them and
reports their values as plain data (:mod:`grpo_fast.sandbox.plain_data`: JSON of ints, strings, lists, dicts...) on a
pipe, one line per test, in order. The parent judges each assert itself, over those values and with the expected
values it kept. The completion shares the child's interpreter and can take it over (walk the stack, patch builtins,
write to the pipe, exit early): all that gains it is a say over the values reported, which still have to be right;
an object with a lying ``__eq__`` is not plain data, and a report out of order or out of form fails every test.

With Landlock (:func:`isolation_layers` lists ``landlock-<ABI>``) the kernel enforces the file-system, network and
signal confinement whatever the completion does, ctypes and raw system calls included. Without it (an older kernel, or
Landlock off at boot; :func:`code_reward` warns once and its metrics say so) only the audit hook guards files (seccomp
still refuses sockets), and it runs in the interpreter it guards: code written to defeat it (by patching the stdlib
functions it calls, by walking stack frames up to the harness) can, and reads are not confined at all (the dataset,
with the expected values, included: keep Landlock on where the tests are secret). Not confined in either case: the
interpreter's and system libraries' files, CPU and memory beyond the rlimits' accounting, and kernel bugs.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
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
from pathlib import Path
from typing import Any

from grpo_fast.sandbox import plain_data
from grpo_fast.sandbox.asserts import TestPlan, judge, parse_tests

logger = logging.getLogger("grpo_fast.train")

__all__ = [
    "PythonRun", "SandboxLimits", "SandboxResult", "code_reward", "extract_code", "isolation_layers", "json_test_list",
    "run_python", "run_tests", "sandbox_metrics",
]

# How a run ended (SandboxResult.status).
STATUSES = ("ok", "failed", "error", "timeout", "killed", "output_limit", "disk_limit")

TEMP_PREFIX = "grpo-sandbox-"  # name prefix of the per-run directories under tempfile.gettempdir()
_JOB_FILE = "job.json"  # what the child runs; it reads and deletes this file before running any of it
_MAX_OPEN_FILES = 64  # RLIMIT_NOFILE of the child
_MAX_WORKERS = 4  # most sandboxes code_reward runs at once (and at most one per CPU)
_READ_CHUNK = 1 << 16
_POLL_S = 0.05  # how often the parent checks whether the child has exited while it waits for output
_DRAIN_S = 1.0  # after the kill, how long the parent keeps reading what the pipes still hold
_DETAIL_CHARS = 500  # the most stderr characters kept in SandboxResult.detail
_DETAIL_FAILURES = 5  # the most failed tests SandboxResult.detail explains
_MAX_STATUS_LINE = 1 << 16  # the longest report line other than a test's values
_PYTHON_FENCE_TAGS = frozenset({"", "python", "python3", "py"})
_CHILD_PROGRAM = str(Path(__file__).with_name("_child.py"))  # what the child interpreter runs


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
        disk_mb: most MiB the files in the sandbox's directory may hold together. With the private tmpfs, writes
            past it fail with ``ENOSPC`` (``OSError``) in the child; with the watchdog the parent kills the child
            when it sees the directory past it, and the status is ``"disk_limit"``.
        max_files: most files and directories the sandbox's directory may hold, enforced like ``disk_mb``.
    """

    timeout_s: float = 5.0
    cpu_time_s: float = 4.0
    memory_mb: int = 512
    file_size_mb: int = 1
    max_output_bytes: int = 65536
    disk_mb: int = 16
    max_files: int = 256

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_time_s"):
            _check_limit(name, getattr(self, name), integer=False)
        for name in ("memory_mb", "file_size_mb", "max_output_bytes", "disk_mb", "max_files"):
            _check_limit(name, getattr(self, name), integer=True)


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    Attributes:
        passed: tests the parent judged passed, from the values the child reported (before the end, for a run that
            was stopped).
        total: tests given.
        status: how the run ended, one of :data:`STATUSES`: ``"ok"`` (every test passed), ``"failed"`` (the tests
            ran, some failed), ``"error"`` (the code did not compile or raised, so no test ran; the interpreter
            exited before answering every test; or its report broke protocol, which fails every test),
            ``"timeout"`` (past ``timeout_s``), ``"killed"`` (a signal ended it: the CPU-time limit, a crash),
            ``"output_limit"`` (past ``max_output_bytes``) or ``"disk_limit"`` (the watchdog saw the directory past
            ``disk_mb`` or ``max_files``).
        detail: the reason, if the run was stopped; why the first failed tests failed; the last characters of the
            child's stderr.
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

    A test is a string of assert statements (and imports), such as ``"assert f(2) == 4"``; it passes when every
    assert in it holds. The sandbox evaluates only the parts that use the code (``f(2)``), in the namespace the code
    defined, and the parent judges each assert over the plain values that come back; the rules, and the tests refused
    with a ``ValueError`` naming them (loops, assignments, function definitions, library calls run in the sandbox,
    comparisons of two sandbox values): :mod:`grpo_fast.sandbox.asserts`. A string is a single test, a list holds one
    test per item. Tests run one after the other, each on its own (one failing does not stop the next); a run that is
    stopped keeps the passes judged before it. The code runs as a module named ``solution``, so an ``if __name__ ==
    "__main__":`` block in it does not run, and only the standard library is importable (the interpreter starts
    without site-packages).
    """
    _require_linux()
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    snippets = [tests] if isinstance(tests, str) else list(tests)
    if not all(isinstance(test, str) for test in snippets):
        bad = next(test for test in snippets if not isinstance(test, str))
        raise TypeError(f"tests must be a str or a list of str, got an item {bad!r:.100} ({type(bad).__name__})")
    return _run_child(code, snippets, limits)[0]


@dataclass(frozen=True)
class PythonRun:
    """What :func:`run_python` saw: the start of what the code printed, the value of its last expression (``repr``
    of plain data, computed in the parent; None when the code ends with a statement or the value is None), and the
    error or the limit that stopped it (None when it ran to the end)."""

    stdout: str
    value: str | None
    error: str | None

    def text(self, max_chars: int) -> str:
        """The tool message: stdout, then the value or the error, cut to ``max_chars`` characters."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.value is not None:
            parts.append(self.value)
        if self.error is not None:
            parts.append(self.error)
        text, cut = "\n".join(parts), "... [truncated]"
        return text if len(text) <= max_chars else text[: max_chars - len(cut)] + cut


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), max_stdout_bytes: int = 8192) -> PythonRun:
    """Run ``code`` in a fresh sandboxed interpreter (the layers and limits of :func:`run_tests`) as a notebook cell
    runs: what it prints, and the value of its last line when that is an expression. Nothing is judged and nothing of
    it reaches a reward: this is the ``python`` tool's engine (:mod:`grpo_fast.agents.python_tool`). The value comes
    back as plain data (:mod:`~grpo_fast.sandbox.plain_data`) and is shown with ``repr`` here; a value that is not
    plain data (an object of a class the code defined, a function) is named by its type."""
    _require_linux()
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    body, last = _split_last_expression(code)
    plans = [TestPlan("", (("eval", last),), (), (last,), {})] if last is not None else []
    result, reports, stdout = _run_job(body, plans, limits, keep_stdout=max_stdout_bytes)
    value = None
    if reports.outcomes:
        (kind, outcome), = reports.outcomes[0]
        if kind == "value":
            value = None if outcome is None else _repr_value(outcome)
        elif kind == "not plain":
            value = f"<{outcome}>"
        else:
            result = SandboxResult(0, 1, "error", f"{outcome}")
    error = None
    if result.status not in ("ok", "failed"):
        error = _python_error(result)
    return PythonRun(stdout.decode("utf-8", "replace"), value, error)


def _split_last_expression(code: str) -> tuple[str, str | None]:
    """``code`` without its last statement when that is an expression, and that expression's source."""
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return code, None  # the child reports the error
    if not body or not isinstance(body[-1], ast.Expr):
        return code, None
    last = body[-1]
    lines = code.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: last.lineno - 1]) + len(
        lines[last.lineno - 1].encode("utf-8")[: last.col_offset].decode("utf-8", "replace"))
    return code[:start], ast.get_source_segment(code, last.value) or ast.unparse(last.value)


def _repr_value(value: Any) -> str:
    try:
        return repr(value)[:10_000]
    except ValueError:  # an int past Python's 4300-digit limit
        return f"<int of {value.bit_length()} bits>"


def _python_error(result: SandboxResult) -> str:
    """One line for the model: the exception the code raised, or the limit that stopped it."""
    if result.status == "error":
        for line in reversed(result.detail.splitlines()):
            if line.startswith("sandbox: the completion raised "):
                return line.removeprefix("sandbox: the completion raised ")
        last = result.detail.strip().splitlines()
        return last[-1] if last else "error"
    return f"{result.status}: {result.detail.splitlines()[0] if result.detail else ''}".rstrip(": ")


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
    reward-function signature and unused. Up to ``min(os.cpu_count(), 4)`` sandboxes run at once. A ``tests``
    value that is a string holding a JSON list of strings (as parquet files often store lists) counts as that list.
    Every test is read before any sandbox starts: one the parent cannot judge (:func:`run_tests`) raises
    ``ValueError`` naming it (``code_reward: tests[3][0]``).

    The first call finds the isolation layers (:func:`isolation_layers`) and warns once if the kernel offers no
    Landlock; ``code_reward.metrics()`` (:func:`sandbox_metrics`) reports them to the trainer's log.
    """
    _require_linux()
    if len(tests) != len(completions):
        raise ValueError(f"code_reward got {len(completions)} completions but {len(tests)} test lists")
    limits = SandboxLimits() if limits is None else limits
    isolation_layers()

    cases = []
    for i, case_tests in enumerate(tests):
        snippets = test_snippets(case_tests, f"code_reward: tests[{i}]")
        cases.append(parse_tests(snippets, f"code_reward: tests[{i}]") if snippets else None)

    def score(completion: str | list[dict[str, Any]], plans: list[TestPlan] | None) -> float | None:
        if not plans:
            return None
        return _run_plans(extract_code(_completion_text(completion)), plans, limits)[0].fraction

    with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, _MAX_WORKERS)) as pool:
        return list(pool.map(score, completions, cases))


@cache
def isolation_layers() -> tuple[str, ...]:
    """The isolation layers active on this machine, found by running an empty program in the sandbox (once).

    Always: ``"process-group"`` (fresh directory, scrubbed environment, wall-clock and output limits, the group
    kill), ``"rlimits"``, ``"no-new-privs"``, ``"no-capabilities"`` and ``"audit-hook"``. Where the kernel allows
    unprivileged user namespaces: ``"user-namespace"``, ``"network-namespace"`` and ``"disk-tmpfs"``, else
    ``"disk-watchdog"`` (and ``"network-namespace"`` alone where it allows that, as root). ``"landlock-<ABI>"``
    where the kernel has Landlock (without it this logs a warning, once, being cached); ``"seccomp"`` on x86_64 and
    aarch64.
    """
    _require_linux()
    result, layers = _run_child("", [], SandboxLimits())
    if not layers:
        raise RuntimeError(f"the sandbox could not start an interpreter ({result.status}): {result.detail}")
    disk = () if "disk-tmpfs" in layers else ("disk-watchdog",)
    if not any(layer.startswith("landlock-") for layer in layers):
        logger.warning(
            "the code sandbox runs without Landlock: this kernel (%s) does not offer it (Linux >= 5.13 with "
            "CONFIG_SECURITY_LANDLOCK, 'landlock' in the lsm= boot list). Writes outside the sandbox's directory "
            "are refused by the audit hook alone, which code written to defeat it can pass, and reads elsewhere "
            "are allowed; see docs/train.md.",
            os.uname().release,
        )
    return ("process-group", *layers, *disk)


def sandbox_metrics() -> dict[str, float]:
    """What the code reward reports to the trainer's metrics log (``code_reward.metrics``): ``landlock_abi`` (the
    Landlock ABI in force in the sandbox, 0 without Landlock) and ``disk_tmpfs`` (1 when the disk budget is a
    private tmpfs, 0 when the watchdog enforces it)."""
    layers = isolation_layers()
    abi = next((int(layer.split("-")[1]) for layer in layers if layer.startswith("landlock-")), 0)
    return {"landlock_abi": float(abi), "disk_tmpfs": float("disk-tmpfs" in layers)}


code_reward.metrics = sandbox_metrics  # type: ignore[attr-defined]


def test_snippets(value: Any, where: str) -> list[str] | None:
    """One sample's tests as :func:`run_tests` takes them: a list of strings as is; None as is (unscored); a string
    holding a JSON or Python list of strings parsed (parquet, pandas and CSV round trips store lists so); any other
    string that is plain code, one test. A string holding other data (``'[1, 2]'``, ``'{"input": ...}'``, ``'123'``)
    is refused with ``where`` in the message: run as a test, a literal passes for any code that parses."""
    if value is None or (isinstance(value, list) and all(isinstance(test, str) for test in value)):
        return value
    if isinstance(value, str):
        parsed = json_test_list(value)
        if parsed is not None:
            return parsed
        try:
            literal = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return [value]  # code, not data
        if isinstance(literal, list) and all(isinstance(test, str) for test in literal):
            return literal
        raise ValueError(f"{where}: a tests string must be test code or a list of test snippets, got "
                         f"{type(literal).__name__} data {value!r:.200}")
    raise ValueError(f"{where}: tests must be a list of test snippets (strings), a string or None, got "
                     f"{type(value).__name__} {value!r:.200}")


def json_test_list(value: str) -> list[str] | None:
    """The tests a string holds when it is a JSON list of strings (``'["assert f(1) == 2"]'``), else None."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    if isinstance(parsed, list) and all(isinstance(test, str) for test in parsed):
        return parsed
    return None


# ----------------------------------------------------------------------------------------------------- internals


def _require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            "grpo_fast.sandbox runs completions on Linux only (it relies on rlimits, process groups, /proc "
            f"and network namespaces); this platform is {sys.platform!r}"
        )


def _completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion: the string itself, or the content of the last message of a chat-message list."""
    if isinstance(completion, str):
        return completion
    return (completion[-1]["content"] or "") if completion else ""


class _Reports:
    """What the child said on its report channel, judged as it arrives.

    The report must be, line by line: the layers, how the completion ran (``{"code": "ok"}`` or ``"error"``), then
    for each test in order ``{"i": i, "r": outcomes}`` with one outcome per hole of that test (or ``{"i": i, "e":
    why}`` when its imports raised). Each test's outcomes are judged (:func:`~grpo_fast.sandbox.asserts.judge`) as
    its line arrives. Anything else (a line that does not parse, one out of order or of the wrong length, one past
    the last test, one longer than a test's values may take) breaks the report, and a broken report fails every
    test: a child that was taken over gains nothing by writing to the channel. Judging all the tests of a run may
    take the parent ``judge_s`` seconds in all; a check still running past them fails (as do the ones after it).
    """

    def __init__(self, plans: list[TestPlan], judge_s: float) -> None:
        self._plans = plans
        self._judge_left = judge_s  # the parent's own time for judging, whatever the values make it compute
        self._pending = bytearray()  # the start of a line the child has not ended yet
        self.layers: tuple[str, ...] = ()
        self.code: str | None = None  # "ok" or "error", once the child has said
        self.failures: list[str | None] = []  # per test answered: None if it passed, else why it failed
        self.outcomes: list[list[tuple[str, Any]]] = []  # per test answered: its holes' outcomes (run_python reads them)
        self.broken: str | None = None  # why the report broke protocol

    @property
    def passed(self) -> int:
        return sum(failure is None for failure in self.failures)

    @property
    def done(self) -> bool:
        """Whether the child has nothing more to say (or nothing more it says counts)."""
        return (self.broken is not None or self.code == "error"
                or (self.code == "ok" and len(self.failures) == len(self._plans)))

    def _line_limit(self) -> int:
        if self.code == "ok" and len(self.failures) < len(self._plans):
            holes = len(self._plans[len(self.failures)].holes)
            return plain_data.MAX_VALUE_CHARS + plain_data.LINE_OVERHEAD * (holes + 1)
        return _MAX_STATUS_LINE

    def feed(self, data: bytes) -> None:
        searched = len(self._pending)
        self._pending += data
        while self.broken is None:
            end = self._pending.find(b"\n", searched)
            if (len(self._pending) if end < 0 else end) > self._line_limit():
                self.broken = f"a line longer than the {self._line_limit()} bytes it may take"
            elif end < 0:
                return
            else:
                line = bytes(self._pending[:end])
                del self._pending[: end + 1]
                searched = 0
                self._handle(line)
        self._pending.clear()  # nothing more the child says counts, and it must not fill the parent's memory

    def _handle(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            self.broken = f"a line that is not JSON ({line[:60]!r})"
            return
        if self.done:
            self.broken = "a line after the last one"
        elif not self.layers:
            layers = message.get("layers") if type(message) is dict and len(message) == 1 else None
            if not (type(layers) is list and layers and all(type(name) is str for name in layers)):
                self.broken = f"a first line other than the layers ({line[:60]!r})"
            else:
                self.layers = tuple(layers)
        elif self.code is None:
            if message not in ({"code": "ok"}, {"code": "error"}):
                self.broken = f"a second line other than how the completion ran ({line[:60]!r})"
            else:
                self.code = message["code"]
        else:
            self._test(message)

    def _test(self, message: Any) -> None:
        index = len(self.failures)
        plan = self._plans[index]
        if type(message) is not dict or message.get("i") != index or type(message.get("i")) is not int:
            self.broken = f"test {index}'s line missing or out of order"
        elif message.keys() == {"i", "e"} and type(message["e"]) is str:
            self.failures.append(f"its imports raised {message['e'][:200]}")
        elif message.keys() == {"i", "r"} and type(message["r"]) is list and len(message["r"]) == len(plan.holes):
            try:
                values = [_outcome(outcome) for outcome in message["r"]]
            except (ValueError, ArithmeticError, RecursionError) as e:  # ArithmeticError: forged huge range ends
                self.broken = f"test {index}'s values do not parse: {e}"
                return
            started = time.monotonic()
            self.outcomes.append(values)
            self.failures.append(judge(plan, values, deadline=started + max(self._judge_left, 0.0)))
            self._judge_left -= time.monotonic() - started
        else:
            self.broken = f"test {index}'s line is not {len(plan.holes)} outcomes"


def _outcome(outcome: Any) -> tuple[str, Any]:
    """One hole's outcome as :func:`~grpo_fast.sandbox.asserts.judge` takes it, from its report form."""
    match outcome:
        case ["v", tree]:
            return "value", plain_data.from_tree(tree)
        case ["x", str(why)]:
            return "raised", why[:200]
        case ["n", str(why)]:
            return "not plain", why[:200]
    raise ValueError(f"an outcome other than ['v', value], ['x', str] or ['n', str]: {outcome!r:.60}")


class _Streams:
    """Reads the child's stdout, stderr and report channel, keeping only what the verdict needs."""

    def __init__(self, proc: subprocess.Popen, channel: int, reports: _Reports, keep_stdout: int = 0) -> None:
        self._stdout = proc.stdout.fileno()
        self._keep_stdout = keep_stdout
        self.stdout_head = b""  # the first keep_stdout bytes (run_python's output), nothing for run_tests
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
                if key.fd == self._stdout and len(self.stdout_head) < self._keep_stdout:
                    self.stdout_head += data[: self._keep_stdout - len(self.stdout_head)]
                if key.fd == self._stderr:
                    self.stderr_tail = (self.stderr_tail + data)[-4 * _DETAIL_CHARS :]

    def close(self) -> None:
        self._selector.close()


def _run_child(
    code: str, tests: list[str], limits: SandboxLimits, skip_layers: frozenset[str] = frozenset()
) -> tuple[SandboxResult, tuple[str, ...]]:
    """Run one job in a fresh sandboxed interpreter; returns the result and the layers the child reported.

    ``skip_layers`` (any of ``"namespaces"``, ``"landlock"``, ``"seccomp"``, ``"audit-hook"``) leaves layers out, so
    that tests can check that each of the others holds on its own.
    """
    return _run_plans(code, parse_tests(tests, "tests"), limits, skip_layers)


def _run_plans(
    code: str, plans: list[TestPlan], limits: SandboxLimits, skip_layers: frozenset[str] = frozenset()
) -> tuple[SandboxResult, tuple[str, ...]]:
    """:func:`_run_child` of tests already read."""
    result, reports, _ = _run_job(code, plans, limits, skip_layers)
    return result, reports.layers


def _run_job(
    code: str, plans: list[TestPlan], limits: SandboxLimits, skip_layers: frozenset[str] = frozenset(),
    keep_stdout: int = 0,
) -> tuple[SandboxResult, _Reports, bytes]:
    """:func:`_run_plans` with what :func:`run_python` also needs: the report and the first ``keep_stdout`` bytes
    of the child's stdout."""
    workdir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    channel_read, channel_write = os.pipe()
    try:
        job_file = os.path.join(workdir, _JOB_FILE)
        with open(job_file, "w", encoding="utf-8") as f:  # what the child runs: no expected value is in it
            json.dump({"code": code, "tests": [plan.steps for plan in plans], "channel": channel_write,
                       "rlimits": _rlimits(limits), "disk_bytes": limits.disk_mb << 20,
                       "max_files": limits.max_files, "skip_layers": sorted(skip_layers)}, f)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", _CHILD_PROGRAM, job_file],
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
            reports = _Reports(plans, limits.timeout_s)
            streams = _Streams(proc, channel_read, reports, keep_stdout)
            try:
                stopped = _supervise(proc, streams, reports, limits, workdir)
            finally:
                # Kill before reaping: while the leader is unreaped its pid, the group id, cannot be reused.
                _kill_group(proc.pid)
                deadline = time.monotonic() + _DRAIN_S
                while streams.open and (left := deadline - time.monotonic()) > 0:
                    streams.pump(left)
                streams.close()
        return _verdict(proc.returncode, stopped, streams, reports, len(plans), limits), reports, streams.stdout_head
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


def _supervise(
    proc: subprocess.Popen, streams: _Streams, reports: _Reports, limits: SandboxLimits, workdir: str
) -> str | None:
    """Read the child's output until it reports done, exits or passes a limit; returns why the parent stopped it
    (``"timeout"``, ``"disk_limit"``) or None. Without the private tmpfs, the directory is checked against the disk
    budget at every poll (the child's layers arrive before its code runs)."""
    deadline = time.monotonic() + limits.timeout_s
    next_disk_check = 0.0
    while not (streams.output_bytes > limits.max_output_bytes or reports.done or _has_exited(proc.pid)):
        now = time.monotonic()
        if now >= deadline:
            return "timeout"
        if now >= next_disk_check and "disk-tmpfs" not in reports.layers:
            if _over_disk_budget(workdir, limits):
                return "disk_limit"
            next_disk_check = now + _POLL_S
        streams.pump(min(deadline - now, _POLL_S))
    # once more at the end: a writer quicker than one poll must not finish over the budget unseen
    if "disk-tmpfs" not in reports.layers and _over_disk_budget(workdir, limits):
        return "disk_limit"
    return None


def _over_disk_budget(workdir: str, limits: SandboxLimits) -> bool:
    """Whether the directory holds more than ``limits.max_files`` entries or ``limits.disk_mb`` MiB of blocks.

    The walk stops as soon as either budget is passed, so a directory flooded with files costs the parent no more
    than ``max_files`` stat calls per check.
    """
    budget_bytes, files, used = limits.disk_mb << 20, 0, 0
    pending = [workdir]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError:  # made unreadable (mode 0o300, say): what it holds cannot be counted, so it counts as over
            return True
        for entry in entries:
            files += 1
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            # the larger of size and blocks: some file systems (ZFS, btrfs) report a fresh file's blocks only after
            # their next sync, and a sparse file counts at its size (the sandboxed code only hurts itself by that)
            used += max(info.st_blocks * 512, info.st_size)
            if files > limits.max_files or used > budget_bytes:
                return True
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
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
    returncode: int, stopped: str | None, streams: _Streams, reports: _Reports, total: int, limits: SandboxLimits
) -> SandboxResult:
    """Turn what the run left behind into a result; the checks go from the most to the least telling."""
    passed = reports.passed
    if streams.output_bytes > limits.max_output_bytes:
        status, reason = "output_limit", f"the output passed {limits.max_output_bytes} bytes"
    elif stopped == "disk_limit":  # also when the child had answered every test: a run past the budget scores nothing
        status, reason = "disk_limit", (f"the directory passed {limits.max_files} files or {limits.disk_mb} MiB")
        passed = 0
    elif reports.broken is not None:
        status, reason = "error", f"the sandbox's report broke protocol ({reports.broken}): every test fails"
        passed = 0
    elif reports.done:
        status, reason = ("error" if reports.code == "error" else "ok" if passed == total else "failed"), ""
    elif stopped == "timeout":
        status, reason = "timeout", f"still running after {limits.timeout_s:g} s"
    elif returncode < 0:
        status, reason = "killed", f"killed by {_signal_name(-returncode)}"
    else:
        status, reason = "error", f"the interpreter exited with code {returncode} before answering every test"
    failed = [f"test {i} failed: {why}"[:300] for i, why in enumerate(reports.failures) if why is not None]
    tail = streams.stderr_tail.decode("utf-8", "replace").strip()[-_DETAIL_CHARS:]
    parts = (reason, *failed[:_DETAIL_FAILURES], tail)
    return SandboxResult(passed, total, status, "\n".join(part for part in parts if part))


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
