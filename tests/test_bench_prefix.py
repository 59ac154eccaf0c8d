"""bench/bench_prefix.py: the shared-prefix training-step benchmark on a tiny model.

The end-to-end test runs ``main`` for two configurations with the children called in this process (process isolation
is the harness's, tested with it; here it would only add seconds of imports per child), then checks the CSV row by
row against the analytic counts and the plot. The memory figures of an in-process run are not meaningful, so only
their presence is checked.
"""

import csv
import importlib
import math

import pytest
import torch

from bench import bench_prefix, harness
from grpo_fast.train.shared_prefix import token_counts

TINY = ["--hidden", "64", "--layers", "1", "--vocab", "300", "--total-len", "18", "--ratios", "8:1", "1:2",
        "--group-sizes", "3", "--groups", "2", "--warmup", "0", "--reps", "2"]


def _in_process(target, params, **_):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(**params)


def test_split_length_and_bound():
    assert bench_prefix.split_length(512, "8:1") == (455, 57)
    assert bench_prefix.split_length(512, "1:1") == (256, 256)
    assert bench_prefix.split_length(512, "1:8") == (57, 455)
    assert bench_prefix.split_length(3, "100:1") == (2, 1)  # both parts keep at least one token
    for P, C, G in [(455, 57, 16), (256, 256, 4), (57, 455, 16), (7, 3, 1)]:
        unshared, shared = token_counts(P, C, 1, G)
        assert bench_prefix.bound(P, C, G) == pytest.approx(unshared / shared)
    assert bench_prefix.bound(455, 57, 16) == pytest.approx(16 * 512 / (455 + 16 * 57))


def test_flop_ratio_is_at_most_the_token_bound():
    cfg = bench_prefix.model_config(256, 4, 32768)
    assert cfg["intermediate_size"] == 1376  # 256 * 4864 / 896, to a multiple of 32
    for P, C, G in [(455, 57, 16), (256, 256, 4), (57, 455, 16)]:
        unshared, shared = bench_prefix.step_flops(cfg, P, C, G, groups=2)
        assert 1.0 < unshared / shared <= bench_prefix.bound(P, C, G)
    # without a loss head and attention the FLOPs scale with the tokens: the ratio is the bound itself
    bare = dict(cfg, vocab_size=0, num_attention_heads=0)
    unshared, shared = bench_prefix.step_flops(bare, 455, 57, 16, groups=1)
    assert unshared / shared == pytest.approx(bench_prefix.bound(455, 57, 16))


def test_end_to_end_tiny_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "run_isolated", _in_process)
    out = tmp_path / "prefix.csv"
    rc = bench_prefix.main([*TINY, "--device", "cpu", "--csv", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["ratio"], r["P"], r["C"], r["G"]) for r in rows] == [("8:1", "16", "2", "3"), ("1:2", "6", "12", "3")]
    for r in rows:
        P, C, G = int(r["P"]), int(r["C"]), int(r["G"])
        assert r["error"] == "" and r["check"] == "ok", r
        # counted at the decoder's input during the run, and checked against token_counts by the bench
        assert (int(r["tokens_unshared"]), int(r["tokens_shared"])) == token_counts(P, C, 2, G)
        assert float(r["bound"]) == pytest.approx(G * (P + C) / (P + G * C), abs=1e-4)
        assert 1.0 < float(r["flop_ratio"]) <= float(r["bound"])
        # the guard compared real values: three float32/float64 losses that agree, within a bound that is not vacuous
        losses = [float(r[k]) for k in ("loss_fp64", "loss_unshared", "loss_shared")]
        assert max(losses) - min(losses) <= 1e-4 and abs(losses[0]) > 1e-3
        assert float(r["loss_err"]) <= float(r["loss_bound"]) < 1e-4
        assert float(r["logps_err"]) <= float(r["logps_bound"]) < 1e-4
        # the timed fp32 steps computed the checked loss
        assert float(r["unshared_loss"]) == pytest.approx(losses[1], abs=1e-5)
        assert float(r["shared_loss"]) == pytest.approx(losses[2], abs=1e-5)
        assert float(r["speedup"]) == pytest.approx(float(r["unshared_ms"]) / float(r["shared_ms"]), rel=1e-2)
        assert len(r["unshared_times_ms"].split(";")) == len(r["shared_times_ms"].split(";")) == 2
        for key in ("unshared_peak_mib", "shared_peak_mib", "grads_mib"):
            assert math.isfinite(float(r[key])) and float(r[key]) >= 0
        assert r["memory_method"] == "rss_hwm" and r["dtype"] == "fp32" and r["command"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| 8:1 | 16 | 2 | 3 | 108 | 44 | 2.45x |" in printed
    assert all(float(r["cpu_speedup"]) == pytest.approx(float(r["unshared_cpu_ms"]) / float(r["shared_cpu_ms"]),
                                                         rel=1e-2) for r in rows)


def test_a_wrong_shared_forward_is_caught_and_not_timed(tmp_path, monkeypatch):
    """The guard can fail: a shared forward that drops the prompt's last position breaks the rule."""
    from grpo_fast.train import shared_prefix

    real = shared_prefix.shared_prefix_forward

    def wrong(model, prompt_ids, prompt_mask, *rest, **kw):
        return real(model, prompt_ids[:, 1:], prompt_mask[:, 1:], *rest, **kw)

    monkeypatch.setattr(shared_prefix, "shared_prefix_forward", wrong)
    shape = dict(ratio="8:1", P=16, C=2, G=3, groups=1, hidden=64, layers=1, vocab=300, seed=0)
    res = bench_prefix.run_config(shape=shape, modes=["unshared", "shared"], check_first=True, device="cpu",
                                  dtype="fp32", threads=torch.get_num_threads(), warmup=0, reps=1, backend="sdpa")
    assert res["check"]["check"] == "FAIL" and res["check"]["logps_err"] > res["check"]["logps_bound"]
    assert set(res) == {"check"}  # nothing timed
