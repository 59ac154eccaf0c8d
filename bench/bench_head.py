"""The loss head on a GPU, measured against the cost model's projection: ``fused_logprobs`` (Triton path) forward +
backward and the three bare lm_head GEMMs, in one process, per shape.

For every shape (N tokens, hidden size H, vocabulary V; bf16) on the current CUDA device this measures:

(a) ``logps = grpo_fast.fused_logprobs(hidden, weight, targets, impl="triton")`` and ``logps.backward(g)`` with a
    random upstream gradient ``g [N]`` (``--entropy``: also the entropy, with its own random upstream gradient), both
    hidden ``[N, H]`` and weight ``[V, H]`` requiring grad; the gradients are dropped before every call, so each call
    allocates its own as a training step does;
(b) the floor it is measured against: the three bare lm_head GEMMs of a step, ``logits = h @ W^T``,
    ``dh = dlogits @ W``, ``dW = dlogits^T @ h`` (6 N H V FLOPs), with a bf16 ``dlogits`` of the logits' shape. When
    the ``[N, V]`` logits and ``dlogits`` do not fit in free memory, the GEMMs run over vocabulary chunks (the same
    6 N H V FLOPs, ``dh`` accumulated chunk by chunk) and the row says so (``gemm_chunks`` > 1).

Timing: CUDA events around each call, the device synchronised before each (so host-side launch overhead shows as
GPU idle time, as in training); ``--warmup`` untimed calls, then the median of ``--reps``. Memory of (a):
``torch.cuda.max_memory_allocated`` during one more call, minus what was allocated before it, minus the outputs and
the gradients it returns: the temporaries, the quantity the cost model calls ``extra_bytes``. (This assumes the
outputs and both gradients exist at the peak, which holds for the launcher: the backward allocates both gradients
before its first chunk.) Correctness: the first rows' log-probs are checked against the float64 reference with the
project's tolerance rule (``grpo_fast.testing.rule_error``), so a broken kernel is never reported as fast.

Projection: ``bench.cost_model.project(N, H, V, dtype="bf16", device=PROFILE, ...)`` for the device profile that
matches the GPU (``match_profile``: by name, else the profile with the nearest SM count; ``--profile`` overrides), so
each row holds measured and projected time, GEMM time, their ratio and extra memory side by side. ``gemm_e_implied``
is the fraction of the profile's dense bf16 peak the bare GEMMs reached (6 N H V FLOPs / (peak x measured time);
only when the profile matched the GPU by name): the cost model's GEMM efficiency ``e`` as measured, the one kind of
figure that may replace the model's ``e`` (docs/gpu.md).

Rows go to ``--csv`` (the harness's convention: overwritten by each run, written again after every row, with the
device, versions, commit, date and command line) and, with ``--md``, a markdown table rewritten after every row.
``--dry-run`` needs no GPU: it prints the projection rows alone.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_head.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from bench.cost_model import PROFILES
from grpo_fast.benchmarking import time_calls
from grpo_fast.dtypes import SHORT_DTYPES
from grpo_fast.kernels.plan import nbytes

BENCHMARK = "head_fwd_bwd"
DTYPE = "bf16"
DEFAULT_SHAPES = ("4096x4096x151936", "16384x4096x151936")
CHECK_ROWS = 256  # rows of the fused log-probs checked against the float64 reference
# SM counts of the cost model's device profiles, for a GPU whose name matches none of them; a tie (H100 and H200 both
# have 132) resolves to the first in the cost model's order
PROFILE_SMS = {name: profile.sms for name, profile in PROFILES.items()}
# substring of the lower-cased device name (letters and digits only) -> profile
PROFILE_NAMES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("4090", "rtx4090"))


# --------------------------------------------------------------------------------------------------------------------
# Shapes, the device profile and the projection


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"NxHxV"`` -> ``(N, H, V)``, each a positive integer."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or min(map(int, m.groups())) < 1:
        raise argparse.ArgumentTypeError(f"a shape is NxHxV with positive integers (e.g. 16384x4096x151936), "
                                         f"got {text!r}")
    n, h, v = map(int, m.groups())
    return n, h, v


def match_profile(name: str, sm_count: int) -> tuple[str, str]:
    """``(profile, how)``: the cost model's profile for a GPU called ``name`` with ``sm_count`` SMs. By name when the
    name contains h200, h100, a100 or 4090 (case, spaces and dashes ignored); else the profile with the nearest SM
    count (ties: the first of ``PROFILE_SMS``). ``how`` says which rule decided."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for token, profile in PROFILE_NAMES:
        if token in key:
            return profile, f"by name ({name!r} contains {token!r})"
    profile = min(PROFILE_SMS, key=lambda p: abs(PROFILE_SMS[p] - sm_count))
    return profile, f"nearest by SM count ({name!r}: {sm_count} SMs; {profile}: {PROFILE_SMS[profile]})"


