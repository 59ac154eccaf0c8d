"""The static GPU gate in the normal suite (DESIGN.md §10, issue 12): every Triton launch grpo-fast can make compiles
for sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120, gfx90a and gfx942, and the launches the launchers choose for
bf16/fp16 log-probs have zero spills, shared memory within each target's limit and tensor-core instructions.

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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGET_NAMES = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120", "gfx90a", "gfx942")
VERIFY = 6
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real GPU code, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "bench.kernel_report", "--cached-only", "--verify", str(VERIFY), "--no-write",
         "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), f"kernel_report did not run:\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    data["stderr"] = proc.stderr
    return data


def _rows(report, **where):
    return [r for r in report["rows"] if all(str(r[k]) == str(v) for k, v in where.items())]


def test_every_launch_is_in_the_report(report):
    missing = [f"{r['kernel']} {r['target']} {r['dtype']} {r['constexprs']}" for r in report["rows"]
               if r["error"].startswith("missing from the CSV")]  # bench.kernel_report.MISSING
    assert not missing, f"{len(missing)} launches are not in bench/results/kernel_report.csv, e.g. {missing[:3]}"
    kernels = {r["kernel"].split(":")[1] for r in report["rows"]}
    assert {"_linear_logprob_fwd", "_linear_logprob_dlogits", "_grpo_loss_kernel",
            "_group_advantages_kernel"} <= kernels


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_every_configuration_compiles_for_every_target(report, target):
    from grpo_fast.kernels.linear_logprobs import CONFIGS

    rows = _rows(report, target=target)
    errors = [f"{r['kernel']} {r['dtype']} {r['constexprs']}: {r['error']}" for r in rows if r["error"]]
    assert rows and not errors, errors[:5]
    # every tile configuration of the table was compiled on this target, chosen here or not
    compiled = {(json.loads(r["constexprs"]).get("BLOCK_N"), json.loads(r["constexprs"]).get("BLOCK_V"),
                 json.loads(r["constexprs"]).get("BLOCK_H"), int(r["num_warps"]), int(r["num_stages"]))
                for r in rows if "linear_logprob" in r["kernel"]}
    for fwd, bwd in CONFIGS.values():
        for cfg in (fwd, bwd):
            assert (cfg.block_n, cfg.block_v, cfg.block_h, cfg.num_warps, cfg.num_stages) in compiled, cfg


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_chosen_16bit_logprob_launches_pass_the_gate(report, target):
    """Zero spills, shared memory within the per-block limit, tensor-core instructions (HMMA / HGMMA / tcgen05,
    MFMA on AMD), for the forward and the backward at every configuration the launchers choose for bf16/fp16."""
    rows = [r for r in _rows(report, target=target, chosen=1)
            if "linear_logprob" in r["kernel"] and r["dtype"] in ("bfloat16", "float16")]
    kernels = {r["kernel"].split(":")[1] for r in rows}
    assert kernels == {"_linear_logprob_fwd", "_linear_logprob_dlogits"}
    assert {str(r["aligned"]) for r in rows} == {"1", "0"}  # aligned and unaligned inputs both gated
    for r in rows:
        what = f"{r['kernel']} {r['dtype']} {r['constexprs']} warps={r['num_warps']} stages={r['num_stages']}"
        assert int(r["spill_bytes"]) == 0, f"{what} spills {r['spill_bytes']} bytes per thread"
        assert int(r["shared_bytes"]) <= int(r["shared_limit"]), f"{what}: shared {r['shared_bytes']}"
        assert int(r["tensor_cores"]) == 1, f"{what} has no tensor-core instruction"


def test_no_chosen_launch_fails_the_gate(report):
    """The report's own verdict over every row (compiles; shared memory; no spills where chosen; 64-bit offsets)."""
    assert not report["failures"], {k: v for k, v in list(report["failures"].items())[:5]}


def test_weight_offsets_are_64_bit_in_the_compiled_code(report):
    """``rv * stride_w`` reaches V * H (V=128256 x H=16384 is within 2% of 2^31): the TTIR widens stride_w to i64
    before any multiply, on every target, in every log-prob kernel (an i32 multiply fails this; checked against the
    kernel before the fix)."""
    rows = [r for r in report["rows"] if "linear_logprob" in r["kernel"]]
    assert rows and all(r["offsets_64bit"] == "1" for r in rows), {r["offsets_64bit"] for r in rows}


def test_float64_kernels_take_their_scalars_in_float64(report):
    """On hardware a Python float reaches an fp32 parameter rounded to fp32 (the interpreter passes a double): the
    float64 loss and advantage kernels take every scalar as fp64 or in a tensor."""
    rows = [r for r in report["rows"] if r["dtype"] == "float64"]
    assert {r["kernel"].split(":")[1] for r in rows} == {"_grpo_loss_kernel", "_group_advantages_kernel"}
    assert all(r["fp32_scalars"] == "" for r in rows), {r["kernel"]: r["fp32_scalars"] for r in rows}
    fp32_loss = [r for r in report["rows"] if r["dtype"] == "float32" and "grpo_loss" in r["kernel"]]
    assert fp32_loss and all(r["fp32_scalars"] == "" for r in fp32_loss)  # fp64 hyper-parameters, rounded inside


def test_recompiled_rows_match_the_csv(report):
    """A sample of rows compiled afresh in this run: registers, spills, shared memory and tensor cores as the CSV
    says (the CSV is a cache, not a claim)."""
    assert not report["verify_problems"], report["verify_problems"]
    assert f"verified {VERIFY} rows" in report["stderr"], report["stderr"][-2000:]


def test_launchers_produce_few_specialisations(report):
    """Every specialisation is a compile on the user's GPU and here: the count per target stays small (bias,
    softcap, upstream gradients and loss options are runtime values; see the kernels' headers). What remains is
    dtypes x alignments Triton specialises on (pointers, H, strides; 32-bit pointer ranges on AMD) x entropy x the
    fp32 dot precision, and the table's configurations."""
    per_target = {t: len(_rows(report, target=t)) for t in TARGET_NAMES}
    assert max(per_target.values()) <= 80, per_target
