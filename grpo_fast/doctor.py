"""``grpo-fast doctor``: what this machine runs, and a one-minute check that it computes the right numbers.

Printed in this order (``--json FILE`` writes the same as JSON):

1. versions: Python, torch and the CUDA runtime it was built with, triton, transformers, grpo-fast, liger-kernel, the
   NVIDIA driver (``nvidia-smi``; else the CUDA driver API version torch sees);
2. the devices (name, ``sm_XY``, memory, SM count) and the implementation ``impl="auto"`` resolves to for each op and
   dtype, asked of ``grpo_fast.dispatch.resolve_impl`` itself, with the TF32 setting float32 GEMMs follow on CUDA;
3. a self-check on one device: ``grpo_loss`` forward + backward (DAPO, beta 0.04, old and reference log-probs near the
   policy so that clipping and the KL term are live) at three shapes, for every implementation (``triton`` on CUDA,
   ``torch``, ``reference``; Liger-Kernel's ``LigerFusedLinearGRPOLoss`` when installed). Each is compared with the
   float64 reference on the loss, the per-token log-probs, d hidden and d weight under the tolerance rule of
   ``grpo_fast.testing`` (``err <= 2 * err(reference at the same dtype) + atol[dtype]``); the table
   gives the worst of them, the median time of a few steps and the peak memory a step adds to its inputs (CUDA
   allocator; n/a on CPU, where torch keeps no allocator statistics).

Exit status 1 when a check fails or an implementation raises (the FAIL lines name it), 2 on bad arguments (a
``--json`` path that cannot be written is refused before the check; one that fails at the end gets the JSON
printed instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from grpo_fast.benchmarking import device_name, dist_version, liger_loss, synchronize, time_calls
from grpo_fast.dtypes import SHORT_DTYPES, dtype_name

DESCRIPTION = """\
Check this machine for grpo-fast: versions (torch, triton, transformers, CUDA, driver), the devices, which
implementation impl="auto" picks per op and dtype, then a self-check of at most --budget seconds on one device:
grpo_loss forward+backward at three shapes for the triton (CUDA only), torch and reference implementations (and
Liger-Kernel's LigerFusedLinearGRPOLoss when installed), each compared with the float64 reference under the
tolerance rule of grpo_fast.testing (err <= 2 * err(reference at the same dtype) + atol), with median time and
peak memory. Exit status 1 on any mismatch or failure.

On a CPU it checks the torch path: the Triton kernels need a CUDA GPU (TRITON_INTERPRET=1 runs them in Triton's
interpreter, for numerics only).
"""

MIB = 1024 * 1024
AUTO_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OPS = ("fused_logprobs", "grpo_loss", "grpo_loss_from_logps", "group_advantages")  # every op that calls resolve_impl
QUANTITIES = ("loss", "logps", "d_hidden", "d_weight")
LOSS = dict(loss_type="dapo", beta=0.04)  # TRL 1.16's defaults otherwise (epsilon 0.2, temperature 1.0)
HEADROOM = 0.5  # the largest shape may use this fraction of the free device memory


@dataclasses.dataclass(frozen=True)
class Shape:
    """One self-check shape: hidden ``[B, T, H]``, weight ``[V, H]``."""

    name: str
    B: int
    T: int
    H: int
    V: int

    @property
    def label(self) -> str:
        return f"{self.B}x{self.T}x{self.H}x{self.V}"


# Odd T and V (masked tails of tiles) at the small shape. CPU: the three shapes and their references take a few
# seconds on a 2-core CPU. CUDA: a 32k vocabulary, then Llama 3's 128256, shrunk in B x T to fit (_fit).
CPU_SHAPES = (Shape("small", 2, 37, 64, 515), Shape("medium", 2, 123, 128, 1151), Shape("large", 4, 96, 256, 3079))
CUDA_SHAPES = (Shape("small", 2, 123, 256, 1151), Shape("medium", 4, 512, 1024, 32000),
               Shape("large", 8, 512, 2048, 128256))


# --------------------------------------------------------------------------------------------------------------------
# Versions, devices, the auto path


def _driver() -> str:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0] + " (nvidia-smi)"
        except (OSError, subprocess.TimeoutExpired):
            pass
    if torch.cuda.is_available() and torch.version.cuda:
        v = torch._C._cuda_getDriverVersion()  # e.g. 13000: the CUDA version the driver supports
        return f"supports CUDA {v // 1000}.{v % 1000 // 10} (from torch; nvidia-smi not found)"
    return "none found (no nvidia-smi, no CUDA device)"


def _module_version(name: str) -> str:
    """For a module installed under another distribution name (ROCm's ``pytorch-triton-rocm`` provides triton)."""
    try:
        return importlib.import_module(name).__version__
    except ImportError:
        return "not installed"


def versions() -> dict[str, str]:
    import grpo_fast

    installed = dist_version("grpo-fast")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA runtime (torch built with)": torch.version.cuda or (f"none; HIP {torch.version.hip}" if torch.version.hip
                                                                 else "none (CPU build)"),
        "NVIDIA driver": _driver(),
        "triton": dist_version("triton") or _module_version("triton"),
        "transformers": dist_version("transformers") or "not installed",
        "grpo-fast": installed or f"{grpo_fast.__version__} (not installed: imported from {Path(grpo_fast.__file__).parent})",
        "liger-kernel": dist_version("liger-kernel") or "not installed",
    }


