"""The memory tracker (bench/memtrack.py), the memory bench's step (bench/bench_memory.py) and the memory model of
``grpo-fast fit`` (grpo_fast/memory/, calibrated by bench/calibrate_memory.py): projections against tracked
measurements of full steps at CPU sizes, for full fine-tuning, LoRA and activation checkpointing."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from pathlib import Path

import pytest
import torch

from bench import bench_memory, calibrate_memory
from bench.memtrack import StorageTracker, storage_ids
from grpo_fast.memory import fit, projection
from grpo_fast.memory.models import ModelShape, get_model
from grpo_fast.memory.projection import Training

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
    tile = projection.fused_tile_bytes(64, ModelShape("t", "", 16, 5000, 1, 1, 1, 16, 16, True))
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


def test_measured_decoder_bytes_are_the_saved_tensors_of_a_qwen2_layer():
    # A Qwen2 layer in float32 with SDPA keeps, per token, 6H + 4I + 2 q_dim + 2 kv_dim + heads + 2 floats for its
    # backward (the measurement; this count is what it came to, and pins it: a change in transformers' layer or in
    # the tracker shows up here first). With activation checkpointing a layer keeps its input only, and the backward
    # recomputes one whole layer.
    full, ckpt = _measure_decoder(), _measure_decoder(Training(checkpointing=True))
    assert full.layer == Bytes(token=_FULL_LAYER_TOKEN)
    assert ckpt.layer == Bytes(token=4 * H)
    assert ckpt.backward.token > full.layer.token  # one layer's activations and the gradients in flight


def test_measured_decoder_bytes_with_lora_drop_the_frozen_weights_inputs():
    # With a frozen base (LoRA) no weight gradient needs the MLP's inputs (H and I) or the two norms' normalised
    # inputs (2H); each of the 4 adapters saves its [S, r] lora_A output.
    pytest.importorskip("peft")
    lora = _measure_decoder(Training(lora_r=8))
    assert lora.layer == Bytes(token=_FULL_LAYER_TOKEN - 4 * (3 * H + I) + 4 * 4 * 8)


H, I, Q_DIM, KV_DIM, HEADS = 96, 200, 96, 32, 6
_FULL_LAYER_TOKEN = 4 * (6 * H + 4 * I + 2 * Q_DIM + 2 * KV_DIM + HEADS + 2)


def _measure_decoder(training=Training()):
    config = bench_memory.Shape(layers=2, hidden=H, intermediate=I, heads=HEADS, kv_heads=2, vocab=300).config()
    return calibrate_memory.measure_decoder(config, torch.float32, training)


Bytes = projection.Bytes


class Measured:
    """Step constants at the calibration shape and decoder coefficients of the test model, measured once each, in
    the training modes of the calibration (LoRA at its rank)."""

    def __init__(self, spec):
        self.spec = spec

    @functools.cache
    def step(self, method: str, dtype: str, mode: str) -> projection.StepBytes:
        return calibrate_memory.measure_step(method, dtype, calibrate_memory.training_of(mode))

    @functools.cache
    def decoder(self, dtype: str, mode: str) -> projection.DecoderBytes:
        return calibrate_memory.measure_decoder(self.spec.config(), getattr(torch, dtype),
                                                calibrate_memory.training_of(mode))


# a size the calibration did not see: 3 layers, H=128, V=9000, 2 prompts x 4 completions of 40 tokens; LoRA at
# another rank (8) than the calibration's (16)
PROJECTED = dict(layers=3, hidden=128, intermediate=352, heads=4, kv_heads=2, vocab=9000, prompts=2, group_size=4,
                 prompt_len=24, completion_len=40)
TOLERANCE = 0.05  # every phase's projected peak within 5% of the tracked measurement
FULL, CKPT, LORA, LORA_CKPT = Training(), Training(checkpointing=True), Training(lora_r=8), Training(8, True)
CASES = [*((m, "float32", FULL) for m in projection.METHODS), ("grpo_fused", "float32", CKPT),
         ("grpo_fused", "float32", LORA), *((m, "float32", LORA_CKPT) for m in ("grpo_reference", "grpo_fused",
                                                                                 "grpo_shared")),
         ("grpo_fused", "bfloat16", LORA_CKPT)]  # bf16 under CPU autocast: the calibration's other dtype


@pytest.fixture(scope="module")
def measured():
    torch.set_num_threads(1)
    return Measured(bench_memory.Shape(**PROJECTED))


@pytest.mark.parametrize("method, dtype, training", CASES, ids=[f"{m}-{d}-{t.mode}" for m, d, t in CASES])
def test_projection_matches_a_tracked_step_within_five_percent(method, dtype, training, measured):
    if training.lora_r:
        pytest.importorskip("peft")
    spec = bench_memory.Shape(**PROJECTED)
    setup = bench_memory.setup_config(method, spec, torch.device("cpu"), getattr(torch, dtype), seed=0,
                                      training=training)
    if setup is None:
        pytest.skip(bench_memory.NOT_AVAILABLE)
    setup.step(phase=lambda _: contextlib.nullcontext())
    tracked = bench_memory.tracked_step(setup)
    base = "grpo_fused" if method == "grpo_shared" else method
    projected = projection.project(method, spec.model_shape(), projection.Step(2, 4, 24, 40),
                                   measured.decoder(dtype, training.mode), measured.step(base, dtype, training.mode),
                                   compute_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
                                   device="cpu", training=training, calibrated_lora_r=calibrate_memory.LORA_R)
    errors = {p: sum(projected[p].values()) / tracked[p].peak_bytes - 1 for p in bench_memory.PHASES}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), {p: f"{e:+.1%}" for p, e in errors.items()}
    # the states are exact (the model counts parameters; the tracker also sees the rotary-embedding buffers)
    buffers = sum(b.numel() * b.element_size() for m in (setup.policy, setup.ref) if m is not None
                  for b in m.buffers())
    top = max(tracked, key=lambda p: tracked[p].peak_bytes)
    assert projected[top]["weights"] == tracked[top].breakdown["weights"] - buffers
    steps = 4 * sum(p.requires_grad for p in setup.policy.parameters())  # AdamW's float32 step counters
    assert projected[top]["optimizer"] == tracked[top].breakdown["optimizer"] - steps


def test_lora_parameter_count_is_what_the_trainer_trains():
    pytest.importorskip("peft")
    spec = bench_memory.Shape(**PROJECTED)
    policy = bench_memory.build_policy(spec.config(), torch.device("cpu"), torch.bfloat16, LORA)
    trained = [p for p in policy.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trained) == spec.model_shape().lora_params(8, projection.lora_targets())
    assert {p.dtype for p in trained} == {torch.float32}  # peft keeps the adapters in float32 over a bf16 base
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert get_model("qwen2.5-0.5b").lora_params(16, projection.lora_targets()) == 2_162_688


def test_largest_completion_is_the_last_length_that_fits(measured):
    shape = bench_memory.Shape(**PROJECTED).model_shape()
    decoder = projection.DecoderBytes(layer=Bytes(4000.0), outside=Bytes(500.0), forward_layer=Bytes(4000.0),
                                      forward_outside=Bytes(600.0), backward=Bytes(1500.0), nograd=1000.0)
    step = measured.step("grpo_fused", "float32", "full")
    states = sum(projection.states_bytes("grpo_fused", shape, 4).values())
    budget = states + 200 * 2**20
    T = projection.largest_completion("grpo_fused", shape, budget, 1, 8, 64, decoder, step, compute_bytes=4,
                                      device="cpu")

    def total(t):
        return projection.peak(projection.project("grpo_fused", shape, projection.Step(1, 8, 64, t), decoder, step,
                                                  compute_bytes=4, device="cpu"))[0]

    assert T > 1 and total(T) <= budget < total(T + 1)
    assert projection.largest_completion("ppo", shape, states, 1, 8, 64, decoder, measured.step("ppo", "float32",
                                         "full"), compute_bytes=4, device="cpu") == 0  # the critic does not fit


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
    # a value that starts with '-' is the value, not an option argparse would answer with its usage text
    (["--model", "qwen2.5-0.5b", "--memory", "-5GB"], "--memory: expected a size such as 24GB, 80GiB or 24576MiB, "
                                                      "got '-5GB'"),
    (["--memory", "-0.5GB", "--model", "qwen2.5-0.5b"], "--memory: expected a size .*, got '-0.5GB'"),
    (["--model", "qwen2.5-0.5b", "--memory", "24GB", "--headroom", "1.5"],
     r"--headroom: expected a fraction in \[0, 1\), got 1.5"),
    (["--model", "qwen2.5-0.5b", "--memory", "24GB", "--lora-r", "-4"], "--lora-r: expected an integer >= 0"),
])
def test_fit_refuses_bad_input_naming_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        fit.main(argv)


def test_the_package_ships_the_calibration_and_never_imports_bench():
    calibration = projection.load_calibration()  # from the package, wherever it is installed
    assert projection.calibration_path().parent == Path(projection.__file__).parent
    modes = {mode for dtype in ("float32", "bfloat16") for mode in calibration["decoder"][dtype]}
    assert modes == set(projection.MODES) and calibration["lora_r"] == calibrate_memory.LORA_R
    sources = [path.read_text() for path in Path(projection.__file__).parent.glob("*.py")]
    assert not any(line.lstrip().startswith(("import bench", "from bench")) for text in sources
                   for line in text.splitlines())


def test_fit_prints_the_usual_trainings_and_lora_lets_a_7b_model_into_24gb(capsys):
    assert fit.main(["--model", "qwen2.5-7b", "--memory", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "MEASURED (calibration grpo_fast/memory/calibration.json" in out
    tables = out.split("PROJECTED largest completion length T for each group size G, ")[1:]
    assert [t.split(" (0:")[0] for t in tables] == [
        "full fine-tuning", "full fine-tuning + activation checkpointing",
        "LoRA r=16 on q_proj, k_proj, v_proj, o_proj + activation checkpointing"]

    def row(table, G):
        line = next(line for line in table.splitlines() if line.startswith(f"| {G} |"))
        return [int(cell.replace(",", "")) for cell in line.strip("| ").split(" | ")[1:]]

    # 7.6B parameters: full fine-tuning's states alone are 7.6 x 14 B = 99 GiB; LoRA's bf16 base is 14 GiB
    assert row(tables[0], 1) == [0, 0, 0, 0] and row(tables[1], 1) == [0, 0, 0]
    assert len(row(tables[2], 8)) == 3 and all(T > 0 for T in row(tables[2], 8))  # no PPO column with LoRA
    assert fit.main(["--summary", "8", "--memory", "24GB", "--lora-r", "16"]) == 0
    summary = capsys.readouterr().out
    assert "LoRA r=16 on q_proj, k_proj, v_proj, o_proj:" in summary and "checkpointing" not in summary.split(
        "MEASURED")[0]


def test_fit_reads_another_calibration_file(tmp_path, capsys):
    calibration = projection.load_calibration()
    calibration["machine"] = "another machine"
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration))
    assert fit.main(["--model", "qwen2.5-0.5b", "--memory", "24GB", "--lora-r", "0", "--calibration",
                     str(path)]) == 0
    out = capsys.readouterr().out
    assert f"MEASURED (calibration {path}: another machine" in out and out.count("PROJECTED") == 1


@pytest.mark.parametrize("text, message", [
    ("{}", "has no 'machine' entry (a calibration holds 'machine', 'date', 'lora_r', 'decoder', 'step')"),
    ("[]", "must hold a JSON object, got list"),
    ("{", "is not valid JSON"),
    (None, "'lora_r' must be a JSON integer, got '16'"),
])
def test_fit_names_what_a_calibration_file_lacks(tmp_path, text, message):
    if text is None:
        text = json.dumps({**projection.load_calibration(), "lora_r": "16"})
    path = tmp_path / "calibration.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"--calibration: {path}.*" + message.replace("(", r"\(").replace(")", r"\)")):
        fit.main(["--model", "qwen2.5-0.5b", "--memory", "24GB", "--calibration", str(path)])


@pytest.mark.parametrize("memory", ["0", "0GB", "0MiB", "0.0TiB"])
def test_fit_refuses_no_memory_the_same_way_for_every_unit(memory):
    with pytest.raises(ValueError, match=rf"^--memory: expected a size such as 24GB, 80GiB or 24576MiB, got "
                                         rf"'{re.escape(memory)}'"):
        fit.main(["--model", "qwen2.5-0.5b", "--memory", memory])


def test_fit_refuses_a_memory_that_holds_nothing_and_names_what_the_smallest_step_needs(capsys):
    """1 MiB, or 10 GB for a 7B model, would print tables of zeros: one line instead, with the smallest step asked
    about (LoRA, checkpointing, G=1, T=1) and the memory it needs, which does fit."""
    calibration = projection.load_calibration()
    lora = fit.USUAL_TRAININGS[2]
    needs = {m: fit.need_at_one_token(calibration, "qwen2.5-7b", m, 1, fit.build_parser().parse_args(
        ["--model", "qwen2.5-7b"]), lora) for m in lora.methods()}
    method = min(needs, key=needs.get)
    for memory in ("1MiB", "10GB"):
        with pytest.raises(ValueError) as info:
            fit.main(["--model", "qwen2.5-7b", "--memory", memory])
        assert str(info.value) == (
            f"--memory: {memory} holds nothing: the smallest step it was asked about (qwen2.5-7b, {method}, "
            f"{lora.describe()}, G=1, T=1) needs {needs[method] / fit.GIB:.1f} GiB, so at least "
            f"{needs[method] / 0.9 / fit.GIB:.1f} GiB with 10% kept free (--headroom)")
    enough = f"{math.ceil(needs[method] / 0.9 / fit.GIB * 10) / 10:.1f}GB"
    assert fit.main(["--model", "qwen2.5-7b", "--memory", enough]) == 0
    assert "| 1 | 0 | 0 | 0 |" not in capsys.readouterr().out.split("LoRA r=16")[1]  # LoRA's row for G=1 fits
    with pytest.raises(ValueError, match=r"^--memory: 1MiB holds nothing: the smallest step it was asked about "
                                         r"\(qwen2.5-0.5b, .*, G=8, T=1\) needs"):
        fit.main(["--summary", "8", "--memory", "1MiB"])


def test_the_cli_prints_a_memory_refusal_as_one_line(capsys):
    from grpo_fast.cli import main

    assert main(["fit", "--model", "qwen2.5-7b", "--memory", "1MiB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("grpo-fast fit: error: --memory: 1MiB holds nothing: ")
    assert len(captured.err.strip().splitlines()) == 1
