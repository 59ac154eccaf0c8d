"""The static GPU gate: every Triton launch grpo-fast can make, compiled for 8 GPU targets on a CPU-only machine.

    python -m bench.kernel_report                  # compile what is missing, write bench/results/kernel_report.csv
    python -m bench.kernel_report --recompile      # compile everything afresh
    python -m bench.kernel_report --verify 6       # also recompile 6 rows and check them against the CSV
    python -m bench.kernel_report --json rows.json # the rows as JSON as well (the tests read this)

How. Each launcher (``grpo_fast.kernels.*``) launches through ``grpo_fast.kernels.launch.launch``; inside
``launch.capture(target, sms)`` that records the launch instead of running it and tells the launcher which GPU it is
on and how many SMs it has, so the launcher picks its configuration and grid for that target. The report calls the
real launchers on meta tensors (no memory, any size) over a grid of inputs: every input dtype, every option flag,
both N buckets of the log-prob table with and without the forward's column split, aligned inputs and misaligned
pointers, odd sizes, a weight over 2 GiB and a chunk buffer over 2 GiB, and the option grid of the loss. The log-prob
launchers' GEMMs go to cuBLAS, not to Triton: only their Triton launches are compiled. Each recorded launch goes
through Triton's own binder (``create_function_from_signature`` and ``_pack_args``, what ``JITFunction.run`` does
before it compiles), so the signature, constexprs and divisibility attributes are exactly those a launch on that GPU
would compile; launches that specialise alike are compiled once. Every configuration in a launcher's table is also
compiled for every target, not only where the launcher picks it.

What a row says. ``registers`` and ``spill_bytes`` (stack + local memory per thread) from the cubin through the
``cuobjdump`` bundled with Triton's NVIDIA backend, ``tensor_cores`` from its SASS (HMMA / HGMMA / UTC*MMA); on AMD
from the amdgcn assembly (``.vgpr_count``; spills are the scratch a VGPR spill needs, the private segment: SGPRs
spilled into VGPR lanes cost no memory traffic; MFMA instructions). ``shared_bytes`` is Triton's
dynamic shared memory (LDS on AMD). ``dots``: the ``tt.dot`` operations in the kernel's TTIR (the tensor-core
requirement applies where there is one). ``offsets_64bit``: for kernels with a row-stride parameter, whether the
TTIR computes every row x stride product in i64. ``chosen`` is 1 where the launcher picks
this configuration on this target.

Cache. A compile takes seconds; the CSV doubles as the cache. Each row carries ``key``, a hash of the Triton version,
the kernel's source (``JITFunction.cache_key``, which covers the jit functions it calls), the specialisation and the
target: a row is reused only while all four are unchanged, so editing a kernel makes its rows stale and they are
compiled again. ``--verify`` recompiles rows and fails if the CSV disagrees with the compiler.

Counts. The last line (stderr) is where the docs take their numbers from: ``kernel_report: N compiles for 8 targets
(sm_80 n, ...); K chosen by the launchers; D do not compile, S spill where chosen; F fail the gate, M verification
mismatches``. ``--cached-only --no-write`` prints it from the CSV alone (launches the CSV lacks are counted missing).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # the gate compiles real GPU code: the interpreter must be off
    sys.exit("bench.kernel_report: unset TRITON_INTERPRET (the report compiles for GPU targets, it interprets nothing)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from grpo_fast.kernels.launch import Launch, Target, capture  # noqa: E402

CSV_PATH = Path(__file__).resolve().parent / "results" / "kernel_report.csv"
KIB = 1024
# name -> (target, per-block shared memory limit in bytes: the opt-in maximum of one thread block)
TARGETS: dict[str, tuple[Target, int]] = {
    "sm_80": (Target("cuda", 80, 32), 163 * KIB),
    "sm_86": (Target("cuda", 86, 32), 99 * KIB),
    "sm_89": (Target("cuda", 89, 32), 99 * KIB),
    "sm_90a": (Target("cuda", 90, 32), 227 * KIB),
    "sm_100a": (Target("cuda", 100, 32), 227 * KIB),
    "sm_120": (Target("cuda", 120, 32), 99 * KIB),
    "gfx90a": (Target("hip", "gfx90a", 64), 64 * KIB),
    "gfx942": (Target("hip", "gfx942", 64), 64 * KIB),
}
# name -> SMs (CUs) of the target's best-known part, the count ``launch.capture`` gives the launchers (the forward's
# column split follows it; it decides grids, not specialisations): A100 SXM, RTX 3090, RTX 4090, H100 SXM, B200,
# RTX 5090, one MI250X die, MI300X
TARGET_SMS = {"sm_80": 108, "sm_86": 82, "sm_89": 128, "sm_90a": 132, "sm_100a": 148, "sm_120": 170, "gfx90a": 110,
              "gfx942": 304}
COLUMNS = ("kernel", "target", "dtype", "num_warps", "num_stages", "constexprs", "registers", "spill_bytes",
           "shared_bytes", "tensor_cores", "dots", "offsets_64bit", "fp32_scalars", "attrs", "shared_limit", "chosen",
           "aligned", "cases", "compile_s", "error", "key")
_TENSOR_CORE_SASS = re.compile(r"\b(HMMA|HGMMA|UTC\w*MMA|IMMA|QGMMA)\b")
_MFMA = re.compile(r"\bv_(s?mfma|wmma)\w*")
_TT_DOT = re.compile(r"= tt\.dot(_scaled)? ")  # a tl.dot (tl.dot_scaled) in the TTIR, before any lowering


# ------------------------------------------------------------------------------------------------ the launch grid
def _meta(shape, dtype, offset_cols: int = 0) -> torch.Tensor:
    """A meta tensor of ``shape``; ``offset_cols`` > 0 makes it a view that starts that many elements into a wider
    buffer (a misaligned pointer and a row stride that is not a multiple of 16, as a sliced ``hidden`` has)."""
    if not offset_cols:
        return torch.empty(shape, dtype=dtype, device="meta")
    rows, cols = shape
    return torch.empty(rows, cols + offset_cols, dtype=dtype, device="meta")[:, offset_cols:]


# (layout, H, V, pointer offset, scratch budget): what Triton can specialise a log-prob launch on. The GEMMs take
# ``hidden`` and the weight; the Triton kernels see the chunk buffers (the launcher's own scratch, or grad_weight's
# rows in the backward), the bias (or the weight standing in for an absent bias), target ids and the [N] statistics.
# So: aligned inputs; odd H and V with target ids and bias that start one element into their storage (a view such
# as ``input_ids[:, 1:]``: 8 bytes off 16); a weight over 2 GiB (AMD specialises pointers into storage under 2 GiB
# as 32-bit ranges: the absent bias's stand-in and the backward's chunk buffer in grad_weight lose that); and a
# 4 GiB scratch budget, whose forward chunk buffer is over 2 GiB and whose row offsets ``rn * stride_z`` pass 2^31
# bytes. (float32 weights at H = 4096 are over 2 GiB already.)
GIB = 2**30
_LAYOUTS = (("aligned", 4096, 151936, 0, None),
            ("odd H and V, target ids and bias off by one element", 4095, 151935, 1, None),
            ("weight over 2 GiB", 8192, 151936, 0, None),
            ("weight over 2 GiB, 4 GiB scratch", 8192, 151936, 0, 4 * GIB))
# token counts: both N buckets (``linear_logprobs.n_bucket``); with each target's SM count, N = 1000 splits the
# forward's columns over several programs and N = 16384 does not (tests/test_kernel_gate.py checks both occur)
_N = (1000, 16384)


def _vector(n, dtype, offset=0):
    """A ``[n]`` meta tensor; ``offset`` > 0: a view that many elements into a longer one (a misaligned pointer)."""
    return torch.empty(n + offset, dtype=dtype, device="meta")[offset:]


def _plan():
    """A launch plan whose GEMMs are checked for shape but not run. They go to cuBLAS, not to the compiler, and on
    meta tensors a matmul is only shape arithmetic, which costs more than the rest of a launcher call."""
    from grpo_fast.kernels.plan import Plan

    class ShapePlan(Plan):
        def gemm(self, name, a, b, out, *, accumulate=False):
            if a.shape[1] != b.shape[0] or tuple(out.shape) != (a.shape[0], b.shape[1]):
                raise ValueError(f"{name}: {tuple(a.shape)} @ {tuple(b.shape)} into {tuple(out.shape)}")

    return ShapePlan()


def _logprob_launches():
    """(description, input dtype, aligned, thunk) for the forward and backward log-prob launchers over dtypes,
    layouts, token counts, bias / softcap / entropy and which upstream gradients exist (g, ge, both), with and
    without the weight's gradient (the backward keeps its chunk buffer in grad_weight when that is wanted), with
    every row active and with the active rows gathered (``rows``: what ``active_rows`` finds in a real backward).
    Only the Triton launches are compiled: the GEMMs go to cuBLAS (``_plan`` checks their shapes)."""
    from grpo_fast.kernels.linear_logprobs import backward, forward
    from grpo_fast.logprob_contract import BackwardInputs, LogprobParams, SavedStats

    f32 = torch.float32
    for dtype, (layout, h, v, off, budget) in itertools.product((torch.float32, torch.bfloat16, torch.float16),
                                                                _LAYOUTS):
        tag = f"{dtype} {layout}"
        for n, bias, softcap, entropy in itertools.product(_N, (False, True), (False, True),
                                                          (False, True)):
            def fwd(dtype=dtype, h=h, v=v, off=off, budget=budget, n=n, bias=bias, softcap=softcap, entropy=entropy):
                forward(_meta((n, h), dtype), _meta((v, h), dtype), _vector(n, torch.int64, off),
                        _vector(v, dtype, off) if bias else None,
                        LogprobParams(0.7, 30.0 if softcap else None, entropy, budget=budget), plan=_plan())
            yield f"forward {tag} N={n} bias={bias} softcap={softcap} entropy={entropy}", dtype, not off, fwd
        # every_row (all rows active) or rows, the indices of the active rows, which the backward gathers into fresh
        # [A] vectors (aligned, small: a target-id pointer attribute differs from the caller's); the gathered case
        # over the dimensions that change what the kernels are passed, with both gradients and no softcap
        for n, bias, softcap, grads, need_weight, gathered in itertools.product(
                _N, (False, True), (False, True), ("g", "ge", "g+ge"), (True, False), (False, True)):
            if gathered and (softcap or grads != "g+ge"):
                continue

            def bwd(dtype=dtype, h=h, v=v, off=off, budget=budget, n=n, bias=bias, softcap=softcap, grads=grads,
                    need_weight=need_weight, gathered=gathered):
                has_g, has_ge = "g" in grads.split("+"), "ge" in grads
                backward(
                    _meta((n, h), dtype), _meta((v, h), dtype), _vector(n, torch.int64, off),
                    _vector(v, dtype, off) if bias else None,
                    LogprobParams(0.7, 30.0 if softcap else None, has_ge, budget=budget),
                    BackwardInputs(SavedStats(_vector(n, f32), _vector(n, f32), _vector(n, f32) if has_ge else None),
                                   _vector(n, f32) if has_g else None, _vector(n, f32) if has_ge else None,
                                   need_weight=need_weight, need_bias=bias),
                    rows=_vector(n - n // 4, torch.int64) if gathered else None, every_row=not gathered,
                    plan=_plan())
            yield (f"backward {tag} N={n} bias={bias} softcap={softcap} grads={grads} need_weight={need_weight}"
                   f"{' active rows gathered' if gathered else ''}", dtype, not off, bwd)


def _loss_launches():
    """The GRPO loss launcher: every loss type and level with every optional input present and absent, at T a
    multiple of 16, T = 1 and odd T (the launcher makes its ``[B, T]`` inputs contiguous, so a misaligned view
    reaches the kernel as an aligned copy; the odd-T case still passes one). (Its options are runtime values:
    ``tests/test_kernels.py`` holds the whole option grid to 3 specialisations per dtype, so this grid need not
    repeat it.)"""
    from grpo_fast.config import GRPOLossConfig, LossType
    from grpo_fast.kernels.grpo_loss import grpo_loss_terms_triton

    b = 16
    for dtype, (tt, aligned), lt, level, full in itertools.product(
            (torch.float32, torch.float64), ((1024, True), (1, True), (1023, False)), list(LossType),
            ("token", "sequence"), (False, True)):
        if level == "sequence" and not lt.allows_sequence_level:
            continue
        config = GRPOLossConfig(loss_type=lt, importance_sampling_level=level, beta=0.04 if full else 0.0,
                                delta=2.0 if full and (lt.is_clip_family or lt.is_dppo) else None,
                                top_entropy_quantile=0.5 if full else 1.0,
                                epsilon_high=5.0 if lt == LossType.CISPO else None,
                                dro_beta=0.1 if lt == LossType.DRO else None)

        def run(dtype=dtype, tt=tt, aligned=aligned, config=config, full=full):
            f = lambda *shape: _meta(shape, dtype, 0 if aligned else 1)  # noqa: E731
            grpo_loss_terms_triton(
                f(b, tt), f(b, tt) if full else _meta((b, 1), dtype), torch.empty(b, tt, dtype=torch.bool, device="meta"),
                old_logps=f(b, tt) if full else None, ref_logps=f(b, tt) if config.beta else None,
                sampling_ratio=f(b, tt) if full else None, num_items_in_batch=None, entropy=f(b, tt), config=config)
        yield f"loss {dtype} T={tt} {config.loss_type.value} {level} all_inputs={full}", dtype, aligned, run


def _advantage_launches():
    from grpo_fast.kernels.group_advantages import SCALE_GIVEN, SCALE_GROUP, SCALE_NONE, segment_normalize

    for dtype, n, scale, zero_flat in itertools.product((torch.float32, torch.float64), (7, 64, 5000),
                                                       (SCALE_NONE, SCALE_GROUP, SCALE_GIVEN), (False, True)):
        def run(dtype=dtype, n=n, scale=scale, zero_flat=zero_flat):
            x = _meta((n,), dtype)
            segment_normalize(x, _meta((n,), torch.int64), _meta((n // 4 + 1,), torch.int64), scale, 1e-4,
                              divisor=_meta((2,), dtype) if scale == SCALE_GIVEN else None, zero_flat=zero_flat)
        yield f"advantages {dtype} n={n} scale={scale} zero_flat={zero_flat}", dtype, True, run


def _config_launches():
    """Every configuration of the log-prob launchers' table, on every target (not only where it is chosen): the bf16
    forward and backward with entropy and both upstream gradients, at a small and a large N (so the forward runs
    with and without a column split) under each distinct configuration."""
    from grpo_fast.kernels import linear_logprobs as ll
    from grpo_fast.logprob_contract import BackwardInputs, LogprobParams, SavedStats

    f32 = torch.float32
    for cfg in sorted(set(ll.CONFIGS.values()), key=repr):
        def run(cfg=cfg):
            table = dict(ll.CONFIGS)
            try:  # every family and N bucket picks this configuration
                ll.CONFIGS.update({k: cfg for k in table})
                for n in (1000, 16384):
                    hidden, weight = _meta((n, 4096), torch.bfloat16), _meta((151936, 4096), torch.bfloat16)
                    params = LogprobParams(return_entropy=True)
                    ll.forward(hidden, weight, _vector(n, torch.int64), None, params, plan=_plan())
                    grads = BackwardInputs(SavedStats(_vector(n, f32), _vector(n, f32), _vector(n, f32)),
                                           _vector(n, f32), _vector(n, f32))
                    ll.backward(hidden, weight, _vector(n, torch.int64), None, params, grads, every_row=True,
                                plan=_plan())
            finally:
                ll.CONFIGS.clear()
                ll.CONFIGS.update(table)
        yield f"table configuration {cfg}", torch.bfloat16, True, run


GRIDS = {"logprobs": _logprob_launches, "loss": _loss_launches, "advantages": _advantage_launches}


def launch_grid(kernels=tuple(GRIDS)):
    """Every (description, input dtype, aligned, thunk) the report runs under each target."""
    for name in kernels:
        yield from GRIDS[name]()


# ------------------------------------------------------------------------------------ Triton's specialisation
@dataclasses.dataclass
class Spec:
    """One compile: a launch after Triton's binder, for one target."""

    launch: Launch
    target_name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str
    dtype: str
    aligned: bool
    chosen: bool
    cases: list[str]
    grids: set = dataclasses.field(default_factory=set)  # every grid the launch was made with

    def attrs_json(self) -> str:
        """Triton's specialisation attributes by parameter (divisibility by 16, AMD's 32-bit pointer ranges)."""
        names = list(self.signature)
        return json.dumps({names[path[0]]: [a[0].split(".")[-1] for a in v] for path, v in sorted(self.attrs.items())
                           if v and self.signature[names[path[0]]] != "constexpr"}, sort_keys=True)

    def constexprs_json(self) -> str:
        names = list(self.signature)
        return json.dumps({names[path[0]]: _plain(v) for path, v in sorted(self.constexprs.items())}, sort_keys=True)


