"""The cost model of the fused log-prob forward + backward: the launch plan the launchers build, priced for a GPU.

    python -m bench.cost_model --n 16384 --h 4096 --v 151936 --dtype bf16 --device h100 --json
    python -m bench.cost_model --device a100 --entropy           # a table: launches and ms per step
    python -m bench.cost_model --all --csv                       # the two target shapes on the four devices

What it prices. ``linear_logprobs.forward`` then ``linear_logprobs.backward`` (all rows active, no bias, temperature 1,
no softcap, d hidden and d weight wanted) run on meta tensors inside ``grpo_fast.kernels.launch.capture(target)``:
every GEMM, Triton kernel and torch op goes through a ``grpo_fast.kernels.plan.Plan``, which records its kind, shape,
FLOPs and bytes at tensor granularity, and the launchers pick their chunk widths, column splits and tile
configurations as on ``target``. Nothing here restates how many launches or FLOPs the design has: every figure is a
sum over the recorded ``Plan.steps`` (and the peak of ``Plan.peak_bytes``), so the model cannot drift from the code.

The fixed rules (set in advance, so that a design cannot win by its constants):

- a launch takes ``max(flops / (peak * e), bytes / (0.85 * HBM)) + 5 us``, ``e`` = 0.75 for a cuBLAS GEMM, 0.55 for a
  Triton kernel; a torch op (copy, fill, reduction) is memory-bound (no FLOPs) and priced by the same formula;
- ``gemm_ms``: the three bare lm_head GEMMs of a forward + backward (logits ``[N, V] = h @ W^T``, ``dh = dlogits @ W``,
  ``dW = dlogits^T @ h``; 2NHV FLOPs each, 6NHV together), recorded by the same ``Plan.gemm`` and priced by the same
  rule with e = 0.75; ``ratio = projected_ms / gemm_ms``.

Projected, never measured: ``bench/gpu_check.sh`` measures the real thing on a GPU. docs/cost_model.md has the profiles'
sources, the current table and what the model leaves out (L2 reuse, overlap of launches, cuBLAS on small shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/cost_model.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from grpo_fast.dtypes import SHORT_DTYPES as DTYPES  # the short names: bf16, fp16, fp32
from grpo_fast.kernels.launch import Target, capture
from grpo_fast.kernels import linear_logprobs
from grpo_fast.kernels.logprob_layout import DEFAULT_SCRATCH_MIB
from grpo_fast.kernels.plan import Plan, Step
from grpo_fast.logprob_contract import BackwardInputs, LogprobParams, SavedStats

# ------------------------------------------------------------------------------------------------ the fixed rules
# Fixed in advance. GEMM_EFFICIENCY and TRITON_EFFICIENCY may only be replaced by a figure measured on a GPU by
# bench/gpu_check.sh (and the replacement must say so here, with the run it came from); the other two stay as they are.
GEMM_EFFICIENCY = 0.75  # e of a cuBLAS GEMM: the fraction of the dense tensor peak it reaches
TRITON_EFFICIENCY = 0.55  # e of a Triton kernel
HBM_EFFICIENCY = 0.85  # the fraction of the datasheet HBM bandwidth a streaming launch reaches
LAUNCH_SECONDS = 5e-6  # added to every launch
EFFICIENCY = {"gemm": GEMM_EFFICIENCY, "triton": TRITON_EFFICIENCY}  # "torch" steps carry no FLOPs (memory-bound)

MIB = 2**20
# The shapes the targets are set at (docs/design.md §7): (N, H, V)
ISSUE_SHAPES = ((16384, 4096, 151936), (65536, 8192, 128256))
CSV_PATH = Path(__file__).resolve().parent / "results" / "cost_model.csv"


# ------------------------------------------------------------------------------------------------ device profiles
@dataclasses.dataclass(frozen=True)
class Profile:
    """A GPU as the cost model sees it: public datasheet figures and the target the launchers configure for.

    ``peak_tflops``: dense (no sparsity) bf16 tensor TF/s with fp32 accumulation, fp16 alike. ``tf32_tflops``: dense
    TF32 tensor TF/s, the peak of fp32 inputs: a float32 GEMM only runs on TF32 tensor cores where the user allows it
    (``torch.backends.cuda.matmul.allow_tf32`` / ``torch.set_float32_matmul_precision("high")``), otherwise it runs at
    the far lower fp32 CUDA-core rate; the model prices the TF32 case. ``memory_gb``: as the datasheet prints it."""

    key: str
    name: str
    sms: int
    peak_tflops: float
    tf32_tflops: float
    hbm_tbs: float
    memory_gb: float
    target: Target
    source: str

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s of a dense tensor-core GEMM with ``dtype`` inputs ("bf16", "fp16", "fp32")."""
        return (self.tf32_tflops if dtype == "fp32" else self.peak_tflops) * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbs * 1e12


