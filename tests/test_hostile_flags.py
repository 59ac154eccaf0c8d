"""Issue 31, hostile flags: every option is checked against what the arithmetic, the model and the machine can do
before any work starts (before the model loads where it can be), and refused in one line that names it as the user
typed it (``--temperature``, or the config file's key and the file)."""

from __future__ import annotations

import json
import math
import re
import types

import numpy as np
import pytest
import torch
from train_helpers import save_local_model

from grpo_fast import GRPOLossConfig, LossType, fused_logprobs, group_advantages, grpo_loss, grpo_loss_from_logps
from grpo_fast.checks import FLOAT32_MAX, MIN_TEMPERATURE, describe
from grpo_fast.cli import main
from grpo_fast.reference import logprobs_reference
from grpo_fast.train import trainer
from grpo_fast.train.config import MAX_SEED, TrainConfig, build_config, config_changes
from grpo_fast.train.model import check_context, context_length
from grpo_fast.train.rollout import Rollout
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

TINY = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2", "--max-new-tokens", "2",
        "--progress", "false", "--plot", "false"]
ERROR = "grpo-fast train: error: "


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the run gets as far as loading the model (or generating)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad option was refused")

    monkeypatch.setattr(trainer, "load_model_and_tokenizer", refuse)
    monkeypatch.setattr(trainer, "rollout", refuse)