def _plain(v):
    return v.value if hasattr(v, "value") else v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)


def _gpu_target(target: Target) -> GPUTarget:
    return GPUTarget(target.backend, target.arch, target.warp_size)


_BINDERS: dict = {}
_SPECIALISED: dict = {}


def specialise(launch: Launch, target: Target, target_name: str) -> tuple[dict, dict, dict, dict, str]:
    """(signature, constexprs, attrs, options, row key) exactly as ``JITFunction.run`` would build them on
    ``target``. The binder's (specialisation, options) is Triton's own in-memory cache key for a compile
    (``compute_cache_key``): launches equal on it share one result, so the rest is computed once per compile."""
    kernel = launch.kernel
    backend_key = (id(kernel), target)
    if backend_key not in _BINDERS:
        backend = make_backend(_gpu_target(target))
        _BINDERS[backend_key] = (backend, create_function_from_signature(kernel.signature, kernel.params, backend))
    backend, binder = _BINDERS[backend_key]
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    kwargs["debug"] = False
    bound, specialization, options = binder(*launch.args, **kwargs)
    memo = (id(kernel), target_name, tuple(specialization), str(options))
    if memo not in _SPECIALISED:
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        _SPECIALISED[memo] = (signature, constexprs, attrs, options.__dict__,
                              _key(launch, target_name, signature, constexprs, attrs, options.__dict__))
    return _SPECIALISED[memo]


