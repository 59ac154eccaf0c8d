"""``FastGRPOTrainer`` (grpo_fast.integrations.trl) against TRL 1.16's own ``GRPOTrainer``.

Every parity check uses the project's one tolerance rule (``grpo_fast.testing.assert_close_rule``, docs/design.md §5):
``err(FastGRPOTrainer in float32, oracle) <= 2 * err(GRPOTrainer in float32, oracle) + ATOL[float32]``. The oracle is
TRL's own ``_compute_loss`` run on a float64 copy of the model whose log-probs come from the model's full float64
logits (``MaterializedLogitsGRPOTrainer`` in tests/trl_fixtures.py), so it is TRL's semantics without TRL's float32
fused head. Compared: every per-step value the trainers log (loss, grad_norm, kl, entropy, clip ratios, ...) and the
final parameters, or, on the direct loss path, the loss, every parameter gradient and the metrics.

- Training: three optimizer steps of gradient accumulation 2 from a tiny random Qwen2 saved to a temporary folder,
  for every loss type with untied and tied embeddings, then one option at a time. Completions come from a scripted
  ``rollout_func`` (TRL's own hook; tests/trl_fixtures.py ``scripted_rollout``): with TRL's sampling, step 2's
  completions depend on step 1's weights, which float32 and float64 runs round differently, and one token drawn
  near a boundary of the cumulative distribution split the runs in an earlier version of these tests. Generation is
  not what the drop-in changes; one test still trains through TRL's own seeded sampling, for one step from the same
  weights. Every run asserts it scored the same completions. The optimizer is plain SGD (learning rate 0.5), so the
  final parameters are a linear function of the gradients: Adam's ``g / (sqrt(v) + eps)`` turns the rounding of a
  near-zero gradient into a step of up to ``lr``, which measures Adam's conditioning, not the loss (with Adam at
  lr 1e-2 the float32-vs-float64 parameter error of TRL itself reached 6e-5, noise rather than signal).
- Loss path: one generated batch through ``_compute_loss`` of the three trainers, for the inputs training on CPU
  cannot produce (vLLM importance-sampling ratios, a tool mask, sampler log-probs for the off-policy mask), eval
  mode, a partial accumulation window and models with a logit scale or a final softcap.
- Refusals, import hygiene, and a plain ``GRPOTrainer`` left untouched in the same process.

The tiny models run with one intra-op thread (restored afterwards): on a loaded 2-core machine OpenMP's spin-waits
make each 32-wide matmul ~100x slower with two.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

trl = pytest.importorskip("trl")
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning"),
]

import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_fixtures import (  # noqa: E402
    MaterializedLogitsGRPOTrainer,
    build_tiny_grpo_trainer,
    load_tiny_tokenizer,
    save_tiny_model,
    scripted_rollout,
    token_sum_reward,
)

from grpo_fast import LossType  # noqa: E402
from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402
from grpo_fast.testing import assert_close_rule  # noqa: E402

F32, F64 = torch.float32, torch.float64
PROMPTS = ["w1 w2", "w3 w4 w5", "w6", "w7 w8"]
G = 4  # num_generations; a micro-batch is 4 completions, one group
MAX_LEN = 8  # max_completion_length
# Not compared: wall-clock values and what the scheduler sets.
UNCOMPARED = {"step_time", "learning_rate", "epoch", "step"}
TRL_COMPUTE_LOSS = GRPOTrainer._compute_loss
TRL_LOGPS = GRPOTrainer._get_per_token_logps_and_entropies


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {
        "untied": save_tiny_model(tmp_path_factory.mktemp("qwen2_untied")),
        "tied": save_tiny_model(tmp_path_factory.mktemp("qwen2_tied"), tie_word_embeddings=True),
    }


def _epsilon_high(loss_type):
    return 1.1 if loss_type == "cispo" else 0.28  # cispo: the cap on the ratio itself, low enough to bind


# ---------------------------------------------------------------------------------------------------------------------
# Training parity


@dataclass
class Run:
    completions: list
    history: list  # one dict per optimizer step
    params: torch.Tensor  # every parameter, flattened, float64
    trainer: GRPOTrainer = field(repr=False)


def _train(trainer_cls, dtype, model_dir, output_dir, *, model=None, peft_config=None, sampling=False,
           env_mask=False, **config) -> Run:
    """Train ``max_steps`` (3) optimizer steps; ``sampling``: TRL's own generation instead of the scripted rollout."""
    record = []
    settings = dict(max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=G, num_generations=G,
                    max_completion_length=MAX_LEN, optim="sgd", learning_rate=0.5, bf16=False, logging_strategy="steps",
                    logging_steps=1)
    settings.update(config)
    if dtype != F32 and model is None:
        settings["model_init_kwargs"] = {"dtype": dtype}
    trainer_kwargs = {} if sampling else {"rollout_func": scripted_rollout(MAX_LEN, env_mask=env_mask)}
    if peft_config is not None:
        trainer_kwargs["peft_config"] = peft_config
    trainer = build_tiny_grpo_trainer(model_dir, output_dir, [token_sum_reward(record)], PROMPTS,
                                      trainer_cls=trainer_cls, model=model, trainer_kwargs=trainer_kwargs, **settings)
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    params = torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()])
    return Run(record, history, params, trainer)


