"""The memory model's QLoRA and optimizer terms (grpo_fast/memory/projection.py) against measurements.

- States, exactly: the 4-bit base (with and without double quantization) and the 8-bit AdamW states (LoRA, and a
  full fine-tune whose embedding keeps 32-bit states) against the storages of the models and optimizers the trainer
  builds.
- Whole steps, within 15%: every phase of bench/bench_qlora.py's committed measurement (bench/results/
  qlora_cpu.csv: full fine-tuning, LoRA, QLoRA, QLoRA + 8-bit AdamW of a 50M Qwen2 with grpo-fast's fused loss), and
  the same four set-ups measured now at a smaller size, each against the projection from decoder coefficients
  measured now at that architecture's widths and the shipped calibration's step coefficients.
- ``grpo-fast fit --load-in-4bit --optim adamw_8bit``: what it prints for the 7-8B models in 16 and 24 GB.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("trl")  # bench/bench_qlora.py builds its tokenizer with the TRL test fixtures

from bench import bench_qlora, calibrate_memory, harness  # noqa: E402
from grpo_fast.memory import fit, projection  # noqa: E402
from grpo_fast.memory.models import get_model  # noqa: E402
from grpo_fast.memory.projection import Training  # noqa: E402
from grpo_fast.train.model import attach_lora, load_model_and_tokenizer, make_optimizer  # noqa: E402

TOLERANCE = 0.15  # every phase's projected peak within 15% of the tracked measurement
CSV = harness.RESULTS_DIR / "qlora_cpu.csv"
SMALL = dict(layers=2, hidden=256, intermediate=704, heads=4, kv_heads=2, vocab=9000, prompts=2, group_size=4,
             prompt_len=24, completion_len=40)  # adapters of >= 4096 elements: some 8-bit states



@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("small") / "model"
    bench_qlora.save_model(bench_qlora.Shape(**SMALL), directory, seed=0)
    return str(directory)


def training_of(config: str, **kw) -> Training:
    c = bench_qlora.CONFIGS[config]
    return Training(lora_r=c["lora_r"], load_in_4bit=c["load_in_4bit"], optim=c["optim"], **kw)


def _storage_bytes(tensors) -> int:
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


# --------------------------------------------------------------------------------------------- states, exactly


@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_weights_are_exact(small_model, double_quant):
    cfg = dataclasses.replace(bench_qlora.train_config("qlora", small_model), bnb_4bit_use_double_quant=double_quant)
    model, _ = load_model_and_tokenizer(cfg, torch.device("cpu"), torch.float32)
    model = attach_lora(model, cfg)
    tracked = _storage_bytes([*model.parameters(), *bench_qlora.quant_state_tensors(model)])
    training = Training(lora_r=16, load_in_4bit=True, double_quant=double_quant)
    projected = projection.states_bytes("grpo_fused", bench_qlora.Shape(**SMALL).model_shape(), 4, training)
    assert projected["weights"] == tracked


@pytest.mark.parametrize("config", ["qlora_8bit", "full"])
def test_8bit_optimizer_states_are_exact(small_model, config):
    """After one step: the states bitsandbytes' 8-bit AdamW keeps (uint8 moments and their block scales; float32
    moments for small tensors and the embedding) are what the model counts."""
    cfg = dataclasses.replace(bench_qlora.train_config(config, small_model), optim="adamw_8bit")
    model, _ = load_model_and_tokenizer(cfg, torch.device("cpu"), torch.float32)
    if cfg.lora_r:
        model = attach_lora(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg, 1e-3, torch.device("cpu"), model)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert {t.dtype for t in states} == {torch.uint8, torch.float32}
    training = dataclasses.replace(training_of(config), optim="adamw_8bit")
    shape = bench_qlora.Shape(**SMALL).model_shape()
    assert projection.optimizer_state_bytes(shape, training) == _storage_bytes(states)


# --------------------------------------------------------------------------------------------- whole steps


def _decoder(shape: bench_qlora.Shape, training: Training):
    """Decoder coefficients of ``shape``'s architecture measured now (QLoRA's are LoRA's: the mode's)."""
    base = Training(lora_r=training.lora_r, checkpointing=training.checkpointing)
    return calibrate_memory.measure_decoder(shape.config(), torch.float32, base)


def _projected(shape: bench_qlora.Shape, training: Training, decoder) -> dict[str, float]:
    """``{phase: projected bytes}`` of bench_qlora's grpo-fast step; its rollout and prepare as the bench's."""
    step_bytes = projection.StepBytes(**projection.load_calibration()["step"]["float32"][training.mode]["grpo_fused"])
    phases = projection.project("grpo_fused", shape.model_shape(), projection.Step(
        shape.prompts, shape.group_size, shape.prompt_len, shape.completion_len), decoder, step_bytes,
        compute_bytes=4, device="cpu", training=training, calibrated_lora_r=calibrate_memory.LORA_R)
    return {p: sum(c.values()) for p, c in phases.items()}


def _errors(projected: dict, measured: dict) -> dict[str, float]:
    return {p: projected[p] / measured[p] - 1 for p in measured}


@pytest.fixture(scope="module")
def committed():
    rows = [r for r in harness.read_csv(CSV) if r["trainer"] == "grpo_fast" and r["phase"] != "step"]
    assert {r["config"] for r in rows} == set(bench_qlora.CONFIGS)
    r0 = rows[0]
    shape = bench_qlora.Shape(**{k: int(r0[k]) for k in dataclasses.asdict(bench_qlora.Shape())})
    return shape, rows


@pytest.mark.parametrize("config", list(bench_qlora.CONFIGS))
def test_projection_matches_the_committed_measurement(committed, config):
    shape, rows = committed
    training = training_of(config)
    measured = {r["phase"]: float(r["peak_mib"]) * harness.MIB for r in rows if r["config"] == config}
    errors = _errors(_projected(shape, training, _decoder(shape, training)), measured)
    assert all(abs(e) <= TOLERANCE for e in errors.values()), {p: f"{e:+.1%}" for p, e in errors.items()}
    # the states exactly, to the CSV's rounding (3 decimals of a MiB), less the rotary buffer the tracker counts
    row = next(r for r in rows if r["config"] == config and r["phase"] == "optimizer")
    states = projection.states_bytes("grpo_fused", shape.model_shape(), 4, training)
    head_dim = shape.hidden // shape.heads
    weights = (float(row["weights_mib"]) + float(row["adapters_mib"])) * harness.MIB - 4 * head_dim // 2
    references = 2 if not training.lora_r else 1  # full fine-tuning's frozen float32 reference copy
    assert abs(weights - states["weights"]) <= references * 1e-3 * harness.MIB


@pytest.mark.parametrize("config", list(bench_qlora.CONFIGS))
def test_projection_matches_a_step_measured_now(small_model, config):
    shape = bench_qlora.Shape(**SMALL)
    result = bench_qlora.run_grpo_fast(config, dataclasses.asdict(shape), small_model, reps=1, seed=0, threads=1)
    measured = {p: v["peak"] for p, v in result["peaks"].items()}
    training = training_of(config)
    errors = _errors(_projected(shape, training, _decoder(shape, training)), measured)
    assert all(abs(e) <= TOLERANCE for e in errors.values()), {p: f"{e:+.1%}" for p, e in errors.items()}


# --------------------------------------------------------------------------------------------- grpo-fast fit


def _tables(out: str) -> dict[str, list[str]]:
    tables = out.split("PROJECTED largest completion length T for each group size G, ")[1:]
    return {t.split(" (0:")[0]: t.splitlines() for t in tables}


def _row(lines: list[str], G: int) -> list[int]:
    line = next(line for line in lines if line.startswith(f"| {G} |"))
    return [int(cell.replace(",", "").rstrip("+")) for cell in line.strip("| ").split(" | ")[1:]]


@pytest.mark.parametrize("model", ["qwen2.5-7b", "llama-3.1-8b"])
def test_fit_with_a_4bit_base_and_8bit_adamw(model, capsys):
    """QLoRA r=16 with and without checkpointing; with checkpointing the 7-8B models run G=8 in 16 GB, where the
    bf16 LoRA base alone (14 GiB) leaves nothing, and at 24 GB longer completions than bf16 LoRA."""
    for memory in ("16GB", "24GB"):
        assert fit.main(["--model", model, "--memory", memory, "--load-in-4bit", "--optim", "adamw_8bit"]) == 0
        tables = _tables(capsys.readouterr().out)
        qlora = "QLoRA r=16 on q_proj, k_proj, v_proj, o_proj over a 4-bit base"
        assert list(tables) == [f"{qlora}, adamw_8bit", f"{qlora} + activation checkpointing, adamw_8bit"]
        ckpt = tables[f"{qlora} + activation checkpointing, adamw_8bit"]
        assert all(T > 0 for T in _row(ckpt, 8)) and len(_row(ckpt, 8)) == 3  # no PPO column
        lora = ["--model", model, "--memory", memory, "--lora-r", "16", "--gradient-checkpointing"]
        if memory == "16GB":  # the bf16 base alone does not leave room for one token
            with pytest.raises(ValueError, match=r"^--memory: 16GB holds nothing: the smallest step"):
                fit.main(lora)
            continue
        assert fit.main(lora) == 0
        bf16 = _row(_tables(capsys.readouterr().out)["LoRA r=16 on q_proj, k_proj, v_proj, o_proj + activation "
                                                      "checkpointing"], 8)
        assert all(q > 2 * b > 0 for q, b in zip(_row(ckpt, 8), bf16))


def test_fit_states_line_and_optimizer(capsys):
    assert fit.main(["--model", "qwen2.5-7b", "--memory", "24GB", "--load-in-4bit", "--gradient-checkpointing"]) == 0
    out = capsys.readouterr().out
    shape = get_model("qwen2.5-7b")
    states = projection.states_bytes("grpo_fused", shape, 2, Training(lora_r=16, checkpointing=True,
                                                                      load_in_4bit=True))
    assert f"grpo_fused {sum(states.values()) / fit.GIB:.1f} GiB" in out
    assert "(4-bit base with its compute-dtype embeddings, adapters, their AdamW)" in out
    # the default optimizer is the trainer's, fused, without step temporaries; torch's unfused AdamW on CUDA (the
    # foreach step) holds one float32 temporary per trained parameter at the optimizer step
    step = projection.Step(1, 8, 512, 64)
    calibration = projection.load_calibration()

    def optimizer_phase(optim):
        training = Training(optim=optim)
        decoder, logits = projection.coefficients(calibration, shape.name, "grpo_fused", "bfloat16", training)
        phases = projection.project("grpo_fused", shape, step, decoder, logits, compute_bytes=2, device="cuda",
                                    training=training)
        return phases["optimizer"]["optimizer"]

    assert optimizer_phase("adamw_torch_fused") == 8.0 * shape.num_params()
    assert optimizer_phase("adamw_torch") == 12.0 * shape.num_params()


def test_fit_refuses_4bit_without_lora(capsys):
    from grpo_fast.cli import main

    assert main(["fit", "--model", "qwen2.5-7b", "--memory", "24GB", "--load-in-4bit", "--lora-r", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--load-in-4bit needs LoRA" in err and "--lora-r R > 0, got 0" in err