def project(n: int, h: int, v: int, *, profile: str, entropy: bool, budget_mib: float | None) -> dict:
    """The cost model's projection of (a) on ``profile``: ``bench.cost_model.project`` with both gradients wanted."""
    cost_model = importlib.import_module("bench.cost_model")
    return cost_model.project(n, h, v, dtype=DTYPE, device=profile, entropy=entropy, need_hidden=True,
                              need_weight=True, budget_mib=budget_mib)


def projection_fields(proj: dict) -> dict:
    """The projection's columns of a row."""
    return {"projected_ms": proj["projected_ms"], "projected_gemm_ms": proj["gemm_ms"],
            "projected_ratio": proj["ratio"], "projected_extra_mib": proj["extra_bytes"] / harness.MIB,
            "projected_launches": proj["launches"], "projected_flops_per_nhv": proj["flops_per_nhv"],
            "projected_hbm_gb": proj["hbm_bytes"] / 1e9}


def _base_row(shape, profile: str, how: str, args) -> dict:
    n, h, v = shape
    return {"benchmark": BENCHMARK, "N": n, "H": h, "V": v, "dtype": DTYPE, "entropy": args.entropy,
            "scratch_mib": args.scratch_mib or "", "profile": profile, "profile_match": how,
            "warmup": args.warmup, "reps": args.reps}


# --------------------------------------------------------------------------------------------------------------------
# Measurement (CUDA only)


def measure_fused(x: dict, *, entropy: bool, warmup: int, reps: int, seed: int) -> dict:
    """(a): times, extra memory and the correctness check of ``fused_logprobs`` forward + backward."""
    from grpo_fast import fused_logprobs
    from grpo_fast.reference import logprobs_reference
    from grpo_fast.testing import rule_error

    hidden, weight, y = x["hidden"], x["weight"], x["target_ids"]
    gen = torch.Generator(device=hidden.device).manual_seed(seed + 1)
    g = torch.randn(y.shape, generator=gen, device=hidden.device)
    ge = torch.randn(y.shape, generator=gen, device=hidden.device) if entropy else None

    def step():
        out = fused_logprobs(hidden, weight, y, return_entropy=entropy, impl="triton")
        if entropy:
            torch.autograd.backward(out, (g, ge))
        else:
            out.backward(g)
        return out

    def clear_grads():
        hidden.grad = None
        weight.grad = None

    times = time_calls(step, device=hidden.device, reps=reps, warmup=warmup, setup=clear_grads)

    clear_grads()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    outs = out if entropy else (out,)
    extra = peak - base - sum(map(nbytes, (*outs, hidden.grad, weight.grad)))

    rows = min(CHECK_ROWS, y.numel())
    h_chk, y_chk = hidden.detach().reshape(-1, hidden.shape[-1])[:rows], y.reshape(-1)[:rows]
    logps = outs[0].detach().reshape(-1)[:rows]
    with torch.no_grad():
        ref = logprobs_reference(h_chk.double(), weight.detach().double(), y_chk)
        pt = logprobs_reference(h_chk, weight.detach(), y_chk)
    err, _, bound = rule_error(logps, pt, ref, hidden.dtype)
    # d hidden of a row depends on that row alone: the checked rows' gradients against the reference's, and every
    # d weight entry finite (it sums over all rows: no per-row reference)
    gh = hidden.grad.reshape(-1, hidden.shape[-1])[:rows]

    def ref_grad(dtype):
        h_ = h_chk.to(dtype).clone().requires_grad_(True)
        res = logprobs_reference(h_, weight.detach().to(dtype), y_chk, return_entropy=entropy)
        lp, ent = res if entropy else (res, None)
        loss = (lp * g.reshape(-1)[:rows].to(lp.dtype)).sum()
        if entropy:
            loss = loss + (ent * ge.reshape(-1)[:rows].to(ent.dtype)).sum()
        loss.backward()
        return h_.grad

    gerr, _, gbound = rule_error(gh, ref_grad(hidden.dtype), ref_grad(torch.float64), hidden.dtype)
    w_finite = bool(torch.isfinite(weight.grad).all())
    clear_grads()
    fails = [f"logps error {err:.3e} > bound {bound:.3e}"] if err > bound else []
    fails += [f"d hidden error {gerr:.3e} > bound {gbound:.3e}"] if gerr > gbound else []
    fails += [] if w_finite else ["d weight not finite"]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "times_ms": times, "extra_bytes": extra,
            "check": "ok" if not fails else "FAIL: " + "; ".join(fails),
            "check_err": err, "check_bound": bound, "check_grad_err": gerr, "check_grad_bound": gbound}