def _assert_training_parity(tmp_path, model_dir, models=None, **config) -> tuple[Run, Run, Run]:
    """Fast (float32), then TRL (float32, after Fast in the same process), then the float64 oracle."""
    models = models or {}
    out = _train(FastGRPOTrainer, F32, model_dir, tmp_path / "fast", model=models.get(F32), **config)
    out_pt = _train(GRPOTrainer, F32, model_dir, tmp_path / "trl", model=models.get("pt"), **config)
    out_ref = _train(MaterializedLogitsGRPOTrainer, F64, model_dir, tmp_path / "ref", model=models.get(F64), **config)
    assert out.completions == out_pt.completions == out_ref.completions, "the runs sampled different completions"
    assert len(out.history) == len(out_ref.history) == config.get("max_steps", 3)
    for step, (h, h_pt, h_ref) in enumerate(zip(out.history, out_pt.history, out_ref.history)):
        assert set(h) == set(h_pt) == set(h_ref), f"step {step}: logged keys differ: {set(h) ^ set(h_ref)}"
    for key in sorted(set().union(*out_ref.history) - UNCOMPARED):  # steps that reuse a batch log no rollout stats
        values = [torch.tensor([h[key] for h in run.history if key in h], dtype=F64) for run in (out, out_pt, out_ref)]
        assert_close_rule(*values, F32, f"logged {key!r} per step")
    assert_close_rule(out.params, out_pt.params, out_ref.params, F32, "parameters after training")
    return out, out_pt, out_ref