def _error_line(capsys, argv) -> str:
    """The one line a refused ``grpo-fast train`` prints (exit code 2, no traceback)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and errors[0] == err[-1] and errors[0].startswith(ERROR), err
    return errors[0]


# ------------------------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize("flags, expected", [
    (["--temperature", "1e-40"], "--temperature must be in [0.01, 3.4e+38], got 1e-40: the logits are divided by it, "
                                 "and below 0.01 their float32 quotients overflow"),
    (["--temperature", "0.005"], "--temperature must be in [0.01, 3.4e+38], got 0.005: "),
    (["--temperature", "1e39"], "--temperature must be in [0.01, 3.4e+38], got 1e+39: the ops take it as a float32 "
                                "scalar"),
    (["--temperature", "inf"], "--temperature must be a finite number, got inf"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--loss.sapo_temperature_pos", "1e-300"], "--loss.sapo_temperature_pos must be in [0.01, 3.4e+38], got 1e-300: "
                                                "the loss holds 4 / tau"),
    (["--loss.sapo_temperature_neg", "1e300"], "--loss.sapo_temperature_neg must be in [0.01, 3.4e+38], got 1e+300"),
    (["--loss.epsilon", "1e300"], "--loss.epsilon must be within float32's range (|x| <= 3.4e+38"),
    (["--loss.vespo_k_neg=-1e39"], "--loss.vespo_k_neg must be within float32's range"),
    (["--weight-decay", "inf"], "--weight-decay must be in [0.0, 3.4e+38], got inf"),
    (["--seed", str(2**64 + 1)], f"--seed must be an int in [0, {MAX_SEED}] (torch's generators take 64-bit seeds), "
                                 f"got {2**64 + 1}"),
    (["--seed", str(2**64)], f"--seed must be an int in [0, {MAX_SEED}]"),
    (["--dataset", "nothere.jsonl"], "--dataset: no such file 'nothere.jsonl'"),
    (["--dataset", "builtin:nope"], "--dataset: unknown builtin task 'nope'"),
])
def test_a_bad_flag_is_one_line_naming_it_before_the_model_loads(flags, expected, tmp_path, capsys, no_model_load):
    line = _error_line(capsys, ["train", *TINY, *flags, "--output-dir", str(tmp_path / "run")])
    assert line.startswith(ERROR + expected), line
    assert "Config." not in line  # named as typed, never as a dataclass field
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--dataset", "--eval-dataset"])
def test_a_dataset_that_is_a_directory_says_so(flag, tmp_path, capsys, no_model_load):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "max 1 2=", "answer": "2"}) + "\n")
    directory = tmp_path / "folder.jsonl"
    directory.mkdir()
    argv = ["--dataset", str(directory)] if flag == "--dataset" else ["--dataset", str(data), flag, str(directory)]
    line = _error_line(capsys, ["train", *TINY, *argv, "--output-dir", str(tmp_path / "run")])
    assert line == (f"{ERROR}{flag}: '{directory}' is a directory; expected a .jsonl, .json or .parquet file")


def test_max_new_tokens_past_the_models_context_is_refused_before_generation(tmp_path, capsys, monkeypatch):
    """The tiny model has 64 positions; the builtin task's longest prompt is 14 tokens: 50 new tokens fit, 100000
    used to keep the first evaluation generating for minutes."""
    def refuse(*args, **kwargs):
        raise AssertionError("generation started")

    monkeypatch.setattr(trainer, "rollout", refuse)
    line = _error_line(capsys, ["train", *TINY, "--max-new-tokens", "100000", "--output-dir", str(tmp_path / "run")])
    assert line.startswith(f"{ERROR}--max-new-tokens 100000 does not fit the model's context: the tiny model has 64 "
                           "positions (max_position_embeddings) and the longest prompt (builtin:digits, "), line
    assert line.endswith(" is 14 tokens once rendered, so at most 50 new tokens"), line
    line = _error_line(capsys, ["train", *TINY, "--max-new-tokens", "51", "--output-dir", str(tmp_path / "run")])
    assert "--max-new-tokens 51 does not fit" in line


def test_a_model_directorys_context_is_read_before_its_weights(tmp_path, capsys, no_model_load):
    """A --model directory: its config.json and tokenizer decide, before the weights load."""
    model = save_local_model(tmp_path / "model", "qwen2", None, weights=False)  # 64 positions
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "max 1 2 3 4 5 6 7 8 9 1 2 3 4 5 6 7 8 9=", "answer": "9"}) + "\n")
    line = _error_line(capsys, ["train", *TINY, "--model", model, "--dataset", str(data), "--max-new-tokens", "30",
                                "--output-dir", str(tmp_path / "run")])
    assert line == (f"{ERROR}--max-new-tokens 30 does not fit the model's context: {model} has 64 positions "
                    f"(max_position_embeddings) and the longest prompt ({data}, line 1) is 40 tokens once rendered, "
                    "so at most 24 new tokens")


def test_a_config_files_values_are_named_by_their_key_and_the_file(tmp_path, capsys, no_model_load):
    config = tmp_path / "c.toml"
    config.write_text('seed = 18446744073709551617\ndataset = "nothere.jsonl"\n')
    line = _error_line(capsys, ["train", *TINY, "--config", str(config), "--output-dir", str(tmp_path / "run")])
    assert line.startswith(f"{ERROR}--config {config}: seed must be an int in [0, {MAX_SEED}]"), line
    line = _error_line(capsys, ["train", *TINY, "--config", str(config), "--seed", "3", "--output-dir",
                                str(tmp_path / "run")])
    assert line == f"{ERROR}--config {config}: dataset: no such file 'nothere.jsonl'"
    config.write_text("[loss]\nbeta = -1.0\n")
    line = _error_line(capsys, ["train", *TINY, "--config", str(config), "--output-dir", str(tmp_path / "run")])
    assert line == f"{ERROR}--config {config}: loss.beta must be >= 0.0, got -1.0"


@pytest.mark.parametrize("flags, expected", [
    (["--temperature", "1e-40"], "--temperature must be in [0.01, 3.4e+38], got 1e-40"),
    (["--seed", str(2**70)], f"--seed must be an int in [0, {MAX_SEED}]"),
])
def test_eval_checks_the_same_flags(flags, expected, tmp_path, capsys):
    model = save_local_model(tmp_path / "model", "qwen2", None)
    assert main(["eval", "--model", model, "--dataset", "builtin:digits", "--samples", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"grpo-fast eval: error: {expected}"), err
    assert not any("Traceback" in line for line in err)


# ------------------------------------------------------------------------------------------------ the arithmetic


def _batch(scale: float, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, V = 3, 7, 16, 37
    hidden = torch.randn(B, T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * scale / 4).to(dtype)  # logits of size ~scale
    return hidden, weight, torch.randint(0, V, (B, T), generator=gen), torch.randn(B, generator=gen)


def test_temperatures_below_the_floor_make_the_logits_non_finite():
    """Why the floor: the reference itself gives NaN log-probs at T = 1e-38 for logits of size 100, and the floor's
    own log-probs are finite for logits far larger."""
    hidden, weight, y, _ = _batch(scale=100.0)
    assert not torch.isfinite(logprobs_reference(hidden, weight, y, temperature=1e-38)).all()
    hidden, weight, y, _ = _batch(scale=1e4)
    assert torch.isfinite(logprobs_reference(hidden, weight, y, temperature=MIN_TEMPERATURE)).all()


@pytest.mark.parametrize("loss_type", list(LossType))
def test_the_temperature_floor_gives_a_finite_loss_and_gradient(loss_type):
    """At temperature 0.01, logits of size 100 and a KL term (reference = the policy's own log-probs), every loss
    type's loss and gradients are finite: the floor is inside what the arithmetic takes."""
    hidden, weight, y, adv = _batch(scale=100.0)
    hidden.requires_grad_(), weight.requires_grad_()
    config = GRPOLossConfig(loss_type=loss_type, beta=0.04, temperature=MIN_TEMPERATURE,
                            dro_beta=0.3 if loss_type == LossType.DRO else None)
    with torch.no_grad():
        ref = fused_logprobs(hidden, weight, y, temperature=MIN_TEMPERATURE, impl="torch")
    out = grpo_loss(hidden, weight, y, adv, torch.ones(y.shape), ref_logps=ref, config=config, impl="torch")
    out.loss.backward(torch.tensor(0.7))
    assert math.isfinite(float(out.loss.detach()))
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize("tau", [MIN_TEMPERATURE, 1.0, FLOAT32_MAX])
def test_sapo_gate_temperatures_in_range_give_a_finite_loss(tau):
    gen = torch.Generator().manual_seed(1)
    logps = (-3 * torch.rand(4, 6, generator=gen)).requires_grad_()
    old = (logps.detach() + 0.1 * torch.randn(4, 6, generator=gen)).clamp(max=0)
    config = GRPOLossConfig(loss_type="sapo", sapo_temperature_pos=tau, sapo_temperature_neg=tau)
    for impl in ("torch", "reference"):
        out = grpo_loss_from_logps(logps, torch.randn(4, generator=gen), torch.ones(4, 6), old_logps=old,
                                   config=config, impl=impl)
        out.loss.backward()
        assert math.isfinite(float(out.loss.detach())) and torch.isfinite(logps.grad).all(), impl
        logps.grad = None


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1e-38), dict(temperature=0.0099), dict(sapo_temperature_pos=1e-300),
    dict(sapo_temperature_neg=1e-40), dict(softcap=1e-45), dict(softcap=1e300), dict(delta=1e39),
    dict(epsilon_high=1e300),
])
def test_the_loss_config_refuses_what_makes_the_loss_non_finite(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"^GRPOLossConfig\.{name} must be .*, got {re.escape(repr(value))}"):
        GRPOLossConfig(**kwargs)


