"""bench/cost_model.py: the targets (docs/design.md §7) on the projection, and the projection read from the plan.

Everything here runs the real launchers on meta tensors inside ``launch.capture``: no kernel runs (not even under the
interpreter), so the full target shape costs a second or two.
"""

import csv
import json
import math

import pytest
import triton

from bench import cost_model
from bench.cost_model import GEMM_EFFICIENCY, PROFILES, build_plans, project, step_seconds
from grpo_fast.kernels import linear_logprobs, logprob_layout
from grpo_fast.kernels.linear_logprobs import CONFIGS
from grpo_fast.kernels.logprob_layout import DEFAULT_SCRATCH_MIB
from grpo_fast.kernels.plan import Plan, Step

MIB = 2**20
N, H, V = 16384, 4096, 151936  # the shape the targets are set at
NHV = N * H * V
SMALL = (2048, 512, 32000)  # a quick shape for the tests about the model itself


@pytest.fixture(scope="module")
def target_shape():
    return project(N, H, V, dtype="bf16", device="h100")


# ------------------------------------------------------------------------------------------------ the targets
def test_time_within_1_5x_the_bare_gemms(target_shape):
    assert target_shape["projected_ms"] <= 1.5 * target_shape["gemm_ms"], target_shape["ratio"]


def test_at_most_400_launches(target_shape):
    assert target_shape["launches"] <= 400


def test_at_most_8_4_nhv_flops(target_shape):
    assert target_shape["flops"] <= 8.4 * NHV


def test_extra_memory_within_64_mib_at_the_default_budget(target_shape):
    assert target_shape["budget_mib"] == DEFAULT_SCRATCH_MIB
    assert target_shape["extra_bytes"] <= 64 * MIB, (
        f"forward {target_shape['forward_extra_bytes'] / MIB:.1f} MiB, "
        f"backward {target_shape['backward_extra_bytes'] / MIB:.1f} MiB")


# ------------------------------------------------------------------------------------------------ the fixed rules
@pytest.mark.parametrize("device, sms, tflops, tf32, tbs, gb, arch", [
    ("h100", 132, 989.0, 494.7, 3.35, 80, 90),
    ("h200", 132, 989.0, 494.7, 4.8, 141, 90),
    ("a100", 108, 312.0, 156.0, 2.0, 80, 80),
    ("rtx4090", 128, 165.2, 82.6, 1.008, 24, 89),
])
def test_profiles_have_the_datasheet_figures(device, sms, tflops, tf32, tbs, gb, arch):
    p = PROFILES[device]
    assert (p.sms, p.peak_tflops, p.tf32_tflops, p.hbm_tbs, p.memory_gb) == (sms, tflops, tf32, tbs, gb)
    assert (p.target.backend, p.target.arch, p.target.warp_size) == ("cuda", arch, 32)
    assert p.peak_flops("bf16") == p.peak_flops("fp16") == tflops * 1e12
    assert p.peak_flops("fp32") == tf32 * 1e12
    assert p.source


def test_the_launch_rule():
    h100 = PROFILES["h100"]
    peak, hbm = 989e12, 3.35e12
    flops, nbytes = 10**12, 10**9
    assert step_seconds(Step("gemm", "g", (1, 1, 1), flops, nbytes, 0), h100, "bf16") == pytest.approx(
        flops / (peak * 0.75) + 5e-6, rel=1e-12)
    assert step_seconds(Step("triton", "k", (1,), flops, nbytes, 0), h100, "bf16") == pytest.approx(
        flops / (peak * 0.55) + 5e-6, rel=1e-12)
    # memory-bound: the byte term wins whatever the kind; reads and writes both count
    assert step_seconds(Step("gemm", "g", (1, 1, 1), 1000, nbytes, nbytes), h100, "bf16") == pytest.approx(
        2 * nbytes / (0.85 * hbm) + 5e-6, rel=1e-12)
    assert step_seconds(Step("torch", "zero", (1,), 0, 0, nbytes), h100, "bf16") == pytest.approx(
        nbytes / (0.85 * hbm) + 5e-6, rel=1e-12)
    assert step_seconds(Step("gemm", "g", (1, 1, 1), flops, 0, 0), h100, "fp32") == pytest.approx(
        flops / (494.7e12 * 0.75) + 5e-6, rel=1e-12)
    with pytest.raises(ValueError, match="torch step 'zero' carries"):
        step_seconds(Step("torch", "zero", (1,), 5, 0, 0), h100, "bf16")
    with pytest.raises(ValueError, match="kind 'cutlass'"):
        step_seconds(Step("cutlass", "x", (1,), 0, 0, 0), h100, "bf16")