def _initial_params(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


@pytest.mark.parametrize("embeddings", ["untied", "tied"])
@pytest.mark.parametrize("loss_type", [t.value for t in LossType if t.in_trl])
def test_training_matches_grpo_trainer(model_dirs, tmp_path, loss_type, embeddings):
    """beta > 0 (a reference model), num_iterations = 2 (old log-probs, clipping), TRL's other defaults (dapo's
    num_items_in_batch scaling, use_bias_correction_kl=True)."""
    out, _, _ = _assert_training_parity(tmp_path, model_dirs[embeddings], loss_type=loss_type, beta=0.04,
                                        num_iterations=2, epsilon_high=_epsilon_high(loss_type))
    assert (out.params - _initial_params(model_dirs[embeddings])).abs().max() > 1e-3, "training did not move"
    assert all(abs(h["loss"]) > 1e-4 for h in out.history[1:]) and out.history[1]["kl"] > 0
    if LossType(loss_type).is_clip_family:
        assert max(h["clip_ratio/region_mean"] for h in out.history) > 0, "no ratio was clipped"
    elif loss_type == "cispo":
        assert max(h["cispo_clip_ratio"] for h in out.history) > 0
    if embeddings == "tied":
        model = out.trainer.model
        assert model.lm_head.weight is model.model.embed_tokens.weight


TRAINING_OPTIONS = {
    "steps_per_generation_dapo": dict(loss_type="dapo", steps_per_generation=4),
    "steps_per_generation_grpo": dict(loss_type="grpo", steps_per_generation=4),
    "entropy_bonus_dapo": dict(loss_type="dapo", entropy_coef=0.05, num_iterations=2),
    "entropy_bonus_bnpo": dict(loss_type="bnpo", entropy_coef=0.05, num_iterations=2),
    "top_entropy_and_bonus_grpo": dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.05,
                                       num_iterations=2),
    "top_entropy_dapo": dict(loss_type="dapo", top_entropy_quantile=0.3, num_iterations=2),
    "temperature": dict(loss_type="dapo", temperature=0.7, num_iterations=2),
    "sequence_level": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2),
    "delta_no_bias_correction": dict(loss_type="dapo", delta=1.05, beta=0.04, use_bias_correction_kl=False,
                                     num_iterations=2),
    "off_policy_mask": dict(loss_type="dapo", off_policy_mask_threshold=1e-4, steps_per_generation=4),
    "off_policy_mask_bonus_sapo": dict(loss_type="sapo", off_policy_mask_threshold=1e-4, entropy_coef=0.05,
                                       steps_per_generation=4),
    "env_mask_dapo": dict(loss_type="dapo", env_mask=True, num_iterations=2),  # TRL's tool mask, from the rollout
    "env_mask_top_entropy_luspo": dict(loss_type="luspo", env_mask=True, top_entropy_quantile=0.5, entropy_coef=0.05,
                                       num_iterations=2),
}


@pytest.mark.parametrize("option", list(TRAINING_OPTIONS))
def test_training_matches_grpo_trainer_options(model_dirs, tmp_path, option):
    out, _, _ = _assert_training_parity(tmp_path, model_dirs["untied"], **TRAINING_OPTIONS[option])
    if "entropy_coef" in TRAINING_OPTIONS[option]:
        assert all("policy_loss" in h and h["entropy_coef"] == 0.05 for h in out.history)


def test_training_with_trls_own_sampling(model_dirs, tmp_path):
    """One step through TRL's seeded ``model.generate`` (same seed, same weights, so the same completions)."""
    out, _, _ = _assert_training_parity(tmp_path, model_dirs["untied"], sampling=True, max_steps=1, beta=0.04)
    assert len(out.completions) == 1 and len({tuple(c) for c in out.completions[0]}) > 1