def test_the_floor_itself_is_accepted_everywhere():
    GRPOLossConfig(temperature=MIN_TEMPERATURE, sapo_temperature_pos=MIN_TEMPERATURE, softcap=1e-30)
    TrainConfig(temperature=MIN_TEMPERATURE, seed=MAX_SEED)
    hidden, weight, y, _ = _batch(scale=1.0)
    assert torch.isfinite(fused_logprobs(hidden, weight, y, temperature=np.float32(MIN_TEMPERATURE))).all()


def test_float16_logits_that_overflow_give_nan_log_probs_without_an_error():
    """The documented behaviour (fused_logprobs' docstring): a float16 matmul past +-65504 is inf, so NaN out; the
    trainer's checks (below) are where it is caught."""
    hidden, weight, y, _ = _batch(scale=1.0, dtype=torch.float16)
    hidden[0, 0] = 60.0
    weight[y[0, 0]] = 100.0  # the target's logit: 60 * 100 * 16 = 96000 > 65504
    logps = fused_logprobs(hidden, weight, y, impl="torch")
    assert torch.isnan(logps[0, 0]) and torch.isfinite(logps.flatten()[1:]).all()


# ------------------------------------------------------------------------------------------------ the trainer's checks


def _rollout(rows=4, T=3):
    ids = torch.ones(rows, T, dtype=torch.long)
    mask = torch.ones(rows, T, dtype=torch.long)
    mask[1, 2] = 0  # padding: anything may be there
    return Rollout(prompt_ids=ids, prompt_mask=torch.ones_like(ids), completion_ids=ids, completion_mask=mask,
                   sampling_logps=torch.zeros(rows, T), group_size=2)