def test_gemm_ms_is_the_three_lm_head_gemms(target_shape):
    # compute-bound at the target shape: 6NHV at e = 0.75 plus 5 us per GEMM
    assert target_shape["gemm_ms"] == pytest.approx((6 * NHV / (989e12 * GEMM_EFFICIENCY) + 3 * 5e-6) * 1e3,
                                                   rel=1e-12)
    # memory-bound at H = 16: each GEMM reads both operands and writes its output, bf16
    n, h, v = 16384, 16, 151936
    gemm_bytes = 2 * ((n * h + v * h + n * v) + (n * v + v * h + n * h) + (n * v + n * h + v * h))
    expected = (gemm_bytes / (0.85 * 3.35e12) + 3 * 5e-6) * 1e3
    assert project(n, h, v, device="h100")["gemm_ms"] == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------------------------ read from the plan
def _priced_by_hand(plan: Plan, peak: float, hbm: float) -> float:
    e = {"gemm": 0.75, "triton": 0.55, "torch": 1.0}  # torch steps carry no FLOPs
    return sum(max(s.flops / (peak * e[s.kind]), (s.bytes_read + s.bytes_written) / (0.85 * hbm)) + 5e-6
               for s in plan.steps)


@pytest.mark.parametrize("device", ["a100", "rtx4090"])
@pytest.mark.parametrize("entropy", [False, True])
def test_the_projection_is_the_plan_priced(device, entropy):
    forward, backward = build_plans(*SMALL, device=device, entropy=entropy)
    p = project(*SMALL, device=device, entropy=entropy)
    prof = PROFILES[device]
    assert p["launches"] == len(forward.steps) + len(backward.steps)
    assert p["flops"] == sum(s.flops for s in forward.steps + backward.steps)
    assert p["hbm_bytes"] == sum(s.bytes_read + s.bytes_written for s in forward.steps + backward.steps)
    assert p["extra_bytes"] == max(forward.peak_bytes, backward.peak_bytes)
    by_hand = _priced_by_hand(forward, prof.peak_tflops * 1e12, prof.hbm_tbs * 1e12) + \
        _priced_by_hand(backward, prof.peak_tflops * 1e12, prof.hbm_tbs * 1e12)
    assert p["projected_ms"] == pytest.approx(by_hand * 1e3, rel=1e-12)
    assert p["ratio"] == pytest.approx(p["projected_ms"] / p["gemm_ms"], rel=1e-12)
    assert sum(r["launches"] for r in p["steps"]) == p["launches"]
    assert sum(r["ms"] for r in p["steps"]) == pytest.approx(p["projected_ms"], rel=1e-12)
    assert sum(k["ms"] for k in p["kinds"].values()) == pytest.approx(p["projected_ms"], rel=1e-12)
    if entropy:  # the entropy's statistics: one more fp64 [S, N] running sum in the forward
        assert p["forward_extra_bytes"] > project(*SMALL, device=device)["forward_extra_bytes"]


def test_a_step_taken_out_of_the_launcher_leaves_the_projection(monkeypatch):
    base = project(*SMALL)
    dlogits = next(r for r in base["steps"] if r["name"] == "chunk_dlogits")
    kernel = Plan.kernel

    def without_dlogits(self, name, *args, **kwargs):
        if name != "chunk_dlogits":
            kernel(self, name, *args, **kwargs)

    monkeypatch.setattr(Plan, "kernel", without_dlogits)
    cut = project(*SMALL)
    assert dlogits["launches"] >= 1
    assert cut["launches"] == base["launches"] - dlogits["launches"]
    assert cut["projected_ms"] == pytest.approx(base["projected_ms"] - dlogits["ms"], rel=1e-9)
    assert cut["hbm_bytes"] == base["hbm_bytes"] - dlogits["hbm_bytes"]
    assert all(r["name"] != "chunk_dlogits" for r in cut["steps"])