PROFILES: dict[str, Profile] = {p.key: p for p in (
    # The SXM parts (989 / 989 / 312 TF/s, 3.35 / 4.8 / 2.0 TB/s).
    Profile("h100", "NVIDIA H100 SXM5 80GB", 132, 989.0, 494.7, 3.35, 80, Target("cuda", 90, 32),
            "NVIDIA H100 Tensor Core GPU datasheet, SXM column (BF16 1,979 TF/s and TF32 989 TF/s are with sparsity: "
            "dense is half); 132 SMs: NVIDIA H100 whitepaper (SXM5)"),
    Profile("h200", "NVIDIA H200 SXM 141GB", 132, 989.0, 494.7, 4.8, 141, Target("cuda", 90, 32),
            "NVIDIA H200 Tensor Core GPU datasheet, SXM column (the same GH100 compute as the H100 SXM: sparse "
            "figures halved); 141 GB HBM3e at 4.8 TB/s"),
    Profile("a100", "NVIDIA A100 SXM4 80GB", 108, 312.0, 156.0, 2.0, 80, Target("cuda", 80, 32),
            "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (BF16 312 TF/s, TF32 156 TF/s dense; the "
            "datasheet's 2,039 GB/s taken as 2.0 TB/s); 108 SMs: NVIDIA A100 whitepaper"),
    # GeForce parts run fp16/bf16 tensor math with fp32 accumulation at half the fp16-accumulate rate: 165.2, not
    # the 330.3 TF/s the marketing table leads with (that is fp16 accumulate).
    Profile("rtx4090", "NVIDIA GeForce RTX 4090", 128, 165.2, 82.6, 1.008, 24, Target("cuda", 89, 32),
            "NVIDIA Ada GPU Architecture whitepaper (v2.01), Appendix A, GeForce RTX 4090: 128 SMs, peak BF16 "
            "tensor TF/s with FP32 accumulate 165.2 dense (330.4 sparse), peak TF32 tensor 82.6 dense, 24 GB GDDR6X "
            "at 1,008 GB/s"),
)}


# ------------------------------------------------------------------------------------------------ the plans
def _check_args(n: int, h: int, v: int, dtype: str, device: str, budget_mib: float | None) -> None:
    for name, x in (("n", n), ("h", h), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"cost_model: {name} must be a positive int, got {x!r}")
    if dtype not in DTYPES:
        raise ValueError(f"cost_model: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if device not in PROFILES:
        raise ValueError(f"cost_model: device must be one of {sorted(PROFILES)}, got {device!r}")
    if budget_mib is not None and (isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float))
                                   or not budget_mib > 0):
        raise ValueError(f"cost_model: budget_mib must be a positive number of MiB or None, got {budget_mib!r}")


def budget_bytes(budget_mib: float | None) -> int:
    """The launchers' scratch budget in bytes: ``budget_mib`` MiB, or ``DEFAULT_SCRATCH_MIB`` for None. Never
    ``GRPO_FAST_SCRATCH_MIB``: a projection must not depend on the environment it is printed in."""
    return int((DEFAULT_SCRATCH_MIB if budget_mib is None else budget_mib) * MIB)


def build_plans(n: int, h: int, v: int, *, dtype: str = "bf16", device: str = "h100", entropy: bool = False,
                need_hidden: bool = True, need_weight: bool = True,
                budget_mib: float | None = None) -> tuple[Plan, Plan]:
    """The forward's and the backward's ``Plan`` for hidden ``[n, h]``, weight ``[v, h]`` of ``dtype``, as the
    launchers build them on ``device`` (its target and SM count): every row active, upstream gradients ``g`` (and
    ``ge`` with ``entropy``) fp32 ``[n]``, no bias, temperature 1, no softcap."""
    _check_args(n, h, v, dtype, device, budget_mib)
    profile, dt, budget = PROFILES[device], DTYPES[dtype], budget_bytes(budget_mib)

    def meta(*shape, dtype=dt):
        return torch.empty(*shape, dtype=dtype, device="meta")

    hidden, weight, target_ids = meta(n, h), meta(v, h), meta(n, dtype=torch.int64)
    g = meta(n, dtype=torch.float32)
    ge = meta(n, dtype=torch.float32) if entropy else None
    forward, backward = Plan(), Plan()
    with capture(profile.target, sms=profile.sms):
        params = LogprobParams(return_entropy=entropy, budget=budget)
        _, ent, m, log_s = linear_logprobs.forward(hidden, weight, target_ids, None, params, plan=forward)
        grads = BackwardInputs(SavedStats(m, log_s, ent), g, ge, need_hidden=need_hidden, need_weight=need_weight)
        linear_logprobs.backward(hidden, weight, target_ids, None, params, grads, every_row=True, plan=backward)
    return forward, backward