def devices() -> list[dict]:
    out = [{"device": "cpu", "name": device_name("cpu"), "torch_threads": torch.get_num_threads()}]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        arch = getattr(p, "gcnArchName", "") if torch.version.hip else f"sm_{p.major}{p.minor}"
        out.append({"device": f"cuda:{i}", "name": p.name, "arch": arch, "memory_gib": round(p.total_memory / 2**30, 1),
                    "sm_count": p.multi_processor_count})
    return out


def tf32_state() -> dict:
    """The settings that allow TF32 matmuls for float32 inputs on CUDA (the log-prob path's cuBLAS GEMMs follow them),
    and the verdict ``grpo_fast.dispatch.tf32_allowed`` draws from them. A setting torch refuses to read (the legacy flags
    after the new ``fp32_precision`` API was used) shows its error."""
    from grpo_fast.dispatch import tf32_allowed

    def read(get):
        try:
            return get()
        except RuntimeError as e:
            return f"unreadable ({str(e).splitlines()[0][:60]})"

    state = {"torch.backends.cuda.matmul.allow_tf32": read(lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
             "torch.get_float32_matmul_precision()": read(torch.get_float32_matmul_precision)}
    for owner, name in ((torch.backends.cuda.matmul, "torch.backends.cuda.matmul"), (torch.backends, "torch.backends")):
        try:  # torch >= 2.9
            getattr(owner, "fp32_precision")
        except AttributeError:
            continue
        except RuntimeError:
            pass
        state[f"{name}.fp32_precision"] = read(lambda owner=owner: owner.fp32_precision)
    state["TF32 allowed"] = tf32_allowed()
    return state


def auto_paths(device_names: list[str]) -> list[dict]:
    """``resolve_impl("auto", device, op, dtype)`` for every device, op and dtype (an error becomes its text)."""
    from grpo_fast.dispatch import resolve_impl

    rows = []
    for dev in device_names:
        for op in OPS:
            row = {"device": dev, "op": op}
            for dtype in AUTO_DTYPES:
                try:
                    row[dtype_name(dtype)] = resolve_impl("auto", torch.device(dev), op, dtype)
                except Exception as e:  # noqa: BLE001 (reported, not fatal: it is what a user would hit)
                    row[dtype_name(dtype)] = f"error: {type(e).__name__}: {e}"
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------------------------
# The self-check


def make_inputs(shape: Shape, device: torch.device, seed: int = 0) -> dict:
    """Seeded inputs (``grpo_fast.testing.loss_inputs``) in float64, cast per implementation. Uneven completion
    lengths (row 0 full); old and reference log-probs are the float64 policy's plus noise of 0.3, so that some ratios
    clip and the KL term is not tiny."""
    from grpo_fast.reference import logprobs_reference
    from grpo_fast.testing import loss_inputs

    return loss_inputs(shape.B, shape.T, shape.H, shape.V, seed=seed, device=device, draw_dtype=torch.float64,
                       full_first_row=True, logps_center=logprobs_reference, logps_noise=0.3, old_logps=True)


def make_step(impl: str, x: dict, dtype: torch.dtype):
    """``step()``: one forward + backward of ``impl`` on hidden and weight cast to ``dtype`` (fresh gradients each
    call); returns ``{quantity: tensor or None}``: the loss, per-token log-probs ``[B, T]``, d hidden ``[B, T, H]``
    and d weight ``[V, H]``."""
    from grpo_fast import GRPOLossConfig, grpo_loss

    config = GRPOLossConfig(**LOSS)
    hidden = x["hidden"].detach().to(dtype).requires_grad_(True)
    weight = x["weight"].detach().to(dtype).requires_grad_(True)
    liger = liger_loss(config) if impl == "liger" else None

    def step() -> dict:
        hidden.grad = weight.grad = None
        if liger is not None:
            loss, _metrics = liger(hidden, weight, x["target_ids"], x["completion_mask"], x["advantages"],
                                   ref_per_token_logps=x["ref_logps"], old_per_token_logps=x["old_logps"])
            logps = None  # Liger does not return them
        else:
            out = grpo_loss(hidden, weight, x["target_ids"], x["advantages"], x["completion_mask"],
                            old_logps=x["old_logps"], ref_logps=x["ref_logps"], config=config, impl=impl)
            loss, logps = out.loss, out.per_token_logps
        loss.backward()
        return {"loss": loss.detach(), "logps": logps, "d_hidden": hidden.grad, "d_weight": weight.grad}

    return step


def time_steps(step, device: torch.device, reps: int) -> tuple[float, int | None]:
    """Median milliseconds of ``reps`` calls (``grpo_fast.benchmarking.time_calls``: CUDA events on CUDA) and (CUDA)
    the peak allocated memory beyond what existed before them."""
    synchronize(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = time_calls(step, device=device, reps=reps)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return statistics.median(times), peak


def compare(out: dict, out_pt: dict, out_ref: dict, dtype: torch.dtype) -> dict:
    """``{quantity: {"err", "err_pt", "bound", "ok"}}`` under the rule, for the quantities ``out`` has."""
    from grpo_fast.testing import rule_error

    res = {}
    for q in QUANTITIES:
        if out.get(q) is None:
            continue
        err, err_pt, bound = rule_error(out[q], out_pt[q], out_ref[q], dtype)
        res[q] = {"err": err, "err_pt": err_pt, "bound": bound, "ok": bool(err <= bound)}
    return res


def _fit(shape: Shape, device: torch.device, dtype: torch.dtype) -> Shape:
    """``shape`` with B (then T) halved until the float64 reference's working set fits in HEADROOM of free memory."""
    if device.type != "cuda":
        return shape
    free, _total = torch.cuda.mem_get_info(device)

    # The float64 reference's forward + backward peaks at 32 bytes per [N, V] element (measured on a CPU: four float64
    # [N, V] tensors; the reference at fp32/bf16/fp16 peaks at 16, its float32 upcasts); 48 leaves room. The weight
    # lives as float64 input, gradient and kept gradient, and in ``dtype`` as those three again.
    def need(s: Shape) -> int:
        return 48 * s.B * s.T * s.V + 3 * s.V * s.H * (8 + torch.finfo(dtype).bits // 8)

    while need(shape) > HEADROOM * free and shape.B * shape.T > 256:
        shape = dataclasses.replace(shape, B=shape.B // 2) if shape.B > 1 else dataclasses.replace(shape, T=shape.T // 2)
    return shape


def self_check(device: torch.device, dtype: torch.dtype, shapes, budget_s: float, reps: int, log=print) -> list[dict]:
    """One row per (shape, implementation); see the module docstring. Rows past the time budget are skipped."""
    from grpo_fast.dispatch import triton_available

    deadline = time.perf_counter() + budget_s
    impls = ["reference", "torch"]
    if device.type == "cuda":
        impls.insert(1, "triton")
    if dist_version("liger-kernel"):
        impls.append("liger")
    rows = []
    seconds_per_work = None  # the float64 oracle's time per B*T*H*V, measured on the first shape
    for shape in shapes:
        shape = _fit(shape, device, dtype)
        base = dict(shape=shape.name, size=shape.label, dtype=dtype_name(dtype))
        work = shape.B * shape.T * shape.H * shape.V
        # the budget holds also for a shape's first steps: skip a shape whose float64 oracle alone (projected from
        # the last shape's, by its size: slow where float64 is, on consumer GPUs) would not fit what is left
        projected = 0.0 if seconds_per_work is None else seconds_per_work * work
        if time.perf_counter() + projected > deadline:
            why = (f"the {budget_s:g} s budget was spent" if time.perf_counter() > deadline else
                   f"its float64 oracle alone would take ~{projected:.0f} s, past the {budget_s:g} s budget")
            for impl in impls:
                rows.append(dict(base, impl=impl, status="skipped", message=why))
                log(format_row(rows[-1]))
            continue
        x = make_inputs(shape, device)
        t0 = time.perf_counter()
        ref = make_step("reference", x, torch.float64)()  # the float64 oracle
        synchronize(device)
        seconds_per_work = (time.perf_counter() - t0) / work
        outs = {}
        for impl in impls:
            row = dict(base, impl=impl)
            rows.append(row)
            if time.perf_counter() > deadline:
                row.update(status="skipped", message=f"the {budget_s:g} s budget was spent")
            elif impl == "triton" and not triton_available():
                row.update(status="n/a", message="triton is not installed: impl='auto' runs the torch path")
            else:
                _check_one(row, impl, x, dtype, ref, outs, device, reps, deadline)
            log(format_row(row))
        del x, ref, outs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _check_one(row, impl, x, dtype, ref, outs, device, reps, deadline) -> None:
    try:
        step = make_step(impl, x, dtype)
        t0 = time.perf_counter()
        out = step()  # also the warm-up: compiles the kernels
        synchronize(device)
        first_s = time.perf_counter() - t0
        outs[impl] = {q: None if v is None else v.detach().clone() for q, v in out.items()}
        del out
        if impl == "reference":  # the rule's baseline: its own error is the bound's, so it must at least be finite
            bad = [q for q in QUANTITIES if not torch.isfinite(outs[impl][q]).all()]
            row["errors"] = compare(outs[impl], outs[impl], ref, dtype)
            if bad or not all(torch.isfinite(ref[q]).all() for q in QUANTITIES):
                row.update(status="FAIL", message=f"non-finite outputs ({', '.join(bad) or 'float64 reference'})")
        elif "reference" not in outs:
            raise RuntimeError("no baseline for the rule: the reference at this dtype failed (see its row)")
        else:
            row["errors"] = compare(outs[impl], outs["reference"], ref, dtype)
        worst = max(row["errors"].items(), key=lambda kv: kv[1]["err"] / kv[1]["bound"])
        row["worst"] = worst[0]
        if "status" not in row:
            failed = [f"{q} error {e['err']:.3e} > bound {e['bound']:.3e}" for q, e in row["errors"].items()
                      if not e["ok"]]
            row.update(status="FAIL" if failed else "ok", message="; ".join(failed))
        n = max(1, min(reps, int((deadline - time.perf_counter()) / max(first_s, 1e-6))))
        median_ms, peak = time_steps(step, device, n)
        row.update(median_ms=round(median_ms, 3), reps=n, peak_mib=None if peak is None else round(peak / MIB, 1))
    except Exception as e:  # noqa: BLE001 (a failure of this implementation is the finding, the others still run)
        row.update(status="FAIL", message=f"raised {type(e).__name__}: {e}".splitlines()[0][:300])


def format_row(row: dict) -> str:
    worst = ""
    if row.get("worst"):
        e = row["errors"][row["worst"]]
        worst = f"{row['worst']} {e['err']:.1e} / {e['bound']:.1e}"
    ms = f"{row['median_ms']:.2f}" if "median_ms" in row else ""
    peak = "" if "median_ms" not in row else ("n/a" if row.get("peak_mib") is None else f"{row['peak_mib']:,.1f}")
    line = (f"  {row['shape']:<7}{row['size']:>22}  {row['impl']:<10}{row['status']:<8}{worst:<30}{ms:>10}"
            f"{peak:>11}")
    return line + (f"  {row['message']}" if row.get("message") else "")


TABLE_HEADER = (f"  {'shape':<7}{'B x T x H x V':>22}  {'impl':<10}{'check':<8}{'worst: err / bound':<30}"
                f"{'median ms':>10}{'peak MiB':>11}")


# --------------------------------------------------------------------------------------------------------------------
# The command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="device of the self-check: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(SHORT_DTYPES), default=None,
                   help="dtype of the self-check (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--shapes", nargs="+", choices=[s.name for s in CPU_SHAPES], default=None, metavar="NAME",
                   help="which of the shapes small, medium, large to check (default: all three)")
    p.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                   help="time for the self-check; what does not start within it is listed as skipped (default 60)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per row (default 5 on CUDA, 3 on CPU)")
    p.add_argument("--no-check", action="store_true", help="versions, devices and the auto paths only")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


def _device(arg: str | None) -> torch.device:
    if arg is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(arg)
    except RuntimeError as e:
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {arg!r} ({e})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {arg!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device: got {arg!r} but torch sees no CUDA device (torch {torch.__version__})")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device: got {arg!r} but torch sees {count} CUDA device(s)")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return device


def check_json_path(typed: str) -> Path:
    """``--json`` as a path; refuses, before anything runs, one that cannot be written: empty, a directory, a path
    below a file, a file or directory without write permission (a ValueError naming ``--json``)."""
    if not typed.strip():
        raise ValueError(f"--json: expected a file path, got an empty path {typed!r}")
    path = Path(typed)
    if path.is_dir():
        raise ValueError(f"--json: expected a file path, got the directory {str(path)!r}")
    existing = next(p for p in (path.parent, *path.parent.parents) if p.exists())  # what mkdir would start from
    if not existing.is_dir():
        raise ValueError(f"--json: cannot create {str(path)!r}: {str(existing)!r} is a file, not a directory")
    target = path if path.exists() else existing
    if not os.access(target, os.W_OK | (0 if target is path else os.X_OK)):
        raise ValueError(f"--json: cannot write {str(path)!r}: no write permission on {str(target)!r}")
    return path


def write_json(report: dict, path: Path, log=print) -> bool:
    """Writes the report; when that fails (the path changed during the run, a full disk) the JSON goes to ``log``
    instead and one line on stderr says where it could not go. Returns whether the file was written."""
    text = json.dumps(report, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        log(f"\nJSON (not written to {path}):\n{text}")
        print(f"grpo-fast doctor: error: --json: could not write {str(path)!r} ({e.strerror or e}); the results "
              "are printed above", file=sys.stderr)
        return False
    log(f"JSON: {path}")
    return True


def run(args: argparse.Namespace, log=print) -> int:
    """The whole command; returns the exit status."""
    try:
        device = _device(args.device)
        if args.reps is not None and args.reps < 1:
            raise ValueError(f"--reps: expected an integer >= 1, got {args.reps}")
        if not args.budget > 0:
            raise ValueError(f"--budget: expected seconds > 0, got {args.budget}")
        json_path = None if args.json is None else check_json_path(str(args.json))
    except ValueError as e:
        print(f"grpo-fast doctor: error: {e}", file=sys.stderr)
        return 2
    dtype = SHORT_DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions(), "devices": devices(),
              "tf32": tf32_state()}
    log("grpo-fast doctor\n\nversions")
    for k, v in report["versions"].items():
        log(f"  {k:<32}{v}")
    log("\ndevices")
    for d in report["devices"]:
        extra = f", {d['arch']}, {d['memory_gib']} GiB, {d['sm_count']} SMs" if "arch" in d else \
            f", torch threads {d['torch_threads']}"
        log(f"  {d['device']:<8}{d['name']}{extra}")
    report["auto"] = auto_paths([d["device"] for d in report["devices"]])
    log('\nimpl="auto" resolves to (grpo_fast.dispatch.resolve_impl("auto", device, op, dtype))')
    log("  TF32 matmuls (float32 GEMMs on CUDA follow them): "
        + ", ".join(f"{k} = {v!r}" for k, v in report["tf32"].items()))
    names = [dtype_name(t) for t in AUTO_DTYPES]
    log(f"  {'device':<8}{'op':<22}" + "".join(f"{n:<10}" for n in names))
    for r in report["auto"]:
        log(f"  {r['device']:<8}{r['op']:<22}" + "".join(f"{r[n]:<10}" for n in names))

    failures = []
    if not args.no_check:
        shapes = CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
        shapes = [s for s in shapes if args.shapes is None or s.name in args.shapes]
        reps = args.reps or (5 if device.type == "cuda" else 3)
        log(f"\nself-check on {device} ({device_name(device)}), {dtype_name(dtype)}: grpo_loss "
            f"forward+backward ({LOSS['loss_type']}, beta {LOSS['beta']}); err vs the float64 reference, worst of "
            f"{', '.join(QUANTITIES)}; bound = 2 * err(reference at this dtype) + atol (grpo_fast.testing)")
        log(TABLE_HEADER)
        t0 = time.perf_counter()
        rows = self_check(device, dtype, shapes, args.budget, reps, log)
        # Liger is a third-party baseline: its mismatches are reported, they do not fail grpo-fast's check
        failures = [r for r in rows if r["status"] == "FAIL" and r["impl"] != "liger"]
        liger_failures = [r for r in rows if r["status"] == "FAIL" and r["impl"] == "liger"]
        skipped = [r for r in rows if r["status"] == "skipped"]
        if device.type == "cuda" and not any(r["impl"] == "triton" and r["status"] == "ok" for r in rows):
            failures.append(dict(impl="triton", shape="any", size="-", dtype=dtype_name(dtype),
                                 message="no Triton row completed within the budget (raise --budget)"))
        report["self_check"] = {"device": str(device), "dtype": dtype_name(dtype), "reps": reps,
                                "budget_s": args.budget, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
        if device.type == "cpu":
            log("\nnote: this checked the torch path. The Triton path needs a CUDA GPU; on a CPU impl='auto' runs the "
                "torch path. TRITON_INTERPRET=1 (set before triton is imported) runs the Triton kernels in Triton's "
                "interpreter, for numerics only (slow; no measure of speed).")
        if skipped:
            log(f"\nnote: {len(skipped)} row(s) skipped: the {args.budget:g} s budget was spent (--budget)")
        for r in liger_failures:
            log(f"note: liger at shape {r['shape']} ({r['size']}, {r['dtype']}) differs: {r['message']} "
                "(a third-party baseline; not counted as a failure)")
        for r in failures:
            log(f"FAIL: {r['impl']} at shape {r['shape']} ({r['size']}, {r['dtype']}): {r['message']}")
        log(f"\n{'FAILED' if failures else 'OK'}: {sum(r['status'] == 'ok' for r in rows)} of {len(rows)} rows "
            f"passed in {report['self_check']['seconds']:.0f} s" + (f", {len(failures)} failed" if failures else "")
            + (f", {len(skipped)} skipped" if skipped else ""))
    report["ok"] = not failures
    written = write_json(report, json_path, log) if json_path is not None else True
    return 1 if failures else 0 if written else 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grpo-fast doctor", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