def test_the_budget_moves_launches_and_memory():
    n, h, v = SMALL
    runs = {mib: project(n, h, v, budget_mib=mib) for mib in (4, 16, 64)}
    for mib, p in runs.items():
        budget = mib * MIB
        forward, _ = build_plans(n, h, v, budget_mib=mib)
        c = _named(forward, "logits")[0].shape[1]
        assert c % 128 == 0 and n * (c + 128) * 2 > budget - 64 * n  # the widest 128-column multiple that fits
        assert p["budget_mib"] == mib
        assert p["forward_launches"] == 2 * math.ceil(v / c) + 1
        assert n * c * 2 <= p["forward_extra_bytes"] <= budget  # the buffer and a few [n] statistics
    assert runs[4]["launches"] > runs[16]["launches"] > runs[64]["launches"]
    assert runs[4]["extra_bytes"] < runs[16]["extra_bytes"] < runs[64]["extra_bytes"]


def test_the_environment_budget_does_not_leak_into_the_default(monkeypatch):
    monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", "4")
    default = project(*SMALL)
    assert default["budget_mib"] == DEFAULT_SCRATCH_MIB
    assert default["launches"] == project(*SMALL, budget_mib=DEFAULT_SCRATCH_MIB)["launches"]
    assert default["launches"] != project(*SMALL, budget_mib=4)["launches"]


# ------------------------------------------------------------------------------------------------ launch structure
def _named(plan: Plan, name: str) -> list[Step]:
    return [s for s in plan.steps if s.name == name]


@pytest.mark.parametrize("n", [1000, 16384, 65536])
def test_one_launch_per_vocabulary_chunk_covers_every_row(n):
    """Launches grow with V / C, never with (N / R) x (V / C): each chunk is one GEMM over all N rows and one
    Triton launch whose grid covers every row block, plus a constant."""
    forward, backward = build_plans(n, H, V)
    cfg = CONFIGS[(PROFILES["h100"].target.family, linear_logprobs.n_bucket(n))]
    logits = _named(forward, "logits")
    c = logits[0].shape[1]
    assert len(logits) == math.ceil(V / c)
    assert all(s.shape[0] == n and s.shape[2] == H for s in logits)
    assert sum(s.shape[1] for s in logits) == V
    stats = _named(forward, "chunk_stats")
    assert len(stats) == len(logits) and all(s.shape[0] == triton.cdiv(n, cfg.block_n) for s in stats)
    assert forward.launches == 2 * len(logits) + 1

    layout = logprob_layout.backward_layout(n, n, H, V, 2, DEFAULT_SCRATCH_MIB * MIB, gathered=False,
                                            need_hidden=True, need_weight=True).walk
    chunks = _named(backward, "logits (recomputed)")
    assert len(chunks) == len(layout.chunks) + len(layout.recompute)
    assert all(s.shape[0] == n for s in chunks) and sum(s.shape[1] for s in chunks) == V + layout.tail
    weights = _named(backward, "d weight")
    assert all(s.shape[2] == n for s in weights)  # dW of a chunk: one GEMM with K = N
    assert sum(s.shape[0] for s in weights) == V  # every row of dW written once
    dlogits = _named(backward, "chunk_dlogits")
    assert len(dlogits) == len(chunks) and all(s.shape[0] == triton.cdiv(n, cfg.block_n) for s in dlogits)
    hidden = _named(backward, "d hidden")
    assert len(hidden) == len(layout.chunks) * len(layout.acc)  # one GEMM per chunk per piece of the accumulator
    # the rest: zeroing the accumulator, casting it into grad_hidden (a budget's worth of rows at a time)
    assert backward.launches - len(chunks) - len(dlogits) - len(weights) - len(hidden) <= 2 + 2 * math.ceil(
        4 * n * H / (DEFAULT_SCRATCH_MIB * MIB)) + 1
    # the budget's chunk bounds the backward's chunk count: its in-gradient chunks are only ever wider
    assert len(layout.chunks) <= math.ceil(V / layout.buffer_chunk) if layout.buffer_chunk else layout.chunks