def bare_gemm_plan(n: int, h: int, v: int, *, dtype: str = "bf16") -> Plan:
    """The three GEMMs of a bare lm_head forward + backward, recorded by ``Plan.gemm`` on meta tensors: logits
    ``[n, v] = h @ W^T``, ``d hidden [n, h] = dlogits @ W``, ``d weight [v, h] = dlogits^T @ h`` (2 n h v FLOPs each;
    each reads both operands and writes its output, in ``dtype``)."""
    dt = DTYPES[dtype]

    def meta(*shape):
        return torch.empty(*shape, dtype=dt, device="meta")

    hidden, weight, logits = meta(n, h), meta(v, h), meta(n, v)
    plan = Plan()
    plan.gemm("logits", hidden, weight.t(), logits)
    plan.gemm("d hidden", logits, weight, meta(n, h))
    plan.gemm("d weight", logits.t(), hidden, meta(v, h))
    return plan


# ------------------------------------------------------------------------------------------------ pricing
def step_seconds(step: Step, profile: Profile, dtype: str) -> float:
    """The fixed rule: ``max(flops / (peak * e), bytes / (0.85 * HBM)) + 5 us``."""
    memory = (step.bytes_read + step.bytes_written) / (HBM_EFFICIENCY * profile.hbm_bytes_per_s)
    if step.kind == "torch":
        if step.flops:
            raise ValueError(f"cost_model: torch step {step.name!r} carries {step.flops} FLOPs; the rules price torch "
                             "ops as memory-bound only")
        return memory + LAUNCH_SECONDS
    if step.kind not in EFFICIENCY:
        raise ValueError(f"cost_model: step {step.name!r} has kind {step.kind!r}; expected gemm, triton or torch")
    compute = step.flops / (profile.peak_flops(dtype) * EFFICIENCY[step.kind])
    return max(compute, memory) + LAUNCH_SECONDS


def plan_seconds(plan: Plan, profile: Profile, dtype: str) -> float:
    return sum(step_seconds(s, profile, dtype) for s in plan.steps)


def breakdown(passes: dict[str, Plan], profile: Profile, dtype: str) -> list[dict]:
    """One row per (pass, kind, step name), in the order the names first appear: launches, ms, FLOPs, HBM bytes."""
    rows: dict[tuple[str, str, str], dict] = {}
    for pass_name, plan in passes.items():
        for s in plan.steps:
            row = rows.setdefault((pass_name, s.kind, s.name), dict(pass_=pass_name, kind=s.kind, name=s.name,
                                                                    launches=0, ms=0.0, flops=0, hbm_bytes=0))
            row["launches"] += 1
            row["ms"] += step_seconds(s, profile, dtype) * 1e3
            row["flops"] += s.flops
            row["hbm_bytes"] += s.bytes_read + s.bytes_written
    return [{"pass" if k == "pass_" else k: x for k, x in row.items()} for row in rows.values()]


