"""The pieces the doctor, the benchmarks and the tests share: the timers (``grpo_fast.benchmarking.time_calls``,
under ``bench.harness.measure``, and ``PhaseTimer``), the dtype-name table (``grpo_fast.dtypes``) and the seeded
input builders (``grpo_fast.testing.loss_inputs`` and its parts)."""

from __future__ import annotations

import time

import pytest
import torch

from bench import harness
from grpo_fast.benchmarking import PhaseTimer, time_calls
from grpo_fast.dtypes import ALIASES, DTYPES, NAMES, SHORT_DTYPES, dtype_name
from grpo_fast.testing import head_inputs, loss_inputs, right_padded_mask, upstream_grads


def test_time_calls_runs_setup_before_every_call_and_times_the_reps_only():
    events = []
    times = time_calls(lambda: events.append("call"), device="cpu", reps=3, warmup=2,
                       setup=lambda: events.append("setup"))
    assert events == ["setup", "call"] * 5
    assert len(times) == 3 and all(t >= 0.0 for t in times)


@pytest.mark.parametrize("reps, warmup", [(0, 1), (1, -1)])
def test_time_calls_refuses_no_reps_and_negative_warmup(reps, warmup):
    with pytest.raises(ValueError, match="reps >= 1 and warmup >= 0"):
        time_calls(lambda: None, device="cpu", reps=reps, warmup=warmup)


def test_measure_reports_the_timer_s_reps_and_a_cpu_memory_figure():
    calls = []
    m = harness.measure(lambda: calls.append(torch.ones(1000)), warmup=1, reps=2, device="cpu")
    assert len(calls) == 3 and len(m.times_ms) == 2 and m.median_ms >= m.min_ms
    assert m.memory_method == "rss_hwm" and m.peak_extra_bytes >= 0


def test_one_dtype_table_with_its_aliases():
    assert set(DTYPES) == {"float32", "bfloat16", "float16"}
    assert {alias: DTYPES[name] for alias, name in ALIASES.items()} == SHORT_DTYPES
    assert list(SHORT_DTYPES) == ["fp32", "bf16", "fp16"]  # the order bench.cost_model's and bench_prefix's --help show
    assert all(NAMES[dtype] == name == dtype_name(dtype) for name, dtype in DTYPES.items())
    assert dtype_name(torch.float64) == "float64"