def test_frozen_lm_head(model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["untied"]

    def frozen(dtype):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.lm_head.weight.requires_grad_(False)
        return model

    models = {F32: frozen(F32), "pt": frozen(F32), F64: frozen(F64)}
    head_before = models[F32].lm_head.weight.detach().clone()
    out, _, _ = _assert_training_parity(tmp_path, model_dir, models=models, loss_type="dapo", num_iterations=2)
    assert torch.equal(out.trainer.model.lm_head.weight, head_before)
    assert (out.params - _initial_params(model_dir)).abs().max() > 1e-3


@pytest.mark.parametrize("head", ["frozen", "modules_to_save"])
def test_lora_with_reference_via_disabled_adapter(model_dirs, tmp_path, head):
    """LoRA on the backbone; the lm_head frozen by PEFT, or trained as a full copy (``modules_to_save``, whose
    ``.weight`` is the copy, and the original again while the adapter is disabled for the reference pass)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                             modules_to_save=["lm_head"] if head == "modules_to_save" else None)
    out, _, _ = _assert_training_parity(tmp_path, model_dirs["untied"], peft_config=config, loss_type="grpo",
                                        beta=0.04, num_iterations=2)
    assert out.history[1]["kl"] > 0, "the disabled-adapter reference gave no KL"
    params = dict(out.trainer.model.named_parameters())
    lora = [p for n, p in params.items() if "lora_B" in n]
    assert lora and all(p.abs().max() > 0 for p in lora), "the LoRA B matrices did not train"
    wrapper = out.trainer.model.get_output_embeddings()
    if head == "modules_to_save":
        copy, original = wrapper.modules_to_save["default"].weight, wrapper.original_module.weight
        assert not torch.equal(copy, original), "the lm_head copy did not train"


# ---------------------------------------------------------------------------------------------------------------------
# The loss path on one batch: inputs and modes that CPU training cannot produce


def tiny_granite(vocab_size):
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    return GraniteForCausalLM(GraniteConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        logits_scaling=0.25, tie_word_embeddings=False,
    ))


def tiny_cohere(vocab_size):
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    return CohereForCausalLM(CohereConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        logit_scale=3.0,
    ))


def tiny_gemma2(vocab_size):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, final_logit_softcapping=0.5,
    ))


class LossPath:
    """Fast / TRL (float32) and the float64 oracle on one model, plus one generated batch (TRL's own rollout)."""

    def __init__(self, model_dir, output_dir, prompts=PROMPTS[:2], oracle_overrides=None, **config):
        """``config``: GRPOConfig overrides for all three; ``oracle_overrides``: for the float64 oracle only."""
        settings = dict(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=8, bf16=False,
                        beta=0.04, num_iterations=2)
        settings.update(config)
        self.trainers = {}
        # The oracle first: accelerate keeps one process-wide state, and the last trainer built sets its mixed
        # precision (the oracle never enters accelerator.autocast(), the other two do).
        for name, cls, dtype in (("out_ref", MaterializedLogitsGRPOTrainer, F64), ("out", FastGRPOTrainer, F32),
                                 ("out_pt", GRPOTrainer, F32)):
            extra = {"model_init_kwargs": {"dtype": dtype}, **(oracle_overrides or {})} if dtype == F64 else {}
            self.trainers[name] = build_tiny_grpo_trainer(model_dir, output_dir / name, [token_sum_reward()],
                                                          prompts, trainer_cls=cls, **{**settings, **extra})
        trainer = self.trainers["out_pt"]
        trainer.model.train()
        torch.manual_seed(0)
        self.batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])

    def configure(self, **attributes):
        """Set trainer attributes that TRL's ``_compute_loss`` reads (TRL copies them from the config at init)."""
        for trainer in self.trainers.values():
            for key, value in {**self.DEFAULTS, **attributes}.items():
                setattr(trainer, key, value)

    DEFAULTS = dict(loss_type="dapo", epsilon_high=0.28, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
                    entropy_coef=0.0, _entropy_bonus_enabled=False, use_vllm=False,
                    vllm_importance_sampling_correction=False)

    def run(self, inputs, *, train=True, ga=2, **attributes):
        """``_compute_loss`` of each trainer on ``inputs`` with ``attributes`` (the rest at ``DEFAULTS``):
        {name: (loss, flat grads, {metric: value})}."""
        self.configure(**attributes)
        results = {}
        for name in ("out", "out_pt", "out_ref"):
            trainer = self.trainers[name]
            trainer.model.train(train)
            trainer.current_gradient_accumulation_steps = ga
            trainer.model.zero_grad(set_to_none=True)
            trainer._metrics = {"train": _ListDict(), "eval": _ListDict()}
            dtype = F64 if name == "out_ref" else F32
            cast = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
            loss = trainer._compute_loss(trainer.model, cast)
            loss.backward()
            grads = torch.cat([p.grad.double().flatten() for p in trainer.model.parameters() if p.grad is not None])
            mode = "train" if train else "eval"
            results[name] = (loss.detach().double(), grads, {k: v[-1] for k, v in trainer._metrics[mode].items()})
        return results