def project(n: int, h: int, v: int, *, dtype: str = "bf16", device: str = "h100", entropy: bool = False,
            need_hidden: bool = True, need_weight: bool = True, budget_mib: float | None = None) -> dict:
    """The projection of one forward + backward (see the module docstring); a JSON-serialisable dict.

    ``launches``, ``flops``, ``hbm_bytes`` (bytes read + written at tensor granularity), ``projected_ms``: sums over
    the forward's and the backward's plan steps; ``extra_bytes``: the larger of the two plans' peak temporaries
    (memory beyond inputs, outputs and gradients); ``gemm_ms``: the three bare lm_head GEMMs; ``ratio``:
    ``projected_ms / gemm_ms``; ``flops_per_nhv``: ``flops / (n h v)``; ``steps``: launches and ms per (pass, kind,
    step name); ``kinds``: launches and ms per kind. ``budget_mib`` None: ``DEFAULT_SCRATCH_MIB``."""
    forward, backward = build_plans(n, h, v, dtype=dtype, device=device, entropy=entropy, need_hidden=need_hidden,
                                    need_weight=need_weight, budget_mib=budget_mib)
    profile = PROFILES[device]
    plan = forward.extend(backward)
    projected_ms = plan_seconds(plan, profile, dtype) * 1e3
    gemm_ms = plan_seconds(bare_gemm_plan(n, h, v, dtype=dtype), profile, dtype) * 1e3
    steps = breakdown({"forward": forward, "backward": backward}, profile, dtype)
    kinds: dict[str, dict] = defaultdict(lambda: dict(launches=0, ms=0.0))
    for row in steps:
        kinds[row["kind"]]["launches"] += row["launches"]
        kinds[row["kind"]]["ms"] += row["ms"]
    return {
        "n": n, "h": h, "v": v, "dtype": dtype, "device": device, "device_name": profile.name,
        "entropy": entropy, "need_hidden": need_hidden, "need_weight": need_weight,
        "budget_mib": DEFAULT_SCRATCH_MIB if budget_mib is None else budget_mib,
        "launches": plan.launches, "forward_launches": forward.launches, "backward_launches": backward.launches,
        "flops": plan.flops, "flops_per_nhv": plan.flops / (n * h * v),
        "hbm_bytes": plan.hbm_bytes,
        "extra_bytes": plan.peak_bytes, "extra_mib": plan.peak_bytes / MIB,
        "forward_extra_bytes": forward.peak_bytes, "backward_extra_bytes": backward.peak_bytes,
        "projected_ms": projected_ms, "gemm_ms": gemm_ms, "ratio": projected_ms / gemm_ms,
        "profile": {"sms": profile.sms, "peak_tflops": profile.peak_flops(dtype) / 1e12, "hbm_tbs": profile.hbm_tbs,
                    "memory_gb": profile.memory_gb, "target": f"{profile.target.backend} {profile.target.arch}"},
        "rules": {"gemm_efficiency": GEMM_EFFICIENCY, "triton_efficiency": TRITON_EFFICIENCY,
                  "hbm_efficiency": HBM_EFFICIENCY, "launch_us": LAUNCH_SECONDS * 1e6},
        "kinds": dict(kinds),
        "steps": steps,
    }


# ------------------------------------------------------------------------------------------------ command line
SUMMARY_COLUMNS = ("device", "n", "h", "v", "dtype", "launches", "flops_per_nhv", "hbm_gb", "extra_mib",
                   "projected_ms", "gemm_ms", "ratio")


def summary_row(p: dict) -> dict:
    """The flat CSV / table row of a projection (the per-step breakdown left out)."""
    return {"device": p["device"], "n": p["n"], "h": p["h"], "v": p["v"], "dtype": p["dtype"],
            "entropy": int(p["entropy"]), "budget_mib": p["budget_mib"], "launches": p["launches"],
            "forward_launches": p["forward_launches"], "backward_launches": p["backward_launches"],
            "flops_per_nhv": round(p["flops_per_nhv"], 4), "hbm_gb": round(p["hbm_bytes"] / 1e9, 3),
            "extra_mib": round(p["extra_mib"], 2), "projected_ms": round(p["projected_ms"], 3),
            "gemm_ms": round(p["gemm_ms"], 3), "ratio": round(p["ratio"], 4)}


def format_summary(rows: list[dict]) -> str:
    """A markdown table of summary rows."""
    def cell(col, x):
        if col == "ratio":
            return f"{x:.2f}x"
        if col == "flops_per_nhv":
            return f"{x:.2f}"
        return float(x) if col in ("hbm_gb", "extra_mib", "projected_ms", "gemm_ms") else x  # 0.1 shown

    headers = ["device", "N", "H", "V", "dtype", "launches", "FLOPs / NHV", "HBM GB", "extra MiB", "projected ms",
               "GEMM ms", "ratio"]
    return harness.markdown_table(headers, [[cell(c, r[c]) for c in SUMMARY_COLUMNS] for r in rows])