def gemm_chunk(n: int, h: int, v: int, elem: int, free_bytes: int) -> int:
    """Vocabulary columns per chunk of the bare GEMMs: V when ``logits`` and ``dlogits`` ``[N, V]`` (with ``dh``
    ``[N, H]`` and ``dW`` ``[V, H]``) fit in 80% of ``free_bytes``, else the widest multiple of 128 whose two
    ``[N, C]`` buffers fit in half of what ``dh`` and ``dW`` leave."""
    fixed = (n * h + v * h) * elem
    if 2 * n * v * elem + fixed <= 0.8 * free_bytes:
        return v
    c = int((0.5 * free_bytes - fixed) // (2 * n * elem)) // 128 * 128
    if c < 128:
        raise MemoryError(f"the bare GEMMs need at least {(fixed + 2 * n * 128 * elem) / harness.MIB:,.0f} MiB, "
                          f"{free_bytes / harness.MIB:,.0f} MiB are free")
    return min(c, v)


def bare_gemms(hidden, weight, dlogits, chunk: int):
    """The three lm_head GEMMs of a step over vocabulary chunks of ``chunk`` columns, as one callable, and its
    outputs ``(logits, dh, dw)``. hidden ``[N, H]``, weight ``[V, H]``, dlogits ``[N * chunk]`` (flat: every chunk
    reads its first ``N * C`` elements as a contiguous ``[N, C]`` matrix, so the last, narrower chunk needs no copy).
    With ``D`` the ``[N, V]`` concatenation of those views, a call leaves ``dh = D @ W``, ``dw = D^T @ h`` and in
    ``logits`` the last chunk's ``h @ W[c0:]^T``: 6 N H V FLOPs whatever ``chunk`` is."""
    (n, h), v = hidden.shape, weight.shape[0]
    logits = torch.empty(n * chunk, dtype=hidden.dtype, device=hidden.device)
    dh = torch.empty(n, h, dtype=hidden.dtype, device=hidden.device)
    dw = torch.empty(v, h, dtype=hidden.dtype, device=hidden.device)
    bounds = [(c0, min(c0 + chunk, v)) for c0 in range(0, v, chunk)]

    def gemms():
        for i, (c0, c1) in enumerate(bounds):
            w, dl = weight[c0:c1], dlogits[:n * (c1 - c0)].view(n, c1 - c0)
            torch.mm(hidden, w.t(), out=logits[:n * (c1 - c0)].view(n, c1 - c0))
            if i == 0:
                torch.mm(dl, w, out=dh)
            else:
                dh.addmm_(dl, w)
            torch.mm(dl.t(), hidden, out=dw[c0:c1])

    return gemms, (logits, dh, dw)


def measure_gemms(x: dict, *, warmup: int, reps: int, seed: int) -> dict:
    """(b): times of the three bare lm_head GEMMs (6 N H V FLOPs), over vocabulary chunks when [N, V] does not fit."""
    hidden = x["hidden"].detach().reshape(-1, x["hidden"].shape[-1])
    weight = x["weight"].detach()
    (n, h), v, elem = hidden.shape, weight.shape[0], hidden.element_size()
    torch.cuda.empty_cache()  # (a)'s cached blocks back to the driver, so that mem_get_info sees them as free
    chunk = gemm_chunk(n, h, v, elem, torch.cuda.mem_get_info()[0])
    gen = torch.Generator(device=hidden.device).manual_seed(seed + 2)
    dlogits = torch.randn(n * chunk, generator=gen, device=hidden.device, dtype=hidden.dtype).mul_(1e-3)
    gemms, _ = bare_gemms(hidden, weight, dlogits, chunk)
    times = time_calls(gemms, device=hidden.device, reps=reps, warmup=warmup)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "chunks": math.ceil(v / chunk),
            "chunk": chunk}