@pytest.mark.parametrize("where, skipped", [((0, 1), True), ((1, 2), False)])
def test_non_finite_old_or_reference_log_probs_skip_the_step(where, skipped):
    """Finite hidden states, NaN log-probs (float16 logits past 65504): logprobs_of returns None, so the step is
    skipped with a warning rather than raising in grpo_loss's check of old_logps. NaN at padding counts for nothing."""
    ro = _rollout()
    run = types.SimpleNamespace(config=types.SimpleNamespace(micro_batch_size=2), device=torch.device("cpu"),
                                world=trainer.dist_.World())

    def policy(fn, run, ro, rows, pcols, tcols):
        out = torch.full(ro.completion_ids[rows, tcols].shape, -1.0)
        if rows.start <= where[0] < rows.stop:
            out[where[0] - rows.start, where[1]] = float("nan")
        return out

    out = trainer.logprobs_of(run, policy, ro)
    assert (out is None) == skipped


def test_a_skipped_float16_update_names_the_likely_cause(caplog):
    run = types.SimpleNamespace(skipped_updates=0, step=4, dtype=torch.float16)
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        trainer._count_skip(run, "non-finite loss or gradient")
    assert "step 5: non-finite loss or gradient (float16: a logit or activation beyond +-65504 overflows; --dtype " \
           "bfloat16 has float32's range); update skipped (1 so far)" in caplog.text
    run.dtype = torch.bfloat16
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        trainer._count_skip(run, "non-finite loss or gradient")
    assert "float16" not in caplog.text and run.skipped_updates == 2


# ------------------------------------------------------------------------------------------------ contexts


def test_check_context_at_the_boundary():
    config = tiny_model(tiny_tokenizer(), seed=0).config
    assert context_length(config) == (64, "max_position_embeddings")
    check_context(build_config(overrides={"max_new_tokens": "50"}), config, ("data.jsonl, line 3", 14))
    with pytest.raises(ValueError, match=r"^TrainConfig.max_new_tokens 51 does not fit the model's context: the tiny "
                                         r"model has 64 positions \(max_position_embeddings\) and the longest prompt "
                                         r"\(data.jsonl, line 3\) is 14 tokens once rendered, so at most 50 new"):
        check_context(build_config(overrides={"max_new_tokens": "51"}), config, ("data.jsonl, line 3", 14))
    with pytest.raises(ValueError, match="is 64 tokens once rendered, no room for a completion: shorten the prompts"):
        check_context(build_config(overrides={"max_new_tokens": "1"}), config, ("data.jsonl, line 3", 64))
    check_context(build_config(overrides={"max_new_tokens": "51"}), None, ("x", 14))  # nothing declared: no check


def test_the_vllm_engines_max_model_length_is_checked_against_the_model_and_the_prompts():
    config = tiny_model(tiny_tokenizer(), seed=0).config
    longest = ("data.jsonl, line 3", 14)
    run = build_config(overrides={"max_new_tokens": "10", "vllm_max_model_length": "24"})
    check_context(run, config, longest, "vllm")  # 14 + 10 = 24: fits
    check_context(build_config(overrides={"max_new_tokens": "10", "vllm_max_model_length": "23"}), config, longest)
    with pytest.raises(ValueError, match=r"^TrainConfig.vllm_max_model_length 23 is less than the longest prompt "
                                         r"\(data.jsonl, line 3, 14 tokens once rendered\) plus "
                                         r"TrainConfig.max_new_tokens 10: .* make it at least 24, or leave it unset$"):
        check_context(build_config(overrides={"max_new_tokens": "10", "vllm_max_model_length": "23"}), config,
                      longest, "vllm")
    with pytest.raises(ValueError, match=r"^TrainConfig.vllm_max_model_length 65 is more than the 64 positions the "
                                         r"tiny model has \(max_position_embeddings\); vLLM refuses"):
        check_context(build_config(overrides={"vllm_max_model_length": "65"}), config, longest, "vllm")