_TRITON_DIRS = (str(Path(triton.__file__).resolve().parent), str(Path(triton.__file__).parent))


def _key(launch: Launch, target_name: str, signature, constexprs, attrs, options) -> str:
    """The row's cache key. Options hold absolute paths (libdevice, ROCm's bitcode libraries inside the triton
    package): they are made relative to the package, so that the key is the same in every checkout and venv."""
    def plain_option(v) -> str:
        return repr(v).replace(_TRITON_DIRS[0], "<triton>").replace(_TRITON_DIRS[1], "<triton>")

    blob = json.dumps([triton.__version__, launch.kernel.cache_key, target_name, signature,
                       sorted((list(k), _plain(v)) for k, v in constexprs.items()),
                       sorted((list(k), v) for k, v in attrs.items()),
                       sorted((k, plain_option(v)) for k, v in options.items())], default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def enumerate_specs(targets=TARGETS, kernels=tuple(GRIDS)) -> list[Spec]:
    """Every distinct compile the launchers can produce on each target, plus every table configuration."""
    specs: dict[str, Spec] = {}
    for name, (target, _) in targets.items():
        configs = _config_launches() if "logprobs" in kernels else ()
        for grid, chosen in ((launch_grid(kernels), True), (configs, False)):
            for desc, dtype, aligned, thunk in grid:
                with capture(target, sms=TARGET_SMS[name]) as launches:
                    thunk()
                for launch in launches:
                    sig, cex, attrs, opts, key = specialise(launch, target, name)
                    if key not in specs:
                        specs[key] = Spec(launch, name, sig, cex, attrs, opts, key, str(dtype).replace("torch.", ""),
                                          aligned, chosen, [])
                    specs[key].chosen |= chosen
                    specs[key].cases.append(desc)
                    specs[key].grids.add(launch.grid)
    return list(specs.values())


# -------------------------------------------------------------------------------------------------- compiling
def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _cuda_resources(cubin: bytes, kernel_name: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    field = lambda k: int(re.search(rf"\b{k}:(\d+)", line).group(1))  # noqa: E731
    return dict(registers=field("REG"), spill_bytes=field("STACK") + field("LOCAL"), static_shared=field("SHARED"),
                tensor_cores=int(bool(_TENSOR_CORE_SASS.search(sass))))


def _amd_resources(asm: str) -> dict:
    def meta(k):
        found = re.findall(rf"\.{k}:\s+(\d+)", asm)
        return max(map(int, found)) if found else 0

    # spills that cost memory traffic go to scratch (the private segment); SGPRs spilled into VGPR lanes do not
    return dict(registers=meta("vgpr_count"),
                spill_bytes=max(meta("private_segment_fixed_size"), 4 * meta("vgpr_spill_count")),
                static_shared=0, tensor_cores=int(bool(_MFMA.search(asm))))


def offsets_64bit(ttir: str) -> str:
    """For kernels that address a 2-D buffer by a row stride (a parameter ``stride_*``: the log-prob kernels' ``[N,
    C]`` chunk buffers, where ``rn * stride_z`` passes 2^31 elements or bytes at large N x C): "1" if the TTIR
    widens every stride parameter to i64 before any multiply (so row x stride is an i64 product), "0" if a stride is
    multiplied, or splat for a multiply, as i32; "" for kernels without a stride parameter."""
    strides = re.findall(r"%(stride_\w+): i32", ttir)
    if not strides:
        return ""
    for name in strides:
        widened = re.search(rf"arith\.extsi %{name} : i32 to i64", ttir)
        narrow = re.search(rf"tt\.splat %{name} : i32 -> tensor<[^>]*xi32>|arith\.muli [^\n]*%{name}\b[^\n]*: i32",
                           ttir)
        if widened is None or narrow is not None:
            return "0"
    return "1"


def compile_spec(spec: Spec) -> dict:
    """Compile one spec; its row (resources, or the error)."""
    target, limit = TARGETS[spec.target_name]
    launch = spec.launch
    row = dict(kernel=launch.name, target=spec.target_name, dtype=spec.dtype, num_warps=launch.num_warps,
               num_stages=launch.num_stages, constexprs=spec.constexprs_json(), shared_limit=limit,
               chosen=int(spec.chosen), aligned=int(spec.aligned), cases=len(spec.cases), key=spec.key, error="",
               attrs=spec.attrs_json(),
               # a Python float reaches an fp32 parameter rounded to fp32: a float64 kernel must have none
               fp32_scalars=" ".join(name for name, ty in spec.signature.items() if ty == "fp32"))
    t0 = time.perf_counter()
    try:
        src = ASTSource(launch.kernel, spec.signature, spec.constexprs, spec.attrs)
        compiled = triton.compile(src, target=_gpu_target(target), options=spec.options)
        if target.backend == "cuda":
            res = _cuda_resources(compiled.asm["cubin"], compiled.metadata.name)
        else:
            res = _amd_resources(compiled.asm["amdgcn"])
        row.update(registers=res["registers"], spill_bytes=res["spill_bytes"], tensor_cores=res["tensor_cores"],
                   shared_bytes=max(compiled.metadata.shared, res["static_shared"]),
                   dots=len(_TT_DOT.findall(compiled.asm["ttir"])), offsets_64bit=offsets_64bit(compiled.asm["ttir"]))
    except Exception as e:  # a configuration that does not compile is a row of the report, and fails the gate
        row.update(registers="", spill_bytes="", shared_bytes="", tensor_cores="", dots="", offsets_64bit="",
                   error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def _compile_key(job: tuple[str, str]) -> dict:
    """Compile the spec ``(target name, key)``. A forked worker has the parent's specs; a spawned one enumerates
    that target's (a few seconds)."""
    target_name, key = job
    return compile_spec(next(s for s in _worker_specs(target_name) if s.key == key))


_SPECS_CACHE: dict[str, list[Spec]] = {}
_KERNELS = tuple(GRIDS)


def _worker_specs(target_name: str) -> list[Spec]:
    if target_name not in _SPECS_CACHE:
        _SPECS_CACHE[target_name] = enumerate_specs({target_name: TARGETS[target_name]}, kernels=_KERNELS)
    return _SPECS_CACHE[target_name]


def read_csv(path: Path = CSV_PATH) -> dict[str, dict]:
    """The CSV's rows by key; a row written before a column existed is left out (compiled again)."""
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        return {row["key"]: row for row in csv.DictReader(line for line in f if not line.startswith("#"))
                if all(row.get(col) is not None for col in COLUMNS)}


def write_csv(rows: list[dict], path: Path = CSV_PATH, command: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        f.write(f"# {command or 'python -m bench.kernel_report'} | triton {triton.__version__} | "
                f"torch {torch.__version__} | {time.strftime('%Y-%m-%d')} | CPU-only machine, compiled for GPU targets\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in sorted(rows, key=lambda r: (r["kernel"], r["target"], r["dtype"], r["constexprs"], r["key"])):
            w.writerow(row)
    tmp.replace(path)


MISSING = "missing from the CSV: rerun python -m bench.kernel_report"


def build(recompile: bool = False, workers: int = 2, verify: int = 0, progress=print,
          kernels=tuple(GRIDS), cached_only: bool = False) -> tuple[list[dict], list[str]]:
    """Rows for every spec (from the CSV where its key is unchanged, else compiled, or with ``cached_only`` marked
    MISSING); ``verify`` rows recompiled and compared. Returns (rows, problems found by verification)."""
    global _KERNELS
    _KERNELS = tuple(kernels)
    _SPECS_CACHE.clear()
    specs = [s for name in TARGETS for s in _worker_specs(name)]
    cached = {} if recompile else read_csv()
    todo = [s for s in specs if s.key not in cached]
    rows = {s.key: cached[s.key] for s in specs if s.key in cached}
    if cached_only:
        for s in todo:
            rows[s.key] = dict(kernel=s.launch.name, target=s.target_name, dtype=s.dtype, constexprs=s.constexprs_json(),
                               fp32_scalars="", attrs=s.attrs_json(),
                               num_warps=s.launch.num_warps, num_stages=s.launch.num_stages, registers="",
                               spill_bytes="", shared_bytes="", tensor_cores="", dots="", offsets_64bit="",
                               shared_limit=TARGETS[s.target_name][1], aligned=int(s.aligned), key=s.key, compile_s="",
                               error=MISSING)
        todo = []
    progress(f"kernel_report: {len(specs)} compiles over {len(TARGETS)} targets; {len(rows)} from the CSV, "
             f"{len(todo)} to compile")
    problems = []
    # the verification sample: chosen log-prob launches on three targets (bf16 inputs first, then aligned ones; the
    # merge kernel takes no input-dtype tensor and carries the first dtype that launched it), compiled afresh (an
    # empty Triton cache directory in the workers) and compared with the CSV; round-robin over targets and, within a
    # target, over the kernels from a different first kernel per target, so that two rows per target cover every
    # log-prob kernel
    sample = [s for s in specs if s.chosen and s.key in cached and "linear_logprob" in s.launch.name
              and s.target_name in ("sm_90a", "sm_120", "gfx942")]
    by_target: dict[str, dict[str, list[Spec]]] = {}
    for spec in sorted(sample, key=lambda s: (s.dtype != "bfloat16", not s.aligned, s.launch.name, s.key)):
        by_target.setdefault(spec.target_name, {}).setdefault(spec.launch.name, []).append(spec)
    rotated = {}
    for i, (t, kernels) in enumerate(sorted(by_target.items())):
        groups = [kernels[k] for k in sorted(kernels)]
        groups = groups[i % len(groups):] + groups[:i % len(groups)]
        rotated[t] = [s for group in itertools.zip_longest(*groups) for s in group if s is not None]
    sample = [spec for group in zip(*rotated.values()) for spec in group][:verify]
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        for i, row in enumerate(pool.map(_compile_key, [(s.target_name, s.key) for s in todo]), 1):
            rows[row["key"]] = row
            if i % 10 == 0 or i == len(todo):
                progress(f"kernel_report: {i}/{len(todo)} compiled ({time.perf_counter() - t0:.0f} s)")
    if sample:
        with tempfile.TemporaryDirectory() as cache_dir, concurrent.futures.ProcessPoolExecutor(
                max_workers=max(1, workers), initializer=os.environ.__setitem__,
                initargs=("TRITON_CACHE_DIR", cache_dir)) as pool:
            for row in pool.map(_compile_key, [(s.target_name, s.key) for s in sample]):
                old = rows[row["key"]]
                for col in ("registers", "spill_bytes", "shared_bytes", "tensor_cores", "dots", "offsets_64bit"):
                    if str(old[col]) != str(row[col]):
                        problems.append(f"{row['kernel']} on {row['target']}: CSV says {col}={old[col]}, "
                                        f"the compiler says {row[col]}")
    if sample:
        progress(f"kernel_report: verified {len(sample)} rows against a fresh compile, {len(problems)} mismatches")
    # the JSON rows also carry every grid a spec was launched with and whether this run recompiled them to verify
    # (not compile results: not in the CSV)
    verified = {s.key for s in sample}
    return [rows[s.key] | {"chosen": int(s.chosen), "cases": len(s.cases), "grids": sorted(s.grids),
                           "verified": int(s.key in verified)} for s in specs], problems


def gate_failures(row: dict) -> list[str]:
    """Why a row fails the gate: it must compile; a launch the launcher chooses on its target must also fit that
    target's shared memory and not spill, and a chosen 16-bit launch of a kernel with a ``tl.dot`` (read from its
    TTIR: ``dots``) must use tensor cores. Every row: 64-bit row offsets where the kernel has a row stride, no fp32
    scalar in a float64 kernel. (A table configuration compiled on a target it is not chosen for only has to
    compile and pass the offset check.)"""
    if row["error"]:
        return [f"does not compile: {row['error']}"]
    out = []
    if int(row["chosen"]) and int(row["shared_bytes"]) > int(row["shared_limit"]):
        out.append(f"shared memory {row['shared_bytes']} > {row['shared_limit']}")
    if int(row["chosen"]) and int(row["spill_bytes"]):
        out.append(f"spills {row['spill_bytes']} bytes")
    if int(row["chosen"]) and row["dtype"] in ("bfloat16", "float16") and int(row["dots"]) and \
            not int(row["tensor_cores"]):
        out.append(f"{row['dots']} tl.dot without tensor-core instructions")
    if row["offsets_64bit"] == "0":
        out.append("row offsets computed in int32")
    if row["dtype"] == "float64" and row["fp32_scalars"]:
        out.append(f"float64 kernel takes fp32 scalars: {row['fp32_scalars']}")
    return sorted(set(out))


def summary(rows: list[dict]) -> str:
    """The README table in short: per kernel and target, how many specialisations compile, and over the launches
    the launchers choose there: the most registers, spill bytes and shared memory, and tensor cores in 16-bit
    ("n/a" for kernels without ``tl.dot``)."""
    lines = ["| kernel | target | compile | chosen: max registers | spill bytes | max shared KiB (limit) | tensor cores |",
             "|---|---|---:|---:|---:|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["kernel"].split(":")[1], r["target"]), []).append(r)
    for (kernel, target), rs in sorted(by.items(), key=lambda kv: (kv[0][0], list(TARGETS).index(kv[0][1]))):
        compiled = [r for r in rs if not r["error"]]
        ok = [r for r in compiled if int(r["chosen"])]
        tc = {int(r["tensor_cores"]) for r in ok if r["dtype"] in ("bfloat16", "float16") and int(r["dots"])}
        lines.append(f"| `{kernel}` | {target} | {len(compiled)}/{len(rs)} | {max(int(r['registers']) for r in ok)} | "
                     f"{max(int(r['spill_bytes']) for r in ok)} | {max(int(r['shared_bytes']) for r in ok) / KIB:.0f} "
                     f"({int(rs[0]['shared_limit']) // KIB}) | {'yes' if tc == {1} else 'n/a' if not tc else 'NO'} |")
    return "\n".join(lines)


def counts_line(rows: list[dict], failures: dict, problems: list[str]) -> str:
    """The report's last line, the one the docs quote counts from: compiles in all and per target, how many the
    launchers choose, how many lack a result, do not compile or spill where chosen, and what fails."""
    per_target = ", ".join(f"{t} {sum(r['target'] == t for r in rows)}" for t in TARGETS)
    missing = sum(r["error"] == MISSING for r in rows)
    broken = sum(bool(r["error"]) and r["error"] != MISSING for r in rows)
    spilling = sum(not r["error"] and int(r["chosen"]) and int(r["spill_bytes"]) > 0 for r in rows)
    return (f"kernel_report: {len(rows)} compiles for {len(TARGETS)} targets ({per_target}); "
            f"{sum(int(r['chosen']) for r in rows)} chosen by the launchers; "
            + (f"{missing} missing from the CSV, " if missing else "")
            + f"{broken} do not compile, {spilling} spill where chosen; {len(failures)} fail the gate, "
            f"{len(problems)} verification mismatches")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--recompile", action="store_true", help="ignore the CSV cache and compile everything")
    p.add_argument("--verify", type=int, default=0, metavar="K", help="recompile K cached rows and compare")
    p.add_argument("--workers", type=int, default=2, help="compile processes (default 2)")
    p.add_argument("--json", metavar="FILE", help="also write the rows and the gate failures as JSON")
    p.add_argument("--no-write", action="store_true", help="do not rewrite the CSV")
    p.add_argument("--cached-only", action="store_true",
                   help="compile nothing but the --verify sample: launches missing from the CSV are reported as such")
    p.add_argument("--summary", action="store_true", help="print the short table for README.md")
    p.add_argument("--kernels", nargs="+", choices=list(GRIDS), default=list(GRIDS),
                   help="launcher families to include (default: all; the CSV is written only for all)")
    args = p.parse_args(argv)
    rows, problems = build(args.recompile, args.workers, args.verify, progress=lambda s: print(s, file=sys.stderr),
                           kernels=args.kernels, cached_only=args.cached_only)
    if not args.no_write and set(args.kernels) == set(GRIDS):
        write_csv(rows, command="python -m bench.kernel_report " + " ".join(argv if argv is not None else sys.argv[1:]))
    failures = {r["key"]: gate_failures(r) for r in rows}
    failures = {k: v for k, v in failures.items() if v}
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "verify_problems": problems, "failures": failures}))
    if args.summary:
        print(summary(rows))
    for r in rows:
        if r["key"] in failures:
            print(f"GATE FAIL {r['kernel']} {r['target']} {r['dtype']} {r['constexprs']}: "
                  f"{'; '.join(failures[r['key']])}", file=sys.stderr)
    for msg in problems:
        print(f"VERIFY FAIL {msg}", file=sys.stderr)
    print(counts_line(rows, failures, problems), file=sys.stderr)
    return 1 if failures or problems else 0


if __name__ == "__main__":
    sys.exit(main())