class _ListDict(dict):
    def __missing__(self, key):
        self[key] = []
        return self[key]


def _assert_loss_parity(results, dtype=F32):
    (loss, grads, metrics), (loss_pt, grads_pt, metrics_pt), (loss_ref, grads_ref, metrics_ref) = results.values()
    assert set(metrics) == set(metrics_pt) == set(metrics_ref), f"metrics differ: {set(metrics) ^ set(metrics_ref)}"
    assert_close_rule(loss, loss_pt, loss_ref, dtype, "loss")
    assert grads_ref.abs().max() > 0 and grads.shape == grads_ref.shape
    assert_close_rule(grads, grads_pt, grads_ref, dtype, "parameter gradients")
    for key in metrics_ref:
        values = [torch.tensor(m[key], dtype=F64) for m in (metrics, metrics_pt, metrics_ref)]
        assert_close_rule(*values, dtype, f"metric {key!r}")
    return metrics


@pytest.fixture(scope="module")
def loss_path(model_dirs, tmp_path_factory):
    return LossPath(model_dirs["untied"], tmp_path_factory.mktemp("loss_path"))


def _sampling_ratio(batch, level, seed=0):
    B, T = batch["completion_ids"].shape
    gen = torch.Generator().manual_seed(seed)
    shape = (B, T) if level == "token" else (B, 1)
    return torch.exp(0.3 * torch.randn(shape, generator=gen))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", [t.value for t in LossType if t.in_trl])
def test_vllm_importance_sampling_ratio(loss_path, loss_type, level):
    """``inputs["importance_sampling_ratio"]`` (vLLM's correction; VESPO folds it into its gamma weight)."""
    inputs = dict(loss_path.batch, importance_sampling_ratio=_sampling_ratio(loss_path.batch, level))
    with_ratio = loss_path.run(inputs, loss_type=loss_type, epsilon_high=_epsilon_high(loss_type), use_vllm=True,
                               vllm_importance_sampling_correction=True)
    _assert_loss_parity(with_ratio)
    without = loss_path.run(loss_path.batch, loss_type=loss_type, epsilon_high=_epsilon_high(loss_type))
    assert abs(float(with_ratio["out"][0] - without["out"][0])) > 1e-4, "the sampling ratio changed nothing"


LOSS_PATH_CASES = {
    "tool_mask": dict(loss_type="dapo"),
    "eval_mode": dict(loss_type="dapo", train=False),
    "eval_mode_grpo": dict(loss_type="grpo", train=False),
    "partial_accumulation_window": dict(loss_type="dapo", ga=3),
    "off_policy_mask_with_sampler_logps": dict(loss_type="bnpo", off_policy_mask_threshold=0.05),
    "bonus_and_top_entropy_dapo": dict(loss_type="dapo", top_entropy_quantile=0.4, entropy_coef=0.1,
                                       _entropy_bonus_enabled=True),
}


@pytest.mark.parametrize("case", list(LOSS_PATH_CASES))
def test_loss_path_cases(loss_path, case):
    options = dict(LOSS_PATH_CASES[case])
    train, ga = options.pop("train", True), options.pop("ga", 2)
    inputs = dict(loss_path.batch)
    B, T = inputs["completion_ids"].shape
    gen = torch.Generator().manual_seed(1)
    if case == "tool_mask":
        inputs["tool_mask"] = (torch.rand(B, T, generator=gen) > 0.3).long()
    if case.startswith("off_policy"):
        old = inputs["old_per_token_logps"]
        inputs["sampling_per_token_logps"] = old + 0.3 * torch.randn(B, T, generator=gen).abs()
    results = loss_path.run(inputs, train=train, ga=ga, **options)
    metrics = _assert_loss_parity(results)
    assert ("policy_loss" in metrics) == ("entropy_coef" in options)
    if case.startswith("off_policy"):  # the mask must drop some, not all, negative-advantage sequences
        trainer = loss_path.trainers["out_pt"]
        kl = ((inputs["sampling_per_token_logps"] - old) * inputs["completion_mask"]).sum(-1)
        kl = kl / inputs["completion_mask"].sum(-1).clamp(min=1)
        dropped = (inputs["advantages"] < 0) & (kl > trainer.off_policy_mask_threshold)
        assert dropped.any() and not dropped.all()


