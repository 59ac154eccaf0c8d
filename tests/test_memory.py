"""The memory tracker (bench/memtrack.py), the memory bench's step (bench/bench_memory.py) and the memory model of
``grpo-fast fit`` (bench/fit.py): projections against tracked measurements of full steps at CPU sizes."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from bench import bench_memory, fit
from bench.memtrack import StorageTracker, storage_ids
from bench.models import get_model

# ------------------------------------------------------------------------------------------------ the tracker


def test_tracker_counts_each_storage_once_and_subtracts_it_when_freed():
    tracker = StorageTracker(vocab_size=7)
    with tracker:
        with tracker.phase("p"):
            a = torch.empty(1000)  # 4000 bytes
            views = [a.view(10, 100), a[::2], a.unsqueeze(0)]
            assert tracker.live_bytes == 4000
            b = a * 2  # a new storage
            assert tracker.live_bytes == 8000
            del a, views
            assert tracker.live_bytes == 4000  # a's storage is gone with its last view
            del b
    assert tracker.live_bytes == 0
    peak = tracker.peaks["p"]
    assert (peak.peak_bytes, peak.start_bytes, peak.breakdown["other"]) == (8000, 0, 8000)


def test_tracker_sees_the_backward_and_classifies_by_ownership():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 32)
    x = torch.randn(8, 16)
    param_bytes = sum(p.numel() * 4 for p in layer.parameters())

    def owners():
        m = dict.fromkeys(storage_ids(layer.parameters()), "weights")
        m.update(dict.fromkeys(storage_ids(p.grad for p in layer.parameters()), "gradients"))
        return m

    tracker = StorageTracker(vocab_size=1000, owners=owners)
    tracker.register(layer.parameters(), "weights")
    tracker.register([x])
    with tracker:
        with tracker.phase("forward", "activations"):
            y = layer(x).relu()
        with tracker.phase("backward", "activations"):
            y.sum().backward()
    backward = tracker.peaks["backward"]
    assert backward.breakdown["weights"] == param_bytes
    assert backward.breakdown["gradients"] == param_bytes  # the .grad tensors made by the backward
    assert tracker.peaks["forward"].breakdown["activations"] >= 8 * 32 * 4  # the saved relu output


def test_tracker_enters_custom_ops_and_recognises_logits():
    from grpo_fast import fused_logprobs
    from grpo_fast.reference import logprobs_reference

    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(64, 16, generator=gen), torch.randn(5000, 16, generator=gen)
    y = torch.randint(0, 5000, (64,), generator=gen)
    tracker = StorageTracker(vocab_size=5000, hidden_size=16)
    tracker.register([h, w, y])
    with tracker, torch.no_grad():
        with tracker.phase("fused"):
            fused_logprobs(h, w, y, impl="torch")
        with tracker.phase("reference"):
            logprobs_reference(h, w, y)
        with tracker.phase("transposed_weight"):
            w.t().contiguous()  # [H, V]: a weight, not logits
    tile = fit.fused_tile_bytes(64, fit.ModelShape("t", "", 16, 5000, 1, 1, 1, 16, 16, True))
    fused = tracker.peaks["fused"]
    assert fused.peak_bytes - fused.start_bytes >= tile  # the op's internal tile is counted
    assert fused.tag_max["logits"] == 0  # its vocab chunks (4096 < V) are not logits
    assert tracker.peaks["reference"].tag_max["logits"] >= 2 * 64 * 5000 * 4  # z and its log-softmax
    assert tracker.peaks["transposed_weight"].breakdown["logits"] == 0


def test_tracker_tags_the_kv_cache_of_a_rollout_exactly():
    from grpo_fast.train.rollout import SamplingParams, generate

    spec = bench_memory.Shape(layers=2, hidden=32, intermediate=48, heads=4, kv_heads=2, vocab=500, prompts=2,
                              group_size=3, prompt_len=5, completion_len=7)
    torch.manual_seed(0)
    model = __import__("transformers").AutoModelForCausalLM.from_config(spec.config())
    prompts = torch.randint(2, 500, (2, 5))
    tracker = StorageTracker(500, 32)
    tracker.register([*model.parameters(), *model.buffers(), prompts])
    with tracker, tracker.tag_kv_cache(), tracker.phase("rollout"):
        generate(model, prompts, torch.ones_like(prompts), 3, SamplingParams(max_new_tokens=7), eos_token_id=-1,
                 pad_token_id=0)
    # keys and values of 2 layers x 6 rows x 2 kv heads x 8 dims for the 5 + 6 positions cached before the last
    # token, plus one layer's keys of 10 positions: torch.cat makes the longer keys while the shorter still live
    cache = 2 * 2 * 6 * 2 * 8 * (5 + 7 - 1) * 4
    assert tracker.peaks["rollout"].tag_max["kv_cache"] == cache + 6 * 2 * 8 * 10 * 4


# ------------------------------------------------------------------------------------------------ the memory model


def test_measured_decoder_bytes_are_the_saved_tensors_of_a_llama_layer():
    # A Qwen2 layer in float32 with SDPA keeps, per token, 6H + 4I + 2 q_dim + 2 kv_dim + heads + 2 floats for its
    # backward (the measurement; this count is what it came to, and pins it: a change in transformers' layer or in
    # the tracker shows up here first).
    shape = bench_memory.Shape(layers=2, hidden=96, intermediate=200, heads=6, kv_heads=2, vocab=300)
    coeffs = fit.measure_decoder(shape.config(), torch.float32)
    H, I, q, kv, heads = 96, 200, 96, 32, 6
    assert coeffs.token == 4 * (6 * H + 4 * I + 2 * q + 2 * kv + heads + 2)
    assert (coeffs.quad, coeffs.const) == (0.0, 0.0)


@pytest.fixture(scope="module")
def calibrated():
    """Step constants from the calibration shape (2 layers, H=64, V=6000) and the decoder of the test model."""
    torch.set_num_threads(1)
    steps = {m: fit.measure_step(m, "float32") for m in ("ppo", "grpo_reference", "grpo_fused")}
    return steps


# a size the calibration did not see: 3 layers, H=128, V=9000, 2 prompts x 4 completions of 40 tokens
PROJECTED = dict(layers=3, hidden=128, intermediate=352, heads=4, kv_heads=2, vocab=9000, prompts=2, group_size=4,
                 prompt_len=24, completion_len=40)
TOLERANCE = 0.05  # every phase's projected peak within 5% of the tracked measurement


@pytest.mark.parametrize("method", list(fit.METHODS))
def test_projection_matches_a_tracked_step_within_five_percent(method, calibrated):
    spec = bench_memory.Shape(**PROJECTED)
    setup = bench_memory.setup_config(method, spec, torch.device("cpu"), torch.float32, seed=0)
    if setup is None:
        pytest.skip(bench_memory.NOT_AVAILABLE)
    setup.step(phase=lambda _: contextlib.nullcontext())
    measured = bench_memory.tracked_step(setup)
    decoder = fit.measure_decoder(spec.config(), torch.float32)
    base = "grpo_fused" if method == "grpo_shared" else method
    projected = fit.project(method, spec.model_shape(), fit.Step(2, 4, 24, 40), decoder, calibrated[base],
                            compute_bytes=4, device="cpu")
    errors = {p: sum(projected[p].values()) / measured[p].peak_bytes - 1 for p in bench_memory.PHASES}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), {p: f"{e:+.1%}" for p, e in errors.items()}
    # the states are exact (the model counts parameters; the tracker also sees the rotary-embedding buffers)
    buffers = sum(b.numel() * b.element_size() for m in (setup.policy, setup.ref) for b in m.buffers())
    top = max(measured, key=lambda p: measured[p].peak_bytes)
    assert projected[top]["weights"] == measured[top].breakdown["weights"] - buffers


def test_largest_completion_is_the_last_length_that_fits(calibrated):
    shape = bench_memory.Shape(**PROJECTED).model_shape()
    decoder = fit.DecoderBytes(token=4000.0, quad=0.0, const=0.0, base=500.0, base_const=0.0, nograd=1000.0)
    states = fit.states_bytes("grpo_fused", shape, 4)
    budget = states + 200 * 2**20
    T = fit.largest_completion("grpo_fused", shape, budget, 1, 8, 64, decoder, calibrated["grpo_fused"],
                               compute_bytes=4, device="cpu")

    def total(t):
        return fit.peak(fit.project("grpo_fused", shape, fit.Step(1, 8, 64, t), decoder, calibrated["grpo_fused"],
                                    compute_bytes=4, device="cpu"))[0]

    assert T > 1 and total(T) <= budget < total(T + 1)
    assert fit.largest_completion("ppo", shape, states, 1, 8, 64, decoder, calibrated["ppo"], compute_bytes=4,
                                  device="cpu") == 0  # PPO's critic alone does not fit in GRPO's states


# ------------------------------------------------------------------------------------------------ the command


def test_registry_parameter_counts_are_the_published_totals():
    published = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
                 "qwen2.5-7b": 7_615_616_512, "llama-3.1-8b": 8_030_261_248, "gemma-2-2b": 2_614_341_888}
    assert {name: get_model(name).num_params() for name in published} == published
    assert get_model("gemma-2-2b").final_logit_softcapping == 30.0 and get_model("gemma-2-2b").vocab_size == 256000


@pytest.mark.parametrize("text, expected", [("24GB", 24 * 2**30), ("80GiB", 80 * 2**30), ("24576MiB", 24 * 2**30),
                                            ("1.5g", int(1.5 * 2**30))])
def test_parse_memory(text, expected):
    assert fit.parse_memory(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-5", "--memory", "24GB"], "--model: expected one of qwen2.5-0.5b, .*, got 'gpt-5'"),
    (["--model", "qwen2.5-0.5b", "--memory", "lots"], "--memory: expected a size such as 24GB, 80GiB or 24576MiB, "
                                                      "got 'lots'"),
    (["--model", "qwen2.5-0.5b", "--memory", "24GB", "--headroom", "1.5"],
     r"--headroom: expected a fraction in \[0, 1\), got 1.5"),
])
def test_fit_refuses_bad_input_naming_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        fit.main(argv)


def test_fit_prints_a_projected_table_and_what_was_measured(tmp_path, capsys, calibrated):
    decoder = fit.DecoderBytes(token=60000.0, quad=0.0, const=3e7, base=10000.0, base_const=0.0, nograd=30000.0)
    calibration = dict(machine="test", date="today", decoder={"bfloat16": {"qwen2.5-0.5b": decoder.__dict__}},
                       step={"bfloat16": {m: s.__dict__ for m, s in calibrated.items()}})
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration))
    assert fit.main(["--model", "qwen2.5-0.5b", "--memory", "24GB", "--calibration", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PROJECTED largest completion length T" in out and "MEASURED (calibration" in out
    rows = [line for line in out.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 1 and int(rows[0].split("|")[4].replace(",", "")) > 0  # grpo_fused fits at G=8
