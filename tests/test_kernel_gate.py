"""The static GPU gate in the normal suite (docs/design.md §10): every Triton launch grpo-fast can make compiles
for sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120, gfx90a and gfx942, and the launches the launchers choose have zero
spills and shared memory within each target's limit; kernels with a ``tl.dot`` use tensor cores in bf16/fp16 (the
log-prob kernels have none: their matmuls are cuBLAS GEMMs); kernels that address a buffer by a row stride compute
their offsets in 64 bits.

The compiled results live in ``bench/results/kernel_report.csv`` (each row keyed by a hash of the Triton version, the
kernel source, the specialisation and the target; see ``bench/kernel_report.py``). This file re-enumerates every
launch through the real launchers and Triton's binder, fails if any launch is missing from the CSV (a kernel or a
launch configuration changed: rerun ``python -m bench.kernel_report``), and recompiles a sample of rows to check
that the CSV says what the compiler says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGET_NAMES = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120", "gfx90a", "gfx942")
LOGPROB_KERNELS = {"_chunk_stats", "_stats_finalize", "_chunk_dlogits"}
VERIFY = 6
triton = pytest.importorskip("triton")
_CSV_TRITON = (ROOT / "bench" / "results" / "kernel_report.csv").read_text().split("| triton ", 1)[1].split()[0]
if _CSV_TRITON != triton.__version__:  # the rows are keyed by the Triton version: none is this one's
    pytest.skip(f"bench/results/kernel_report.csv was compiled with Triton {_CSV_TRITON} (locks/cpu.txt), this is "
                f"{triton.__version__}: run python -m bench.kernel_report under it to gate it", allow_module_level=True)


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real GPU code, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate") / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.kernel_report", "--cached-only", "--verify", str(VERIFY), "--no-write",
         "--json", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert out.exists(), f"kernel_report did not run:\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    data["stderr"] = proc.stderr
    return data


def _rows(report, **where):
    return [r for r in report["rows"] if all(str(r[k]) == str(v) for k, v in where.items())]


def _name(row) -> str:
    return row["kernel"].split(":")[1]


def test_every_launch_is_in_the_report(report):
    missing = [f"{r['kernel']} {r['target']} {r['dtype']} {r['constexprs']}" for r in report["rows"]
               if r["error"].startswith("missing from the CSV")]  # bench.kernel_report.MISSING
    assert not missing, f"{len(missing)} launches are not in bench/results/kernel_report.csv, e.g. {missing[:3]}"
    assert {_name(r) for r in report["rows"]} == LOGPROB_KERNELS | {"_grpo_loss_kernel", "_group_advantages_kernel"}


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_every_configuration_compiles_for_every_target(report, target):
    from grpo_fast.kernels.linear_logprobs import CONFIGS

    rows = _rows(report, target=target)
    errors = [f"{r['kernel']} {r['dtype']} {r['constexprs']}: {r['error']}" for r in rows if r["error"]]
    assert rows and not errors, errors[:5]
    # every configuration of the table was compiled on this target for each log-prob kernel, chosen here or not
    for kernel in LOGPROB_KERNELS:
        compiled = {(json.loads(r["constexprs"])["BLOCK_N"], json.loads(r["constexprs"]).get("BLOCK_C"),
                     int(r["num_warps"])) for r in rows if _name(r) == kernel}
        for cfg in CONFIGS.values():
            block_c = None if kernel == "_stats_finalize" else cfg.block_c  # the merge has no column tile
            assert (cfg.block_n, block_c, cfg.num_warps) in compiled, (kernel, cfg)


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_chosen_logprob_launches_pass_the_gate(report, target):
    """Zero spills and shared memory within the per-block limit for the three log-prob kernels at every
    specialisation the launchers choose, in every input dtype, with aligned and misaligned inputs, at both N
    buckets of the table on this target's family; none of them has a ``tl.dot`` (the matmuls are cuBLAS GEMMs), so
    none is held to tensor cores."""
    from grpo_fast.kernels.linear_logprobs import CONFIGS

    rows = [r for r in _rows(report, target=target, chosen=1) if _name(r) in LOGPROB_KERNELS]
    assert {_name(r) for r in rows} == LOGPROB_KERNELS
    assert {r["dtype"] for r in rows if _name(r) != "_stats_finalize"} == {"float32", "bfloat16", "float16"}
    assert {str(r["aligned"]) for r in rows} == {"1", "0"}  # aligned and misaligned inputs both gated
    family = {"sm_80": "sm80", "sm_86": "sm86", "sm_89": "sm89", "sm_90a": "sm90", "sm_100a": "sm100",
              "sm_120": "sm120", "gfx90a": "cdna", "gfx942": "cdna"}[target]
    chosen_cfgs = {(json.loads(r["constexprs"])["BLOCK_N"], int(r["num_warps"])) for r in rows}
    assert {(CONFIGS[(family, b)].block_n, CONFIGS[(family, b)].num_warps) for b in ("small", "large")} <= chosen_cfgs
    for r in rows:
        what = f"{r['kernel']} {r['dtype']} {r['constexprs']} warps={r['num_warps']}"
        assert int(r["spill_bytes"]) == 0, f"{what} spills {r['spill_bytes']} bytes per thread"
        assert int(r["shared_bytes"]) <= int(r["shared_limit"]), f"{what}: shared {r['shared_bytes']}"
        assert int(r["dots"]) == 0, f"{what}: a tl.dot in a log-prob kernel (the gate then requires tensor cores)"


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_forward_grid_has_both_column_split_paths(report, target):
    """With the target's SM count, the report's forward launches include a one-program-per-row-block grid (no
    column split, ``S = 1``) and a split one (``S > 1``, merged by ``_stats_finalize`` over S partial rows)."""
    splits = {grid[1] for r in _rows(report, target=target, chosen=1) if _name(r) == "_chunk_stats"
              for grid in r["grids"]}
    assert 1 in splits and max(splits) > 1, splits


def test_no_chosen_launch_fails_the_gate(report):
    """The report's own verdict over every row (compiles; shared memory; no spills where chosen; tensor cores where
    a 16-bit kernel has a dot; 64-bit row offsets; fp64 scalars in float64 kernels)."""
    assert not report["failures"], {k: v for k, v in list(report["failures"].items())[:5]}


def test_chunk_offsets_are_64_bit_in_the_compiled_code(report):
    """``rn * stride_z`` into an ``[N, C]`` chunk buffer passes 2^31 (a 4 GiB scratch budget, or the backward's
    buffer in grad_weight's rows of a large vocabulary): in the chunk kernels the TTIR widens ``stride_z`` to i64
    before any multiply, on every target. The merge kernel has no row stride (its offsets are below S x N, and S > 1
    only when N is below two row blocks per SM)."""
    rows = [r for r in report["rows"] if _name(r) in LOGPROB_KERNELS]
    by_kernel = {k: {r["offsets_64bit"] for r in rows if _name(r) == k} for k in LOGPROB_KERNELS}
    assert by_kernel == {"_chunk_stats": {"1"}, "_chunk_dlogits": {"1"}, "_stats_finalize": {""}}, by_kernel


def test_float64_kernels_take_their_scalars_in_float64(report):
    """On hardware a Python float reaches an fp32 parameter rounded to fp32 (the interpreter passes a double): the
    float64 loss and advantage kernels take every scalar as fp64 or in a tensor."""
    rows = [r for r in report["rows"] if r["dtype"] == "float64"]
    assert {_name(r) for r in rows} == {"_grpo_loss_kernel", "_group_advantages_kernel"}
    assert all(r["fp32_scalars"] == "" for r in rows), {r["kernel"]: r["fp32_scalars"] for r in rows}
    fp32_loss = [r for r in report["rows"] if r["dtype"] == "float32" and "grpo_loss" in r["kernel"]]
    assert fp32_loss and all(r["fp32_scalars"] == "" for r in fp32_loss)  # fp64 hyper-parameters, rounded inside


def test_recompiled_rows_match_the_csv(report):
    """A sample of rows compiled afresh in this run: registers, spills, shared memory, tensor cores, dots and the
    offset check as the CSV says (the CSV is a cache, not a claim)."""
    assert not report["verify_problems"], report["verify_problems"]
    assert f"verified {VERIFY} rows" in report["stderr"], report["stderr"][-2000:]
    verified = [r for r in report["rows"] if r["verified"]]
    assert len(verified) == VERIFY and {_name(r) for r in verified} == LOGPROB_KERNELS


def test_launchers_produce_few_specialisations(report):
    """Every specialisation is a compile on the user's GPU and here: the count per target stays small (bias,
    softcap, upstream gradients, sizes, chunk offsets and loss options are runtime values; see the kernels'
    headers). What remains for the log-prob kernels is input dtype x RETURN_ENTROPY x the table's two N buckets x the
    pointer attributes Triton specialises on (16-byte alignment of bias and target ids, which the backward's
    gathered rows change; on AMD also storage under 2 GiB, which a weight standing in for an absent bias or a chunk
    buffer over 2 GiB lacks): ``python -m bench.kernel_report --cached-only --no-write`` prints the count per
    target on its last line; the bound below leaves room for one more specialisation of a kernel."""
    per_target = {t: len(_rows(report, target=t)) for t in TARGET_NAMES}
    assert max(per_target.values()) <= 120, per_target


GATE_PROBE = textwrap.dedent('''
    import json
    import torch, triton, triton.language as tl
    from bench import kernel_report as kr
    from grpo_fast.kernels.launch import Launch

    @triton.jit
    def narrow(z_ptr, N, stride_z, BLOCK: tl.constexpr):
        rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # i32 rows: rn * stride_z wraps past 2^31
        ptrs = z_ptr + rn[:, None] * stride_z + tl.arange(0, 16)[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=rn[:, None] < N) + 1, mask=rn[:, None] < N)

    @triton.jit
    def wide(z_ptr, N, stride_z, BLOCK: tl.constexpr):
        rn = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ptrs = z_ptr + rn[:, None] * stride_z + tl.arange(0, 16)[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=rn[:, None] < N) + 1, mask=rn[:, None] < N)

    @triton.jit
    def dot16(a_ptr, c_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, a))

    z = torch.empty(64, 16, dtype=torch.bfloat16, device="meta")
    out = {}
    for name, kernel, args, cex in (("narrow", narrow, (z, 64, 16), {"BLOCK": 32}),
                                    ("wide", wide, (z, 64, 16), {"BLOCK": 32}),
                                    ("dot16", dot16, (z[:16], torch.empty(16, 16, device="meta")), {})):
        launch = Launch(kernel, (1,), args, cex, 4, 1)
        target, _ = kr.TARGETS["sm_90a"]
        sig, cexs, attrs, opts, key = kr.specialise(launch, target, "sm_90a")
        spec = kr.Spec(launch, "sm_90a", sig, cexs, attrs, opts, key, "bfloat16", True, True, [name])
        row = kr.compile_spec(spec)
        out[name] = dict(offsets=row["offsets_64bit"], dots=row["dots"], tc=row["tensor_cores"], err=row["error"],
                         failures=kr.gate_failures(row),
                         without_tc=kr.gate_failures(row | {"tensor_cores": 0}))
    print(json.dumps(out))
''')


@pytest.mark.slow
def test_the_gate_fails_narrow_offsets_and_dots_without_tensor_cores(tmp_path):
    """The gate's checks can fail: three small kernels compiled for sm_90a through the report's own specialisation
    and compile path. i32 row offsets (``rn`` from the program id, times ``stride_z``) fail the offset check and
    the i64 version passes; a bf16 ``tl.dot`` is counted in ``dots`` and compiles to tensor-core instructions, and
    the same row without them fails the gate."""
    probe = tmp_path / "probe.py"
    probe.write_text(GATE_PROBE)
    proc = subprocess.run([sys.executable, str(probe)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["narrow"]["offsets"] == "0" and out["narrow"]["failures"] == ["row offsets computed in int32"]
    assert out["wide"]["offsets"] == "1" and out["wide"]["failures"] == [] and out["wide"]["dots"] == 0
    assert out["dot16"]["dots"] == 1 and out["dot16"]["tc"] == 1 and out["dot16"]["failures"] == []
    assert out["dot16"]["without_tc"] == ["1 tl.dot without tensor-core instructions"]
    assert out["wide"]["without_tc"] == []  # no dot: tensor cores are not asked for