@pytest.mark.parametrize("factory", [tiny_granite, tiny_cohere, tiny_gemma2], ids=lambda f: f.__name__)
def test_logit_scale_and_softcap_models(tmp_path, factory):
    """Granite divides its logits by logits_scaling, Cohere multiplies them by logit_scale, Gemma-2 softcaps them:
    TRL's fused head reproduces each, so must the drop-in (the oracle takes the model's own logits). Prompts of one
    length: Gemma-2's eager attention in float64 turns a left-padded row into NaN (every key masked), which poisons
    the float64 oracle's backward."""
    model_dir = save_tiny_model(tmp_path / "model", model_factory=factory)
    path = LossPath(model_dir, tmp_path / "trainers", prompts=["w1 w2", "w3 w4"], temperature=0.7)
    _assert_loss_parity(path.run(path.batch))


@pytest.mark.parametrize("cast_lm_head_to_fp32", [False, True])
def test_bf16_autocast(model_dirs, tmp_path, cast_lm_head_to_fp32):
    """``bf16=True`` on a float32 model: TRL's head runs in the autocast dtype (bfloat16 tiles), or in float32 with
    ``cast_lm_head_to_fp32``; the drop-in picks the same dtype. Rule at bfloat16 (the backbone runs in it)."""
    path = LossPath(model_dirs["untied"], tmp_path, bf16=True, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                    oracle_overrides=dict(bf16=False, cast_lm_head_to_fp32=False))
    accelerator = path.trainers["out"].accelerator
    with accelerator.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    _assert_loss_parity(path.run(path.batch), dtype=torch.bfloat16)

    # The head's dtype itself: the same backbone, then TRL's head and grpo-fast's in the same dtype must agree to
    # that dtype's ATOL (the rule with out_pt = out_ref: both sides do the same math).
    batch = path.batch
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        ours, trls = (path.trainers[name]._get_per_token_logps_and_entropies(
            path.trainers[name].model, ids, mask, batch["completion_ids"].shape[1], compute_entropy=True)
            for name in ("out", "out_pt"))
    head_dtype = F32 if cast_lm_head_to_fp32 else torch.bfloat16
    for name, x, x_pt in zip(("log-probs", "entropies"), ours[:2], trls[:2]):
        assert_close_rule(x, x_pt, x_pt, head_dtype, f"old-policy pass {name} in {head_dtype}")


# ---------------------------------------------------------------------------------------------------------------------
# Refusals


REFUSALS = {
    "use_liger_kernel": dict(use_liger_kernel=True),
    "use_adaptive_entropy": dict(use_adaptive_entropy=True),
    "off_policy_mask_threshold": dict(off_policy_mask_threshold=0.5, loss_type="vespo"),
}


@pytest.mark.parametrize("option", list(REFUSALS))
def test_refused_options_fail_before_loading_the_model(tmp_path, option):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, **REFUSALS[option])
    with pytest.raises(ValueError, match=rf"FastGRPOTrainer cannot reproduce(.|\n)*{option}="):
        FastGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=[token_sum_reward()], args=args)


@dataclass
class FutureGRPOConfig(GRPOConfig):
    """A GRPOConfig from a newer TRL: one loss option this trainer has never heard of."""

    future_loss_option: float = 0.0


