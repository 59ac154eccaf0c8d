"""The one benchmark harness: timing, peak memory, per-configuration process isolation, CSV rows, markdown tables.

Every benchmark in ``bench/`` uses these pieces:

- :func:`measure` times ``fn`` (``grpo_fast.benchmarking.time_calls``: CUDA events on CUDA, ``time.perf_counter``
  elsewhere, the device synchronised before each call) and reports the peak memory it needs beyond what was
  allocated before it ran. CUDA: the caching allocator's ``max_memory_allocated`` minus ``memory_allocated`` before
  the first call. CPU: torch keeps no allocator statistics, so freed heap memory is handed back to the OS
  (``malloc_trim``), the process's peak resident set (``VmHWM``) is reset (``/proc/self/clear_refs``) and read back
  after the calls, minus the resident set before the first call.
  RSS is per process, so a CPU measurement is only meaningful in a fresh process that holds nothing but the inputs:
  run each configuration through :func:`run_isolated`.
- :func:`run_isolated` calls ``module:function(**params)`` in a fresh Python process and returns its dict. A crash
  (out of memory, a signal, an exception) comes back as :class:`IsolatedError` with the reason, so one failing
  configuration becomes a CSV row with an ``error`` instead of ending the run.
- :func:`env_fields` gives the columns every row carries (device, library versions, git commit, a hash of the
  measured sources, date, command) and
  :func:`write_csv` writes one row per measurement. A benchmark run overwrites its CSV file (one file = one run, one
  command line); keep older results by passing another ``--csv`` path. :class:`CsvRows` writes the file again after
  every row, so a run stopped by a timeout or a kill keeps every row it finished.
"""

from __future__ import annotations

import csv
import ctypes
import datetime as _dt
import gc
import hashlib
import importlib
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# device_name: the benchmarks call harness.device_name (and tests replace it there)
from grpo_fast.benchmarking import device_name, dist_version, synchronize, time_calls

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = 1024 * 1024

# Columns every row ends with, in this order (benchmark-specific columns come first).
ENV_COLUMNS = ["device", "num_threads", "torch", "triton", "transformers", "liger_kernel", "grpo_fast", "commit",
               "src_sha", "date", "command"]
SOURCE_DIRS = ("grpo_fast", "kernels")  # the measured code; src_sha fingerprints it (tells "-dirty" trees apart)


# --------------------------------------------------------------------------------------------------------------------
# Timing and memory