def measure_shape(shape, *, entropy: bool, warmup: int, reps: int, seed: int, device: str = "cuda") -> dict:
    """(a) and (b) on one shape, the same inputs (``grpo_fast.testing.loss_inputs``, as ``bench.bench_loss`` draws
    them: hidden ~ N(0, 1), weight ~ N(0, 1 / H), uniform targets). ``device``: CUDA; the CPU tests pass "cpu" with
    the CUDA timers replaced."""
    from grpo_fast.testing import loss_inputs

    n, h, v = shape
    x = loss_inputs(1, n, h, v, seed=seed, device=device, dtype=SHORT_DTYPES[DTYPE], requires_grad=True)
    x = {k: x[k] for k in ("hidden", "weight", "target_ids")}  # the loss's other inputs are not needed here
    fused = measure_fused(x, entropy=entropy, warmup=warmup, reps=reps, seed=seed)
    gemm = measure_gemms(x, warmup=warmup, reps=reps, seed=seed)
    return {"fused": fused, "gemm": gemm}


def measured_fields(shape, res: dict, proj: dict | None, by_name: bool) -> dict:
    """The measured columns of a row, with the comparisons against the projection. ``gemm_e_implied``: the
    fraction of the profile's dense peak (``proj["profile"]["peak_tflops"]``) the bare GEMMs reached, i.e. the cost
    model's GEMM efficiency ``e`` as measured; only when the profile matched the GPU by name."""
    fused, gemm = res["fused"], res["gemm"]
    gemm_tflops = harness.tflops(6 * math.prod(shape), gemm["median_ms"])
    row = {"measured_ms": round(fused["median_ms"], 3), "measured_min_ms": round(fused["min_ms"], 3),
           "measured_gemm_ms": round(gemm["median_ms"], 3), "measured_gemm_min_ms": round(gemm["min_ms"], 3),
           "measured_ratio": round(fused["median_ms"] / gemm["median_ms"], 3),
           "measured_extra_mib": round(fused["extra_bytes"] / harness.MIB, 1),
           "gemm_tflops": round(gemm_tflops, 1), "gemm_chunks": gemm["chunks"],
           "gemm_note": "" if gemm["chunks"] == 1 else
           f"[N, V] does not fit: GEMMs in {gemm['chunks']} vocabulary chunks of {gemm['chunk']}, the same 6NHV",
           "check": fused["check"], "times_ms": ";".join(f"{t:.2f}" for t in fused["times_ms"])}
    if proj is not None:
        row["measured_vs_projected"] = round(fused["median_ms"] / proj["projected_ms"], 3)
        row["gemm_measured_vs_projected"] = round(gemm["median_ms"] / proj["gemm_ms"], 3)
        peak = proj.get("profile", {}).get("peak_tflops") if by_name else None
        row["gemm_e_implied"] = round(gemm_tflops / peak, 3) if peak else ""
    return row


# --------------------------------------------------------------------------------------------------------------------
# Output


TABLE_HEADERS = ["shape (N x H x V)", "measured ms", "GEMM ms", "ratio", "projected ms", "proj. GEMM ms",
                 "proj. ratio", "extra MiB", "proj. extra MiB", "profile", "check"]


def results_table(rows: list[dict]) -> str:
    """Markdown: measured against projected, one line per shape (times in ms to 0.01, memory in MiB to 0.1)."""
    def fmt(row, key, spec):
        x = row.get(key, "")
        return format(x, spec) if isinstance(x, (int, float)) else ""

    body = []
    for r in rows:
        measured, projected = "measured_ms" in r, "projected_ms" in r
        note = (r["check"] + (f"; {r['gemm_note']}" if r.get("gemm_note") else "")) if measured else r.get("status", "")
        body.append([f"{r['N']} x {r['H']} x {r['V']}", fmt(r, "measured_ms", ".2f"), fmt(r, "measured_gemm_ms", ".2f"),
                     fmt(r, "measured_ratio", ".2f") + "x" * measured, fmt(r, "projected_ms", ".2f"),
                     fmt(r, "projected_gemm_ms", ".2f"), fmt(r, "projected_ratio", ".2f") + "x" * projected,
                     fmt(r, "measured_extra_mib", ",.1f"), fmt(r, "projected_extra_mib", ",.1f"), r["profile"],
                     note[:80]])
    return harness.markdown_table(TABLE_HEADERS, body)