def format_projection(p: dict) -> str:
    """The readable form of one projection: the setting, launches and ms per step, the totals."""
    width = max(len(r["name"]) for r in p["steps"]) + 2
    lines = [f"{p['device_name']} ({p['profile']['sms']} SMs, {p['profile']['peak_tflops']:g} TF/s {p['dtype']}, "
             f"{p['profile']['hbm_tbs']:g} TB/s): N={p['n']} H={p['h']} V={p['v']} {p['dtype']}"
             f"{', entropy' if p['entropy'] else ''}, scratch budget {p['budget_mib']:g} MiB. Projected, not measured.",
             "", f"{'pass':<9}{'kind':<8}{'step':<{width}}{'launches':>9}{'ms':>11}{'share':>8}"]
    for r in p["steps"]:
        lines.append(f"{r['pass']:<9}{r['kind']:<8}{r['name']:<{width}}{r['launches']:>9}{r['ms']:>11.3f}"
                     f"{r['ms'] / p['projected_ms']:>8.1%}")
    lines += ["",
              f"launches {p['launches']} (forward {p['forward_launches']}, backward {p['backward_launches']}); "
              f"FLOPs {p['flops_per_nhv']:.3f} NHV; HBM {p['hbm_bytes'] / 1e9:,.1f} GB; extra memory "
              f"{p['extra_mib']:,.1f} MiB (forward {p['forward_extra_bytes'] / MIB:,.1f}, backward "
              f"{p['backward_extra_bytes'] / MIB:,.1f})",
              f"projected {p['projected_ms']:,.2f} ms; bare lm_head GEMMs (6NHV at e={GEMM_EFFICIENCY}) "
              f"{p['gemm_ms']:,.2f} ms; ratio {p['ratio']:.3f}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.cost_model", description=doc[0] + "\n\n" + doc[1],
                                epilog="\n\n".join(doc[2:]), formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    n, h, v = ISSUE_SHAPES[0]
    p.add_argument("--n", type=int, default=n, help=f"tokens N (rows of hidden; default {n})")
    p.add_argument("--h", type=int, default=h, help=f"hidden size H (default {h})")
    p.add_argument("--v", type=int, default=v, help=f"vocabulary size V (default {v})")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="hidden/weight dtype (default bf16; fp32 is priced at the TF32 tensor peak)")
    p.add_argument("--device", choices=list(PROFILES), default="h100", help="device profile (default h100)")
    p.add_argument("--entropy", action="store_true", help="the forward returns the entropy and the backward takes "
                   "its gradient too")
    p.add_argument("--no-grad-hidden", action="store_true", help="the backward computes no d hidden")
    p.add_argument("--no-grad-weight", action="store_true", help="the backward computes no d weight")
    p.add_argument("--budget-mib", type=float, default=None, metavar="MIB",
                   help=f"the launchers' scratch budget (default {DEFAULT_SCRATCH_MIB}, whatever "
                        "GRPO_FAST_SCRATCH_MIB says)")
    p.add_argument("--all", action="store_true", help="the two target shapes (N=16384 H=4096 V=151936 and "
                   "N=65536 H=8192 V=128256) on every device profile, one table (--n/--h/--v/--device ignored)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table (with --all: "
                   "{\"rows\": [one object per projection]})")
    p.add_argument("--csv", type=Path, nargs="?", const=CSV_PATH, default=None, metavar="PATH",
                   help=f"also write the summary rows, with the command line that made them (default path "
                        f"{CSV_PATH.relative_to(CSV_PATH.parent.parent.parent)})")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    opts = dict(dtype=args.dtype, entropy=args.entropy, need_hidden=not args.no_grad_hidden,
                need_weight=not args.no_grad_weight, budget_mib=args.budget_mib)
    try:
        if args.all:
            projections = [project(*shape, device=device, **opts) for shape in ISSUE_SHAPES for device in PROFILES]
        else:
            projections = [project(args.n, args.h, args.v, device=args.device, **opts)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"rows": projections} if args.all else projections[0], indent=1))
    elif args.all:
        print(format_summary([summary_row(p) for p in projections]))
        print(f"\nProjected by the cost model (bench/cost_model.py), not measured; budget "
              f"{projections[0]['budget_mib']:g} MiB.")
    else:
        print(format_projection(projections[0]))
    if args.csv is not None:
        out = harness.CsvRows(args.csv)
        for p in projections:
            row = summary_row(p)
            # the environment's "device" column is the machine that ran the model; the GPU profile is "profile"
            out.add({"profile": row.pop("device"), **row, **harness.env_fields("cpu")})
        print(f"CSV: {args.csv}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