@dataclass(frozen=True)
class Measurement:
    """Result of :func:`measure`. ``peak_extra_bytes``: peak memory during the calls minus memory before them."""

    median_ms: float
    min_ms: float
    times_ms: tuple[float, ...]
    peak_extra_bytes: int
    memory_method: str  # "cuda_allocator" or "rss_hwm"

    @property
    def peak_extra_mib(self) -> float:
        return self.peak_extra_bytes / MIB


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return _proc_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start or since the last :func:`reset_peak_rss`."""
    return _proc_status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0, ``echo 5 > /proc/self/clear_refs``). False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def trim_heap() -> None:
    """Collect garbage and hand freed malloc memory back to the OS (glibc ``malloc_trim``), so the RSS baseline
    holds live data only."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(fn, *, warmup: int, reps: int, device, setup=None) -> Measurement:
    """Time ``fn()`` ``reps`` times after ``warmup`` untimed calls; peak extra memory over all of them.

    ``setup()``, if given, runs untimed before every call (e.g. to drop last call's gradients so each call allocates
    its own, as a training step does). Peak memory covers warm-up, setup and timed calls, relative to what was
    allocated when ``measure`` was entered. On CPU the figure is process-wide RSS: see the module docstring. One-off
    costs of a first call (lazy imports, thread pools) count too: run the code once on tiny inputs beforehand.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"measure: need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    device = torch.device(device)
    synchronize(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        method = "cuda_allocator"
    else:
        trim_heap()
        if not reset_peak_rss():
            raise RuntimeError("measure: cannot reset the peak RSS (/proc/self/clear_refs); CPU memory unmeasurable")
        base = rss_bytes()
        method = "rss_hwm"

    times = time_calls(fn, device=device, reps=reps, warmup=warmup, setup=setup)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    return Measurement(
        median_ms=statistics.median(times),
        min_ms=min(times),
        times_ms=tuple(times),
        peak_extra_bytes=max(0, peak - base),
        memory_method=method,
    )


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------------------------------
# Process isolation


class IsolatedError(RuntimeError):
    """A configuration run by :func:`run_isolated` failed; the message says how (exit code, signal, last error)."""


def default_mem_limit(gib: float | None) -> int | None:
    """Address-space cap for :func:`run_isolated` on CPU: ``gib`` GiB, none for 0, else 90% of MemAvailable."""
    if gib == 0:
        return None
    if gib:
        return int(gib * 1024**3)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(0.9 * avail)


def _limit_memory(limit_bytes: int | None):
    def preexec():
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return preexec


def run_isolated(target: str, params: dict, *, timeout: float | None = None, mem_limit_bytes: int | None = None,
                 env: dict | None = None) -> dict:
    """Run ``target`` (``"package.module:function"``) as ``function(**params)`` in a fresh Python process.

    ``params`` and the returned dict must be JSON-serialisable. ``mem_limit_bytes`` caps the child's address space
    (``RLIMIT_AS``), so an oversized configuration fails with an allocation error in the child instead of waking the
    kernel's OOM killer. Raises :class:`IsolatedError` when the child does not return normally.
    """
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        params_path, result_path = Path(tmp) / "params.json", Path(tmp) / "result.json"
        params_path.write_text(json.dumps(params))
        child_env = dict(os.environ if env is None else env)
        # REPO_ROOT (for bench/) after the caller's entries: a path put first on purpose, such as gpu_check.sh's
        # link farm that maps grpo_fast.kernels without an install, keeps its precedence in the child
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [child_env.get("PYTHONPATH"), str(REPO_ROOT)]))
        cmd = [sys.executable, "-m", "bench.harness", target, str(params_path), str(result_path)]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env, capture_output=True, text=True, timeout=timeout,
                                  preexec_fn=_limit_memory(mem_limit_bytes))
        except subprocess.TimeoutExpired:
            raise IsolatedError(f"timed out after {timeout:.0f} s") from None
        if proc.returncode != 0 or not result_path.exists():
            raise IsolatedError(_describe_failure(proc.returncode, proc.stderr))
        return json.loads(result_path.read_text())


def _describe_failure(returncode: int, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        hint = " (the kernel's OOM killer?)" if sig == "SIGKILL" else ""
        return f"killed by {sig}{hint}" + (f"; last stderr: {last}" if last else "")
    if "can't allocate memory" in stderr or "MemoryError" in stderr or "out of memory" in stderr.lower():
        return f"out of memory: {last}"
    return f"exit code {returncode}: {last}"


def child_imports(modules: list[str]) -> dict:
    """``{module: its __file__}`` as a :func:`run_isolated` child imports them (gpu_check.sh checks with it that
    the benchmarks' child processes import grpo-fast from its link farm)."""
    return {name: importlib.import_module(name).__file__ for name in modules}


def _child_main(argv: list[str]) -> None:
    target, params_path, result_path = argv
    module_name, _, func_name = target.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(**json.loads(Path(params_path).read_text()))
    Path(result_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------------------------------
# Environment, CSV, tables


def version(dist: str) -> str:
    return dist_version(dist) or ""


def git_commit() -> str:
    """``git rev-parse --short HEAD``, plus ``-dirty`` when the tree (results files aside) differs from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", ".", ":(exclude)bench/results").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def source_hash(dirs=SOURCE_DIRS) -> str:
    """Short sha256 of the ``.py`` files under ``dirs`` (paths and contents): the code a row measured, exactly."""
    h = hashlib.sha256()
    for path in sorted(p for d in dirs for p in (REPO_ROOT / d).rglob("*.py")):
        h.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def command_line() -> str:
    """The command that started this process, as typed (``python -m pkg.mod ...`` stays in that form)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    argv[0] = "python"
    return shlex.join(argv)


def env_fields(device) -> dict:
    """The columns every CSV row carries: where, with what and from which code the number was measured.

    Call it right before each configuration starts (it is cheap), so that a tree that changes during a long run
    shows up as different ``commit`` / ``src_sha`` values instead of being attributed to the starting commit.
    """
    return {
        "device": device_name(device),
        "num_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "liger_kernel": version("liger-kernel"),
        "grpo_fast": version("grpo-fast"),
        "commit": git_commit(),
        "src_sha": source_hash(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command_line(),
    }


class CsvRows:
    """The rows of one run, written to ``path`` again (atomically, by :func:`write_csv`) after every :meth:`add`, so
    that a run stopped at any moment (a timeout, a kill, a crash) leaves each finished row on disk. A file already at
    ``path`` is removed at the start: the file holds this run's rows only."""

    def __init__(self, path):
        self.path = Path(path)
        self.rows: list[dict] = []
        self.path.unlink(missing_ok=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        write_csv(self.path, self.rows)
        return row


def write_csv(path, rows: list[dict]) -> Path:
    """Write ``rows`` (one per measurement) to ``path``, replacing the file. Columns: union of keys in first-seen
    order, with :data:`ENV_COLUMNS` last. Written to a temporary file first, so a crash never leaves half a CSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns and k not in ENV_COLUMNS]
    columns += [c for c in ENV_COLUMNS if any(c in row for row in rows)]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; numbers are right-aligned."""
    def cell(x):
        return f"{x:,.1f}" if isinstance(x, float) else str(x)

    body = [[cell(x) for x in r] for r in rows]
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