def test_launches_do_not_grow_with_n_at_a_fixed_chunk_width():
    # a budget proportional to N (the [N, C] buffer plus 64 bytes a row for the statistics) keeps the forward's chunk
    # at 2048 columns: N alone then adds no launch, to the forward or to the (row-striped, d hidden only) backward
    width = 2048
    counts = {}
    for n in (4096, 16384, 65536):
        forward, backward = build_plans(n, H, V, budget_mib=n * (2 * width + 64) / MIB, need_weight=False)
        assert _named(forward, "logits")[0].shape[1] == width
        counts[n] = (forward.launches, backward.launches)
    assert len(set(counts.values())) == 1, counts
    assert counts[4096][0] == 2 * math.ceil(V / width) + 1


def test_launches_grow_with_v_at_most_linearly(target_shape):
    doubled = project(N, H, 2 * V)
    assert target_shape["launches"] < doubled["launches"] <= 2 * target_shape["launches"]
    c = _named(build_plans(N, H, V)[0], "logits")[0].shape[1]  # the forward's chunk: the same at either V
    assert (target_shape["forward_launches"], doubled["forward_launches"]) == (2 * math.ceil(V / c) + 1,
                                                                               2 * math.ceil(2 * V / c) + 1)


# ------------------------------------------------------------------------------------------------ errors and the CLI
@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), "n must be a positive int, got 0"),
    (dict(v=1.5), "v must be a positive int, got 1.5"),
    (dict(dtype="int8"), "dtype must be one of .* got 'int8'"),
    (dict(device="v100"), "device must be one of .* got 'v100'"),
    (dict(budget_mib=0), "budget_mib must be a positive number of MiB or None, got 0"),
])
def test_bad_input_names_the_argument(kwargs, match):
    args = dict(n=16, h=32, v=300) | kwargs
    with pytest.raises(ValueError, match=match):
        project(args.pop("n"), args.pop("h"), args.pop("v"), **args)


def test_cli_json_is_one_object_with_the_keys(capsys):
    assert cost_model.main(["--n", "2048", "--h", "512", "--v", "32000", "--dtype", "fp16", "--device", "h200",
                            "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("launches", "flops", "flops_per_nhv", "hbm_bytes", "extra_bytes", "projected_ms", "gemm_ms", "ratio",
                "device", "device_name", "n", "h", "v", "dtype", "steps", "kinds"):
        assert key in out, key
    assert (out["n"], out["h"], out["v"], out["dtype"], out["device"]) == (2048, 512, 32000, "fp16", "h200")
    assert out == json.loads(json.dumps(project(2048, 512, 32000, dtype="fp16", device="h200")))


def test_cli_table_and_errors(capsys):
    assert cost_model.main(["--n", "2048", "--h", "512", "--v", "32000", "--entropy", "--budget-mib", "8"]) == 0
    out = capsys.readouterr().out
    assert "Projected, not measured" in out and "scratch budget 8 MiB" in out and "entropy" in out
    for name in ("logits", "chunk_stats", "stats_finalize", "logits (recomputed)", "chunk_dlogits", "d hidden",
                 "d weight"):
        assert name in out
    assert cost_model.main(["--n", "0"]) == 2
    assert "n must be a positive int, got 0" in capsys.readouterr().err


def test_cli_all_writes_the_csv(tmp_path, capsys):
    path = tmp_path / "cost_model.csv"
    assert cost_model.main(["--all", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("| ") for line in out.splitlines()) == 1 + 8  # the header, a row per (shape, device)
    rows = list(csv.DictReader(open(path)))
    assert [(r["profile"], int(r["n"])) for r in rows] == [(d, n) for n, _, _ in cost_model.ISSUE_SHAPES
                                                           for d in PROFILES]
    assert all(r["command"] and r["commit"] and r["date"] for r in rows)
    first = project(*cost_model.ISSUE_SHAPES[0], device="h100")
    assert int(rows[0]["launches"]) == first["launches"]
    assert float(rows[0]["ratio"]) == pytest.approx(first["ratio"], abs=1e-4)