def test_loss_inputs_are_seeded_and_draw_the_logps_last():
    kw = dict(seed=3, min_length=5, full_first_row=True)
    a = loss_inputs(4, 9, 8, 33, **kw)
    b = loss_inputs(4, 9, 8, 33, **kw)
    assert a.keys() == b.keys() == {"hidden", "weight", "target_ids", "completion_mask", "advantages", "ref_logps"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    lengths = a["completion_mask"].sum(1)
    assert lengths[0] == 9 and bool((lengths >= 5).all()) and a["completion_mask"].dtype == torch.bool
    # old log-probs around the policy's own: drawn after everything else, which stays as it was
    c = loss_inputs(4, 9, 8, 33, **kw, old_logps=True, logps_center=lambda h, w, y, b: torch.zeros(y.shape),
                    logps_noise=0.3)
    assert all(torch.equal(a[k], c[k]) for k in ("hidden", "weight", "target_ids", "completion_mask", "advantages"))
    assert c["old_logps"].shape == c["ref_logps"].shape == (4, 9) and c["old_logps"].dtype == torch.float32
    assert not torch.equal(c["old_logps"], c["ref_logps"])


def test_loss_inputs_cast_after_drawing():
    x64 = loss_inputs(2, 5, 8, 17, draw_dtype=torch.float64)
    x = loss_inputs(2, 5, 8, 17, draw_dtype=torch.float64, dtype=torch.bfloat16, requires_grad=True,
                    mask_dtype=torch.int64)
    assert x64["hidden"].dtype == torch.float64 and not x64["hidden"].requires_grad
    assert x["hidden"].dtype == x["weight"].dtype == torch.bfloat16 and x["hidden"].requires_grad
    assert x["hidden"].is_leaf and x["weight"].requires_grad and x["completion_mask"].dtype == torch.int64
    assert torch.equal(x["hidden"].detach(), x64["hidden"].to(torch.bfloat16))
    assert x["advantages"].dtype == x["ref_logps"].dtype == torch.float32


def test_phase_timer_times_each_phase_by_context_or_by_hooks(monkeypatch):
    clock = iter([1.0, 1.5, 2.0, 2.25, 3.0, 3.125, 4.0, 4.5])  # seconds: each phase's start, then its end
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    timer = PhaseTimer("cpu", ("a", "b"))
    with timer.phase("a"):
        pass
    timer.start("b")
    timer.stop("b")
    with timer.phase("a"):
        pass
    with pytest.raises(ZeroDivisionError), timer.phase("c"):  # a phase that raises is still timed
        1 / 0
    assert timer.ms == {"a": [500.0, 125.0], "b": [250.0], "c": [500.0]}
    with pytest.raises(RuntimeError, match="phase 'b' was not started"):
        timer.stop("b")


def test_loss_inputs_options_add_their_draws_after_the_others():
    """A bias is drawn between the weight and the targets, the sampling ratio last; per-token advantages and an
    empty middle row change only those values' shapes and the lengths."""
    base = loss_inputs(5, 7, 8, 33, seed=2, draw_dtype=torch.float64, old_logps=True)
    x = loss_inputs(5, 7, 8, 33, seed=2, draw_dtype=torch.float64, old_logps=True, sampling="sequence")
    assert all(torch.equal(base[k], x[k]) for k in base) and x["sampling_ratio"].shape == (5, 1)
    assert bool(((x["sampling_ratio"] >= 0.5) & (x["sampling_ratio"] < 1.5)).all())
    b = loss_inputs(5, 7, 8, 33, seed=2, draw_dtype=torch.float64, bias_scale=0.1, advantages_per_token=True,
                    empty_middle_row=True)
    assert b["bias"].shape == (33,) and b["advantages"].shape == (5, 7) and "sampling_ratio" not in b
    assert b["completion_mask"][2].sum() == 0 and torch.equal(b["hidden"], base["hidden"])
    assert not torch.equal(b["target_ids"], base["target_ids"])  # the bias's draw comes first
    with pytest.raises(ValueError, match="sampling must be None, 'token' or 'sequence', got 'row'"):
        loss_inputs(2, 3, 4, 5, sampling="row")


def test_head_mask_and_upstream_builders():
    gen = torch.Generator().manual_seed(0)
    hidden, weight, bias, y = head_inputs((3, 4), 16, 50, gen, logit_scale=3.0, bias_scale=None)
    assert hidden.shape == (3, 4, 16) and weight.shape == (50, 16) and bias is None and y.shape == (3, 4)
    assert 2.0 < float(hidden.std()) < 4.0 and int(y.min()) >= 0 and int(y.max()) < 50
    mask = right_padded_mask(6, 5, gen, min_length=2, full_first_row=True, empty_middle_row=True)
    lengths = mask.sum(1)
    assert lengths[0] == 5 and lengths[3] == 0 and bool((lengths[[1, 2, 4, 5]] >= 2).all())
    assert torch.equal(mask, torch.arange(5)[None, :] < lengths[:, None])  # right-padded
    g, ge = upstream_grads(10, gen, dead=[0, 9], no_logp_grad=slice(None, None, 4), no_entropy_grad=[5])
    assert g.dtype == ge.dtype == torch.float64
    assert (g == 0).nonzero().squeeze(1).tolist() == [0, 4, 8, 9]
    assert (ge == 0).nonzero().squeeze(1).tolist() == [0, 5, 9]