class Outputs:
    """The CSV (``harness.CsvRows``) and, when asked, the markdown table, both rewritten after every row."""

    def __init__(self, csv_path: Path | None, md_path: Path | None):
        self.csv = harness.CsvRows(csv_path) if csv_path else None
        self.md = md_path
        self.rows: list[dict] = []
        if md_path:
            md_path.unlink(missing_ok=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        if self.csv:
            self.csv.add(row)
        if self.md:
            self.md.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.md.with_name(self.md.name + ".tmp")
            tmp.write_text(results_table(self.rows) + "\n")
            tmp.replace(self.md)
        return row


# --------------------------------------------------------------------------------------------------------------------
# The driver


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_head",
        description="Measure the loss head on the current CUDA GPU, bf16: grpo_fast.fused_logprobs (impl='triton') "
                    "forward + backward with a random upstream gradient (gradients for hidden and weight), and the "
                    "three bare lm_head GEMMs (logits, d hidden, d weight: 6 N H V FLOPs) in the same run; print "
                    "each next to bench.cost_model's projection for the matching device profile.",
        epilog="Columns: measured_ms / measured_gemm_ms = measured_ratio (docs/design.md §7 aims at 1.25), against "
               "projected_ms / projected_gemm_ms = projected_ratio; measured_extra_mib (peak memory beyond inputs, "
               "outputs and gradients) against projected_extra_mib; gemm_e_implied: the fraction of the profile's "
               "dense peak the bare GEMMs reached (the cost model's GEMM e, measured).\n"
               "Examples:\n"
               "  python -m bench.bench_head                                  # N=4096 and 16384, H=4096, V=151936\n"
               "  python -m bench.bench_head --shapes 65536x8192x128256 --csv head.csv\n"
               "  python -m bench.bench_head --dry-run --profile a100         # the projections alone, no GPU needed\n"
               "Without a CUDA device (and without --dry-run) it exits with status 1.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES],
                   metavar="NxHxV", help=f"shapes to run (default {' '.join(DEFAULT_SHAPES)})")
    p.add_argument("--entropy", action="store_true",
                   help="also return the entropy, with its own random upstream gradient (default: log-probs only)")
    p.add_argument("--scratch-mib", type=float, default=None, metavar="MIB",
                   help="the launchers' temporaries budget (sets GRPO_FAST_SCRATCH_MIB and the projection's "
                        "budget_mib; default: the launchers' default, 64)")
    p.add_argument("--profile", choices=sorted(PROFILE_SMS), default=None,
                   help="cost-model device profile to project on (default: the one matching the GPU; see "
                        "match_profile; h100 for a --dry-run without a GPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per measurement (default 2)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per measurement; the median is reported "
                                                       "(default 5)")
    p.add_argument("--budget-s", type=float, default=120.0, metavar="S",
                   help="seconds for the whole run: a shape whose timed calls would end past the budget (estimated "
                        "from the previous shape's, scaled by N H V) is not started and its row says so "
                        "(default 120)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--csv", type=Path, default=None,
                   help="output CSV, overwritten (default bench/results/head_cuda.csv; a --dry-run writes one only "
                        "when given)")
    p.add_argument("--md", type=Path, default=None, help="also write the results table, in markdown, to this file")
    p.add_argument("--dry-run", action="store_true",
                   help="print the cost model's projection rows only: no GPU, nothing measured")
    return p


