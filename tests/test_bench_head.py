"""bench/bench_head.py on a CPU: the dry run's rows are the cost model's numbers, the device-name mapping, the message
without CUDA, the chunked bare GEMMs' arithmetic, and the driver's rows, budget and errors with the measurement
replaced (the measurement itself runs on a GPU: the gpu-marked test below, and gpu_check.sh's head step)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import bench_head, harness

ROOT = Path(__file__).resolve().parent.parent


def _fake_project(n, h, v, *, dtype="bf16", device="h100", entropy=False, need_hidden=True, need_weight=True,
                  budget_mib=None):
    """Stands in for bench.cost_model.project (same signature and keys): numbers that differ per argument."""
    gemm_ms = 6 * n * h * v / 742e12 * 1e3 * (2.0 if device == "a100" else 1.0)
    projected = gemm_ms * (1.3 + 0.1 * entropy)
    extra = (64 if budget_mib is None else budget_mib) * 2**20 + 4 * n * h
    return {"n": n, "h": h, "v": v, "dtype": dtype, "device": device, "entropy": entropy,
            "need_hidden": need_hidden, "need_weight": need_weight, "launches": 7 + v // 4096,
            "flops": 8 * n * h * v, "flops_per_nhv": 8.0, "hbm_bytes": 3 * v * h + 11 * n,
            "extra_bytes": extra, "projected_ms": projected, "gemm_ms": gemm_ms, "ratio": projected / gemm_ms,
            "profile": {"sms": 132, "peak_tflops": 989.0}}


@pytest.fixture
def cost_model(monkeypatch):
    """A stand-in bench.cost_model whose project records its calls."""
    module = types.ModuleType("bench.cost_model")
    module.calls = []

    def project(*args, **kwargs):
        module.calls.append((args, kwargs))
        return _fake_project(*args, **kwargs)

    module.project = project
    monkeypatch.setitem(sys.modules, "bench.cost_model", module)
    # main() sets the launchers' budget variable for --scratch-mib: set then delete, so the teardown restores it
    monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", "64")
    monkeypatch.delenv("GRPO_FAST_SCRATCH_MIB")
    return module


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_dry_run_rows_are_the_cost_models_numbers(cost_model, monkeypatch, tmp_path, capsys):
    _no_cuda(monkeypatch)
    csv_path, md_path = tmp_path / "head.csv", tmp_path / "head.md"
    shapes = [(4096, 4096, 151936), (123, 64, 1151)]
    rc = bench_head.main(["--dry-run", "--shapes", *(f"{n}x{h}x{v}" for n, h, v in shapes), "--csv", str(csv_path),
                          "--md", str(md_path)])
    assert rc == 0
    assert [c[1] for c in cost_model.calls] == [dict(dtype="bf16", device="h100", entropy=False, need_hidden=True,
                                                     need_weight=True, budget_mib=None)] * 2
    rows = harness.read_csv(csv_path)
    assert [(int(r["N"]), int(r["H"]), int(r["V"])) for r in rows] == shapes
    for row, shape in zip(rows, shapes):
        p = _fake_project(*shape)
        assert float(row["projected_ms"]) == pytest.approx(p["projected_ms"], rel=1e-12)
        assert float(row["projected_gemm_ms"]) == pytest.approx(p["gemm_ms"], rel=1e-12)
        assert float(row["projected_ratio"]) == pytest.approx(p["ratio"], rel=1e-12)
        assert float(row["projected_extra_mib"]) * 2**20 == pytest.approx(p["extra_bytes"], rel=1e-12)
        assert int(row["projected_launches"]) == p["launches"]
        assert float(row["projected_flops_per_nhv"]) == p["flops_per_nhv"]
        assert row["profile"] == "h100" and "no GPU" in row["profile_match"] and row["dtype"] == "bf16"
        assert row["status"] == "projected only (--dry-run)"
        assert "measured_ms" not in row  # nothing measured, no empty measured columns pretending otherwise
        assert row["date"] and row["command"] and row["device"] and row["commit"]
    out = capsys.readouterr().out
    table = md_path.read_text()
    assert table.strip() in out and table.startswith("| shape (N x H x V) | measured ms |")
    assert "| 4096 x 4096 x 151936 |" in table and "| 123 x 64 x 1151 |" in table


def test_dry_run_passes_entropy_budget_and_profile(cost_model, monkeypatch, tmp_path):
    _no_cuda(monkeypatch)
    csv_path = tmp_path / "head.csv"
    rc = bench_head.main(["--dry-run", "--shapes", "300x256x1151", "--entropy", "--scratch-mib", "128",
                          "--profile", "a100", "--csv", str(csv_path)])
    assert rc == 0
    assert cost_model.calls == [((300, 256, 1151), dict(dtype="bf16", device="a100", entropy=True, need_hidden=True,
                                                         need_weight=True, budget_mib=128.0))]
    # the launchers read their budget from the environment: a measured run would use the same 128 MiB
    assert float(os.environ["GRPO_FAST_SCRATCH_MIB"]) == 128.0
    (row,) = harness.read_csv(csv_path)
    p = _fake_project(300, 256, 1151, device="a100", entropy=True, budget_mib=128.0)
    assert float(row["projected_ms"]) == pytest.approx(p["projected_ms"], rel=1e-12)
    assert float(row["projected_extra_mib"]) == pytest.approx(p["extra_bytes"] / 2**20, rel=1e-12)
    assert (row["profile"], row["profile_match"], row["entropy"], row["scratch_mib"]) == \
        ("a100", "--profile", "True", "128.0")


@pytest.mark.parametrize("name, sms, profile", [
    ("NVIDIA H200", 132, "h200"),
    ("NVIDIA H100 80GB HBM3", 132, "h100"),
    ("NVIDIA H100 PCIe", 114, "h100"),
    ("NVIDIA A100-SXM4-80GB", 108, "a100"),
    ("NVIDIA A100 80GB PCIe", 108, "a100"),
    ("NVIDIA GeForce RTX 4090", 128, "rtx4090"),
    ("NVIDIA GH200 480GB", 132, "h200"),
])
def test_a_known_gpu_maps_by_name(name, sms, profile):
    got, how = bench_head.match_profile(name, sms)
    assert got == profile and how.startswith("by name") and repr(name) in how


@pytest.mark.parametrize("name, sms, profile", [
    ("NVIDIA L40S", 142, "h100"),  # 142 is nearest to 132; h100 and h200 tie, the first listed wins
    ("NVIDIA B200", 148, "h100"),
    ("NVIDIA GeForce RTX 4080", 76, "a100"),
    ("NVIDIA GeForce RTX 5090", 170, "h100"),
    ("NVIDIA RTX 6000 Ada Generation", 126, "rtx4090"),
    ("NVIDIA A10", 72, "a100"),
])
def test_an_unknown_gpu_maps_to_the_nearest_sm_count(name, sms, profile):
    got, how = bench_head.match_profile(name, sms)
    assert got == profile
    assert how == f"nearest by SM count ({name!r}: {sms} SMs; {profile}: {bench_head.PROFILE_SMS[profile]})"
    assert all(abs(bench_head.PROFILE_SMS[p] - sms) >= abs(bench_head.PROFILE_SMS[profile] - sms)
               for p in bench_head.PROFILE_SMS)


def test_dry_run_rows_are_the_real_cost_models_numbers(monkeypatch, tmp_path):
    """The same with bench/cost_model.py itself, on a shape it prices in milliseconds."""
    from bench import cost_model

    _no_cuda(monkeypatch)
    csv_path = tmp_path / "head.csv"
    assert bench_head.main(["--dry-run", "--shapes", "300x256x1151", "--profile", "h200", "--csv", str(csv_path)]) == 0
    (row,) = harness.read_csv(csv_path)
    p = cost_model.project(300, 256, 1151, dtype="bf16", device="h200")
    for column, key in [("projected_ms", "projected_ms"), ("projected_gemm_ms", "gemm_ms"),
                        ("projected_ratio", "ratio"), ("projected_launches", "launches")]:
        assert float(row[column]) == pytest.approx(p[key], rel=1e-12), column
    assert float(row["projected_extra_mib"]) * 2**20 == pytest.approx(p["extra_bytes"], rel=1e-12)


def test_without_cuda_it_says_so_in_one_line_and_fails(monkeypatch, capsys):
    _no_cuda(monkeypatch)
    assert bench_head.main(["--shapes", "300x256x1151"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err and "--dry-run" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_the_command_without_cuda_exits_nonzero_with_the_message():
    res = subprocess.run([sys.executable, "-m", "bench.bench_head"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.startswith("bench_head: torch sees no CUDA device") and res.stderr.count("\n") == 1


@pytest.mark.parametrize("bad", ["4096x4096", "0x4096x151936", "4096x4096x-1", "16kx4096x1"])
def test_a_bad_shape_is_an_error_that_names_the_option(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_head.main(["--dry-run", "--shapes", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--shapes" in err and repr(bad) in err and "NxHxV" in err


@pytest.mark.parametrize("argv, what", [(["--reps", "0"], "--reps"), (["--budget-s", "0"], "--budget-s"),
                                        (["--scratch-mib", "-1"], "--scratch-mib")])
def test_bad_numbers_are_errors_that_name_the_option(argv, what, capsys):
    with pytest.raises(SystemExit):
        bench_head.main(argv)
    assert what in capsys.readouterr().err


@pytest.mark.parametrize("chunk", [1151, 512, 384, 128])
def test_the_chunked_bare_gemms_do_the_unchunked_arithmetic(chunk):
    """Any chunk width computes dh = D @ W and dW = D^T @ h for the [N, V] upstream gradient D its chunks read
    (float64, so the comparison is exact up to summation order)."""
    n, h, v = 37, 24, 1151
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    dlogits = torch.randn(n * chunk, generator=gen, dtype=torch.float64)
    gemms, (logits, dh, dw) = bench_head.bare_gemms(hidden, weight, dlogits, chunk)
    gemms()
    d = torch.cat([dlogits[:n * (min(c0 + chunk, v) - c0)].view(n, -1) for c0 in range(0, v, chunk)], dim=1)
    assert d.shape == (n, v)
    torch.testing.assert_close(dh, d @ weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, d.t() @ hidden, rtol=1e-12, atol=1e-12)
    last = (math.ceil(v / chunk) - 1) * chunk
    torch.testing.assert_close(logits[:n * (v - last)].view(n, -1), hidden @ weight[last:].t(), rtol=1e-12,
                               atol=1e-12)


def test_gemm_chunk_is_the_whole_vocabulary_when_it_fits_else_the_widest_that_does():
    n, h, v, elem = 16384, 4096, 151936, 2
    whole = 2 * n * v * elem + (n + v) * h * elem
    assert bench_head.gemm_chunk(n, h, v, elem, int(whole / 0.8) + 1) == v
    free = 8 * 2**30  # an 8 GiB card: [N, V] twice is 9.3 GiB
    c = bench_head.gemm_chunk(n, h, v, elem, free)
    assert c % 128 == 0 and 128 <= c < v
    assert 2 * n * c * elem + (n + v) * h * elem <= 0.5 * free < 2 * n * (c + 128) * elem + (n + v) * h * elem
    with pytest.raises(MemoryError, match="MiB are free"):
        bench_head.gemm_chunk(n, h, v, elem, (n + v) * h * elem)


# --------------------------------------------------------------------------------------------------------------------
# The driver on a CPU, with the GPU measurement replaced


def _fake_measurement(ms_per_nhv: float, check="ok"):
    calls = []

    def measure_shape(shape, *, entropy, warmup, reps, seed):
        calls.append(shape)
        if shape[0] == 999:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        gemm = ms_per_nhv * math.prod(shape)
        return {"fused": {"median_ms": 1.4 * gemm, "min_ms": 1.3 * gemm, "times_ms": [1.4 * gemm, 1.3 * gemm],
                          "extra_bytes": 70 * 2**20, "check": check},
                "gemm": {"median_ms": gemm, "min_ms": 0.9 * gemm, "chunks": 1, "chunk": shape[2]}}

    return measure_shape, calls


@pytest.fixture
def fake_gpu(monkeypatch, cost_model):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_head, "_cuda_profile", lambda args: ("h200", "by name ('NVIDIA H200' contains 'h200')"))
    monkeypatch.setattr(harness, "device_name", lambda device: "NVIDIA H200")


def test_a_measured_row_holds_measured_and_projected_side_by_side(fake_gpu, monkeypatch, tmp_path, capsys):
    measure, calls = _fake_measurement(1e-11)
    monkeypatch.setattr(bench_head, "measure_shape", measure)
    csv_path, md_path = tmp_path / "head.csv", tmp_path / "head.md"
    assert bench_head.main(["--shapes", "4096x4096x151936", "--csv", str(csv_path), "--md", str(md_path)]) == 0
    (row,) = harness.read_csv(csv_path)
    shape = (4096, 4096, 151936)
    gemm_ms, p = 1e-11 * math.prod(shape), _fake_project(*shape, device="h200")
    assert float(row["measured_ms"]) == pytest.approx(1.4 * gemm_ms, abs=1e-3)
    assert float(row["measured_gemm_ms"]) == pytest.approx(gemm_ms, abs=1e-3)
    assert float(row["measured_ratio"]) == pytest.approx(1.4, abs=1e-3)
    assert float(row["measured_extra_mib"]) == 70.0
    assert float(row["projected_ms"]) == pytest.approx(p["projected_ms"], rel=1e-12)
    assert float(row["projected_ratio"]) == pytest.approx(p["ratio"], rel=1e-12)
    assert float(row["measured_vs_projected"]) == pytest.approx(1.4 * gemm_ms / p["projected_ms"], abs=1e-3)
    e = 6 * math.prod(shape) / (989e12 * gemm_ms * 1e-3)
    assert float(row["gemm_e_implied"]) == pytest.approx(e, abs=1e-3)
    assert (row["device"], row["profile"], row["status"], row["check"]) == ("NVIDIA H200", "h200", "measured", "ok")
    assert row["date"] and row["command"] and row["gemm_chunks"] == "1" and row["gemm_note"] == ""
    assert md_path.read_text().strip() in capsys.readouterr().out
    line = f"| 4096 x 4096 x 151936 | {1.4 * gemm_ms:.2f} | {gemm_ms:.2f} | 1.40x | {p['projected_ms']:.2f} |"
    assert line in md_path.read_text()


def test_a_shape_that_would_overrun_the_budget_is_not_started(fake_gpu, monkeypatch, tmp_path):
    # 6 calls of (a) + (b) at 0.59 + 0.42 s on the first shape take 6 s; the second, 16x its N H V, would need 97 s
    measure, calls = _fake_measurement(1e-4)
    monkeypatch.setattr(bench_head, "measure_shape", measure)
    csv_path = tmp_path / "head.csv"
    rc = bench_head.main(["--shapes", "64x64x1024", "256x256x1024", "--warmup", "1", "--reps", "4", "--budget-s",
                          "20", "--csv", str(csv_path)])
    assert rc == 0 and calls == [(64, 64, 1024)]
    rows = harness.read_csv(csv_path)
    assert rows[0]["status"] == "measured"
    assert rows[1]["status"].startswith("skipped: ") and "> budget 20 s" in rows[1]["status"]
    assert rows[1]["measured_ms"] == "" and float(rows[1]["projected_ms"]) > 0  # the projection is still there


def test_an_error_or_a_failed_check_is_a_row_and_a_failure(fake_gpu, monkeypatch, tmp_path, capsys):
    measure, calls = _fake_measurement(1e-9, check="FAIL: logps error 1.0e-01 > bound 1.2e-02")
    monkeypatch.setattr(bench_head, "measure_shape", measure)
    csv_path = tmp_path / "head.csv"
    assert bench_head.main(["--shapes", "999x64x1024", "128x64x1024", "--csv", str(csv_path)]) == 1
    assert calls == [(999, 64, 1024), (128, 64, 1024)]  # the error does not end the run
    rows = harness.read_csv(csv_path)
    assert rows[0]["status"].startswith("error: OutOfMemoryError: CUDA out of memory")
    assert rows[1]["status"] == "measured" and rows[1]["check"].startswith("FAIL")


@pytest.fixture
def cuda_counters(monkeypatch):
    """The CUDA timers and allocator statistics replaced, so the measurement code runs on a CPU (the Triton path
    through the interpreter): every call times 1 ms, the peak is a fixed 5 GiB above a 1 GiB baseline."""
    calls = []

    def time_calls(fn, *, device, reps, warmup=0, setup=None):
        for _ in range(warmup + reps):
            if setup is not None:
                setup()
            calls.append(fn())
        return [1.0] * reps

    monkeypatch.setattr(bench_head, "time_calls", time_calls)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 6 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**30, 2**31))
    return calls


@pytest.mark.parametrize("entropy", [False, True])
def test_the_measurement_runs_the_fused_head_and_checks_it(cuda_counters, entropy):
    """(a) and (b) as a GPU runs them, on the CPU: forward + backward of the Triton path with both gradients, its
    log-probs within the tolerance rule, extra memory = peak - baseline - outputs - gradients, the bare GEMMs in
    vocabulary chunks when [N, V] does not fit (1 GiB free here)."""
    n, h, v = 45, 32, 515
    res = bench_head.measure_shape((n, h, v), entropy=entropy, warmup=0, reps=1, seed=0, device="cpu")
    fused, gemm = res["fused"], res["gemm"]
    assert fused["check"] == "ok" and fused["check_err"] <= fused["check_bound"]
    assert fused["check_grad_err"] <= fused["check_grad_bound"]  # d hidden of the checked rows
    outputs = n * 4 * (2 if entropy else 1)
    assert fused["extra_bytes"] == 5 * 2**30 - outputs - 2 * (n * h + v * h)
    assert fused["median_ms"] == 1.0 and gemm["median_ms"] == 1.0
    assert gemm["chunks"] == 1 and gemm["chunk"] == v  # 45 x 515 twice fits in 1 GiB
    out = cuda_counters[0]
    logps = out[0] if entropy else out
    assert logps.shape == (1, n) and torch.isfinite(logps).all() and (logps < 0).all()


@pytest.mark.gpu
def test_measures_a_small_shape_on_the_gpu(tmp_path):
    """The real measurement on CUDA: a row per shape, the fused log-probs within the tolerance rule, memory and
    times measured (the projection columns too once bench/cost_model.py is there)."""
    csv_path = tmp_path / "head.csv"
    assert bench_head.main(["--shapes", "300x256x1151", "--warmup", "1", "--reps", "2", "--csv", str(csv_path)]) == 0
    (row,) = harness.read_csv(csv_path)
    assert row["status"] == "measured" and row["check"] == "ok"
    assert float(row["measured_ms"]) > 0 and float(row["measured_gemm_ms"]) > 0
    assert float(row["measured_extra_mib"]) >= 0 and row["gemm_chunks"] == "1"
    assert row["projected_ms"] != "" or row["projection_error"].startswith("ModuleNotFoundError")