def test_unknown_newer_option_is_refused_only_when_set(model_dirs, tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, num_generations=G,
                  per_device_train_batch_size=G, max_completion_length=4)
    with pytest.raises(ValueError, match=r"future_loss_option=0\.5: a GRPOConfig option newer than TRL .* "
                                         r"expected its default 0\.0"):
        FastGRPOTrainer(model="no-such-model", reward_funcs=[token_sum_reward()],
                        args=FutureGRPOConfig(future_loss_option=0.5, **common))
    from datasets import Dataset

    trainer = FastGRPOTrainer(model=model_dirs["untied"], reward_funcs=[token_sum_reward()],
                              args=FutureGRPOConfig(**common), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                              processing_class=load_tiny_tokenizer(model_dirs["untied"]))
    assert isinstance(trainer, GRPOTrainer)


def test_lora_on_lm_head_is_refused(model_dirs, tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):  # TRL 1.16 refuses this one itself
        build_tiny_grpo_trainer(model_dirs["untied"], tmp_path, [token_sum_reward()], PROMPTS,
                                trainer_cls=FastGRPOTrainer, trainer_kwargs={"peft_config": lora}, bf16=False)


def tiny_qwen2_moe(vocab_size):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    ))


def test_moe_auxiliary_loss_is_refused(tmp_path):
    model_dir = save_tiny_model(tmp_path / "moe", model_factory=tiny_qwen2_moe)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.001 on a MoE model.*router_aux_loss_coef=0\.0"):
        build_tiny_grpo_trainer(model_dir, tmp_path / "out", [token_sum_reward()], PROMPTS,
                                trainer_cls=FastGRPOTrainer, bf16=False)
    trainer = build_tiny_grpo_trainer(model_dir, tmp_path / "out", [token_sum_reward()], PROMPTS,
                                      trainer_cls=FastGRPOTrainer, bf16=False, router_aux_loss_coef=0.0)
    assert not trainer.aux_loss_enabled


# ---------------------------------------------------------------------------------------------------------------------
# Hygiene


def test_plain_grpo_trainer_is_untouched(model_dirs, tmp_path):
    """After a FastGRPOTrainer has trained: TRL's methods are TRL's, no hook is left on the lm_head, and a plain
    GRPOTrainer on a fresh model still runs TRL's own fused head (the parity tests also run it after Fast)."""
    fast = _train(FastGRPOTrainer, F32, model_dirs["untied"], tmp_path / "fast", max_steps=1)
    assert GRPOTrainer._compute_loss is TRL_COMPUTE_LOSS
    assert GRPOTrainer._get_per_token_logps_and_entropies is TRL_LOGPS
    assert not fast.trainer.model.lm_head._forward_pre_hooks and not fast.trainer.model.lm_head._forward_hooks
    plain = build_tiny_grpo_trainer(model_dirs["untied"], tmp_path / "plain", [token_sum_reward()], PROMPTS,
                                    bf16=False)
    calls = []
    handle = plain.model.lm_head.register_forward_hook(lambda m, a, o: calls.append(o.shape))
    ids = torch.tensor([[3, 4, 5, 6]])
    logps, _, _ = plain._get_per_token_logps_and_entropies(plain.model, ids, torch.ones_like(ids), 2)
    handle.remove()
    assert calls == [] and logps.shape == (1, 2)  # TRL's fused head reads lm_head.weight; it never calls the module


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_importing_grpo_fast_does_not_import_trl():
    proc = _python("""
        import sys
        import grpo_fast, grpo_fast.integrations
        assert "trl" not in sys.modules, "importing grpo_fast imported trl"
    """)
    assert proc.returncode == 0, proc.stderr


def test_missing_trl_gives_a_clear_error():
    proc = _python("""
        import sys
        sys.modules["trl"] = None  # what an environment without trl looks like to `import trl`
        try:
            import grpo_fast.integrations.trl
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("no ImportError")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "needs TRL >= 1.16" in proc.stdout and "pip install 'grpo-fast[trl]'" in proc.stdout