def test_a_stretching_rope_scaling_counts_its_factor():
    """Qwen2.5's YaRN config says 32768 positions and a factor of 4: 131072, as vLLM counts; llama3's scaling is
    already in max_position_embeddings."""
    yarn = types.SimpleNamespace(max_position_embeddings=32768, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert context_length(yarn)[0] == 131072
    llama3 = types.SimpleNamespace(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    assert context_length(llama3) == (131072, "max_position_embeddings")
    assert context_length(types.SimpleNamespace(n_positions=1024)) == (1024, "n_positions")
    assert context_length(types.SimpleNamespace()) is None


# ------------------------------------------------------------------------------------------------ --resume


def test_a_resume_refusal_lists_only_the_fields_that_changed():
    saved = build_config(overrides={"loss.beta": "0.04"}).to_dict()
    now = build_config(overrides={"loss.beta": "0.1", "steps": "9"}).to_dict()
    assert config_changes(saved, now, keep={"steps"}) == ["loss.beta: 0.04 -> 0.1"]
    assert config_changes(saved, now) == ["loss.beta: 0.04 -> 0.1", "steps: 800 -> 9"]
    del saved["top_k"]  # an older run's checkpoint, without an option this version has
    assert config_changes(saved, now, keep={"steps"}) == ["loss.beta: 0.04 -> 0.1", "top_k: None -> 0"]
    assert config_changes(now, now) == []


# ------------------------------------------------------------------------------------------------ library messages


def test_dimension_counts_read_as_words():
    with pytest.raises(ValueError, match=r"group_advantages: rewards must have 1 or 2 dimensions, got tensor of shape "
                                         r"\(2, 2, 2\)"):
        group_advantages(torch.zeros(2, 2, 2), group_size=2)
    hidden, weight, y, _ = _batch(scale=1.0)
    with pytest.raises(ValueError, match=r"grpo_loss: advantages must have 1 or 2 dimensions"):
        grpo_loss(hidden, weight, y, torch.zeros(3, 7, 1), torch.ones(3, 7), impl="torch")
    with pytest.raises(ValueError, match=r"grpo_loss_from_logps: logps must have 2 dimensions"):
        grpo_loss_from_logps(torch.zeros(3), torch.zeros(3), torch.ones(3))


@pytest.mark.parametrize("weights, message", [
    (["a", "b"], "reward_weights must have 2 entries (one per reward column), finite numbers as a list, tuple or 1-d "
                 "tensor; got list ['a', 'b']"),
    ([1.0], "reward_weights must have 2 entries (one per reward column), finite numbers as a list, tuple or 1-d "
            "tensor; got list [1.0]"),
    ("ab", "got str 'ab'"),
    (np.float64(2.0), "got numpy.float64 np.float64(2.0)"),
    (torch.ones(2, 1), "got tensor of shape (2, 1)"),
    (torch.tensor([True, False]), "dtype torch.bool"),
    ([1.0, float("nan")], "reward_weights must be finite, got 1 NaN/inf value(s) (nan)"),
    ([10**400, 1], "reward_weights must be finite, got 1 NaN/inf value(s) (inf)"),
])
def test_reward_weights_that_are_not_numbers_name_the_argument(weights, message):
    with pytest.raises(ValueError, match="^group_advantages: .*" + re.escape(message)):
        group_advantages(torch.randn(4, 2), group_size=2, reward_weights=weights)


def test_reward_weights_of_every_numeric_kind_agree():
    rewards = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    want = group_advantages(rewards, group_size=2, reward_weights=[1.0, 2.0]).advantages
    for weights in ([1, 2], (1.0, 2.0), np.array([1.0, 2.0]), [np.float32(1), np.int64(2)], torch.tensor([1, 2])):
        assert torch.equal(group_advantages(rewards, group_size=2, reward_weights=weights).advantages, want), weights


def test_numpy_bools_are_bools_and_other_values_are_not():
    config = GRPOLossConfig(use_bias_correction_kl=np.False_)
    assert config.use_bias_correction_kl is False and json.loads(config.to_json())["use_bias_correction_kl"] is False
    assert config == GRPOLossConfig(use_bias_correction_kl=False)
    for value in (1, "no", None):
        with pytest.raises(TypeError, match=rf"GRPOLossConfig.use_bias_correction_kl must be True or False, got "
                                            rf"{type(value).__name__}"):
            GRPOLossConfig(use_bias_correction_kl=value)
    assert describe(np.True_) == "numpy.bool np.True_"


def test_return_entropy_must_be_a_bool():
    hidden, weight, y, _ = _batch(scale=1.0)
    for value in ("no", 0, None):
        with pytest.raises(TypeError, match=f"fused_logprobs: return_entropy must be True or False, got "
                                            f"{type(value).__name__}"):
            fused_logprobs(hidden, weight, y, return_entropy=value)
    logps, entropy = fused_logprobs(hidden, weight, y, return_entropy=np.True_)
    assert torch.equal(logps, fused_logprobs(hidden, weight, y, return_entropy=np.False_))


def test_train_config_bools_from_python_must_be_bools():
    assert TrainConfig(progress=np.False_).progress is False
    for name, value in (("progress", "no"), ("resume", 1), ("plot", None)):
        with pytest.raises(TypeError, match=rf"^TrainConfig.{name} must be True or False, got {type(value).__name__}"):
            TrainConfig(**{name: value})