def _parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.warmup < 0 or args.reps < 1:
        p.error(f"--warmup must be >= 0 and --reps >= 1, got --warmup {args.warmup} --reps {args.reps}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.scratch_mib is not None and not args.scratch_mib > 0:
        p.error(f"--scratch-mib must be a positive number of MiB, got {args.scratch_mib}")
    return args


def _cuda_profile(args) -> tuple[str, str]:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if args.profile:
        return args.profile, f"--profile (the GPU is {props.name!r})"
    return match_profile(props.name, props.multi_processor_count)


def dry_run(args) -> int:
    if args.profile:
        profile, how = args.profile, "--profile"
    elif torch.cuda.is_available():
        profile, how = _cuda_profile(args)
    else:
        profile, how = "h100", "no GPU here: the reference profile of the targets (docs/design.md §7)"
    out = Outputs(args.csv, args.md)
    for shape in args.shapes:
        row = _base_row(shape, profile, how, args)
        row.update(projection_fields(project(*shape, profile=profile, entropy=args.entropy,
                                             budget_mib=args.scratch_mib)))
        row.update(status="projected only (--dry-run)", **harness.env_fields("cpu"))
        out.add(row)
    print(f"cost-model projection, profile {profile} ({how}); nothing measured")
    print(results_table(out.rows))
    return 0


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.scratch_mib is not None:
        os.environ["GRPO_FAST_SCRATCH_MIB"] = repr(args.scratch_mib)
    if args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print("bench_head: torch sees no CUDA device, so there is nothing to measure here; --dry-run prints the "
              "cost model's projections without one", file=sys.stderr)
        return 1

    t_start = time.perf_counter()
    profile, how = _cuda_profile(args)
    by_name = how.startswith("by name")
    out = Outputs(args.csv or harness.RESULTS_DIR / "head_cuda.csv", args.md)
    env0 = harness.env_fields("cuda")
    print(f"loss head fwd+bwd on {env0['device']} (profile {profile}: {how}), torch {env0['torch']}, triton "
          f"{env0['triton']}, commit {env0['commit']}; {len(args.shapes)} shape(s), warmup {args.warmup}, reps "
          f"{args.reps}, budget {args.budget_s:.0f} s", flush=True)
    failed = False
    last = None  # (N H V, seconds of its timed calls) of the last shape measured: scales the next shape's estimate
    calls = args.warmup + args.reps + 1  # the memory pass is one more call of (a)
    for shape in args.shapes:
        row = _base_row(shape, profile, how, args)
        label = "N={} H={} V={}".format(*shape)
        try:
            proj = project(*shape, profile=profile, entropy=args.entropy, budget_mib=args.scratch_mib)
            row.update(projection_fields(proj))
        except Exception as e:  # noqa: BLE001 (the measurement is still worth having; the row says why)
            proj = None
            row["projection_error"] = f"{type(e).__name__}: {e}"
            print(f"  {label}: no projection: {row['projection_error']}", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - t_start
        estimate = last[1] * math.prod(shape) / last[0] if last else 0.0
        if elapsed + estimate > args.budget_s:
            row.update(status=f"skipped: {elapsed:.0f} s spent + about {estimate:.0f} s needed > budget "
                              f"{args.budget_s:.0f} s", **harness.env_fields("cuda"))
            out.add(row)
            print(f"  {label}: {row['status']}", flush=True)
            continue
        print(f"  {label} ... ", end="", flush=True)
        env = harness.env_fields("cuda")  # per row: the code this shape is about to run
        t0 = time.perf_counter()
        try:
            res = measure_shape(shape, entropy=args.entropy, warmup=args.warmup, reps=args.reps, seed=args.seed)
        except Exception as e:  # noqa: BLE001 (out of memory, a kernel that fails: a row with the reason)
            failed = True
            row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", **env)
            out.add(row)
            print(row["status"], flush=True)
            traceback.print_exc()
            continue
        finally:
            torch.cuda.empty_cache()
        wall = time.perf_counter() - t0
        last = (math.prod(shape), calls * (res["fused"]["median_ms"] + res["gemm"]["median_ms"]) / 1e3)
        row.update(measured_fields(shape, res, proj, by_name))
        failed |= row["check"] != "ok"
        row.update(status="measured", **env)
        out.add(row)
        versus = f" vs projected {proj['projected_ms']:.1f} / {proj['gemm_ms']:.1f} ms" if proj else ""
        print(f"{row['measured_ms']:.1f} ms, GEMMs {row['measured_gemm_ms']:.1f} ms ({row['measured_ratio']:.2f}x)"
              f"{versus}; extra {row['measured_extra_mib']:,.1f} MiB; check {row['check']}  [{wall:.0f} s]",
              flush=True)
    print()
    print(results_table(out.rows))
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s; CSV: {out.csv.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
