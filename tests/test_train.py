"""The trainer end to end on the built-in tiny model: values, gradient accumulation, skipped updates, LoRA, mu."""

from __future__ import annotations

import copy
import math
import json

import pytest
import torch
from train_helpers import HERE, save_local_model, small_config

from grpo_fast import grpo_loss_from_logps
from grpo_fast.config import LossType
from grpo_fast.testing import assert_close_rule
from grpo_fast.train import rewards as rewards_module
from grpo_fast.train import train
from grpo_fast.train import trainer as trainer_module
from grpo_fast.train.engines import engine_of
from grpo_fast.train.evaluation import evaluate
from grpo_fast.train.forward import position_ids_from_mask
from grpo_fast.train.metrics import read_steps
from grpo_fast.train.rewards import score
from grpo_fast.train.rollout import SamplingParams, rollout
from grpo_fast.train.trainer import policy_update, reference_logprobs, setup
from grpo_fast import group_advantages

REWARDS = str(HERE / "train_helpers.py")


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _reference_update(run, ro, advantages, old_logps, ref_logps, dtype):
    """One update of the whole generation the way trainers do it today, on a copy of the policy in ``dtype``:
    materialised logits of one plain forward over ``[prompt | completion]``, the reference TRL loss, autograd.
    Returns its metrics (loss, kl, entropy, grad_norm) as 0-dim tensors and the gradients clipped as the trainer
    clips them (``clip_grad_norm_`` to ``max_grad_norm``)."""
    model = copy.deepcopy(run.model).to(dtype)
    mask = torch.cat([ro.prompt_mask, ro.completion_mask.to(ro.prompt_mask.dtype)], dim=1)
    logits = model(input_ids=torch.cat([ro.prompt_ids, ro.completion_ids], dim=1), attention_mask=mask,
                   position_ids=position_ids_from_mask(mask), use_cache=False).logits
    z = logits[:, ro.prompt_ids.shape[1] - 1 : -1].to(dtype) / run.config.temperature
    logp_all = z.log_softmax(-1)
    logps = logp_all.gather(-1, ro.completion_ids[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if run.loss_config.entropy_coef == 0.0:
        entropy = entropy.detach()
    out = grpo_loss_from_logps(logps, advantages.to(dtype), ro.completion_mask, old_logps=old_logps,
                               ref_logps=ref_logps, entropy=entropy, config=run.loss_config, impl="reference")
    out.loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, run.config.max_grad_norm)
    metrics = {"loss": out.loss.detach(), "entropy": out.entropy, "grad_norm": norm}
    for name in ("kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):
        if getattr(out, name) is not None:
            metrics[name] = getattr(out, name)
    return metrics, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _assert_update_matches_reference(metrics, grads, pt, ref):
    """The trainer's float32 update against the reference in float64 under the tolerance rule (the reference in
    float32 gives PyTorch's own error)."""
    for key, want in ref[0].items():
        assert_close_rule(torch.tensor(metrics[key], dtype=torch.float64), pt[0][key], want, torch.float32, key)
    if grads is not None:
        assert grads and grads.keys() == ref[1].keys()
        for k in grads:
            assert_close_rule(grads[k], pt[1][k], ref[1][k], torch.float32, k)


def _check_updates_against_the_reference(monkeypatch) -> tuple[list, list]:
    """Wraps the trainer's ``policy_update`` to compute, just before each update, the reference update of the same
    samples in float32 and float64 (``_reference_update``), and ``score`` to keep the rewards."""
    expected, scored = [], []
    real_update, real_score = trainer_module.policy_update, trainer_module.score

    def checked_update(run, ro, advantages, old_logps, ref_logps, sampling_ratio=None):
        assert sampling_ratio is None  # the hf engine: no off-policy correction
        expected.append([_reference_update(run, ro, advantages, old_logps, ref_logps, dtype)
                         for dtype in (torch.float32, torch.float64)])
        return real_update(run, ro, advantages, old_logps, ref_logps)

    def recorded_score(*args):
        scored.append(real_score(*args))
        return scored[-1]

    monkeypatch.setattr(trainer_module, "policy_update", checked_update)
    monkeypatch.setattr(trainer_module, "score", recorded_score)  # the steps'
    monkeypatch.setattr(rewards_module, "score", recorded_score)  # the held-out evaluation's (imported when it runs)
    return expected, scored


def _mean_of_updates(updates):
    """A step's metrics over its ``mu`` updates (the trainer logs their mean), for the float32 and float64 runs."""
    return [({k: sum(u[i][0][k] for u in updates) / len(updates) for k in updates[0][i][0]}, None) for i in (0, 1)]


def test_end_to_end_run_logs_the_reference_loss_of_its_samples(tmp_path, monkeypatch):
    """Every logged step's loss, entropy and gradient norm are the reference TRL loss of that step's own samples
    (recomputed on a float64 copy of the policy just before its update), and its reward is their mean reward."""
    config = small_config(tmp_path, steps=3, plot=True, generation_prompts=3)  # 4 prompts: chunks of 3 and 1
    expected, scored = _check_updates_against_the_reference(monkeypatch)
    summary = train(config)
    steps = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3] and len(expected) == 3
    assert len(scored) == 2 + 3 + 2  # the held-out evaluation before and after: 16 prompts in chunks of 8
    for s, (pt, ref), rewards in zip(steps, expected, scored[2:5]):
        _assert_update_matches_reference(s, None, pt, ref)
        assert s["reward"] == float(torch.nansum(rewards, dim=1).mean()) and s["skipped_updates"] == 0
        # mean |sampler - trainer| log-prob per token: the KV-cached sampler has no float64 twin to apply the rule
        # to; 1e-4 is far above float32 rounding (~1e-6 here) and far below any real mismatch (masking, positions)
        assert s["sampling_logp_gap"] < 1e-4
    assert summary.steps == 3 and summary.eval_before is not None and summary.eval_after is not None
    assert (tmp_path / "run" / "reward_kl.png").stat().st_size > 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == 3
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["event"] == "start" and json.loads(lines[-1])["event"] == "end"
    assert "held-out reward" in summary.line()


def _first_token_logp(run, token: str) -> float:
    """Mean log-prob of ``token`` as the first completion token over a fixed set of training prompts."""
    from grpo_fast.train.rollout import encode_prompts

    ids, mask = encode_prompts(run, run.sampler.records[:32])
    from grpo_fast.train.forward import position_ids_from_mask

    with torch.no_grad():
        logits = run.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    return float(logits[:, -1].log_softmax(-1)[:, run.tokenizer.convert_tokens_to_ids(token)].mean())


def test_parameters_move_towards_the_rewarded_answer(tmp_path):
    """Reward 'starts with 7': after a few updates the first-token log-prob of '7' must have risen."""
    config = small_config(tmp_path, rewards=[f"{REWARDS}:starts_with_seven"], steps=6, group_size=8, lr=3e-3)
    run = setup(config)
    before = _first_token_logp(run, "7")
    from grpo_fast.train.trainer import train_step

    for _ in range(config.steps):
        train_step(run)
    assert _first_token_logp(run, "7") > before + 0.5


def _one_generation(tmp_path, **overrides):
    config = small_config(tmp_path, **overrides)
    run = setup(config)
    records = run.sampler.next_batch()
    ro, completions = rollout(run, records, config.group_size, SamplingParams(config.max_new_tokens),
                              engine=engine_of(run))
    rewards = score(run, records, completions, config.group_size)
    adv = group_advantages(rewards, group_size=config.group_size).advantages
    return run, ro, adv


def _record_gradients(run) -> dict:
    """The gradients the optimizer steps with (policy_update clears them right after the step)."""
    recorded: dict = {}

    def record(optimizer, args, kwargs):
        recorded.update({k: p.grad.clone() for k, p in run.model.named_parameters() if p.grad is not None})

    run.optimizer.register_step_pre_hook(record)
    return recorded


@pytest.mark.parametrize("loss_type", [t.value for t in LossType])
def test_gradient_accumulation_equals_one_large_batch(tmp_path, loss_type):
    """With ``token_mean="generation"``, micro-batches of 3 rows (uneven: 16 = 3*5 + 1) accumulate to the gradient of
    the whole generation, the KL term and the entropy bonus included; the token-weighted metrics do not depend on the
    micro-batch size. (``token_mean="micro_batch"``, TRL's per-micro-batch token means, is checked against TRL's own
    loop in tests/test_lockstep_trl.py.)"""
    for micro in (16, 3):
        torch.manual_seed(0)
        run, ro, adv = _one_generation(tmp_path, micro_batch_size=micro, token_mean="generation", **{
            "loss.loss_type": loss_type, "loss.beta": "0.05", "loss.entropy_coef": "0.01",
            **({"loss.dro_beta": "0.3"} if loss_type == "dro" else {})})
        adv = torch.linspace(-1, 1, adv.shape[0])  # every row carries signal
        grads = _record_gradients(run)
        ref_logps = reference_logprobs(run, ro)
        expected = [_reference_update(run, ro, adv, None, ref_logps, dtype) for dtype in (torch.float32, torch.float64)]
        metrics = policy_update(run, ro, adv, None, ref_logps)
        assert all(p.grad is None for p in run.model.parameters())  # not kept through the next rollout
        _assert_update_matches_reference(metrics, grads, *expected)


def test_non_finite_update_is_skipped_and_weights_untouched(tmp_path):
    run, ro, adv = _one_generation(tmp_path)
    adv = torch.linspace(-1, 1, adv.shape[0])
    before = _params(run.model)
    opt_state = {k: dict(v) for k, v in run.optimizer.state.items()}
    # a NaN gradient on one parameter (an overflow in the backward, say)
    first = next(run.model.parameters())
    handle = first.register_hook(lambda g: torch.full_like(g, float("nan")))
    try:
        metrics = policy_update(run, ro, adv, None, None)
    finally:
        handle.remove()
    assert run.skipped_updates == 1 and metrics == {"grad_norm": pytest.approx(float("nan"), nan_ok=True)}
    assert run.scheduler.last_epoch == 0  # the schedule did not advance either
    after = _params(run.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {k: dict(v) for k, v in run.optimizer.state.items()} == opt_state
    # a NaN in the forward (the decoder's output) is caught before the loss
    norm = run.model.model.norm
    handle = norm.register_forward_hook(lambda mod, inp, out: out * float("nan"))
    try:
        policy_update(run, ro, adv, None, None)
    finally:
        handle.remove()
    assert run.skipped_updates == 2
    assert all(torch.equal(before[k], p.detach()) for k, p in run.model.named_parameters())
    policy_update(run, ro, adv, None, None)  # a finite update then goes through
    assert run.skipped_updates == 2
    assert any(not torch.equal(before[k], p.detach()) for k, p in run.model.named_parameters())


def test_mu_updates_start_at_ratio_one_then_clip(tmp_path):
    """With mu > 1 the old log-probs come from a no-grad pass of the same policy: the first update sees ratio 1
    (nothing clipped), the later ones the moved policy."""
    from grpo_fast.train.trainer import logprobs_of

    run, ro, adv = _one_generation(tmp_path, lr=0.05, **{"loss.loss_type": "grpo", "loss.epsilon": "0.01"})
    adv = torch.linspace(-1, 1, adv.shape[0])
    old = logprobs_of(run, run.policy, ro)
    first = policy_update(run, ro, adv, old, None)
    second = policy_update(run, ro, adv, old, None)
    assert first["clip_ratio_region"] == 0.0 and second["clip_ratio_region"] > 0.0
    assert "sampling_logp_gap" not in first  # with old log-probs the ratio is not against the sampler


def test_mu_run_end_to_end(tmp_path, monkeypatch):
    """mu = 3 updates per generation against old log-probs: each step logs the mean of its updates' reference
    losses (the later updates' ratios move away from 1 and clip)."""
    expected, _ = _check_updates_against_the_reference(monkeypatch)
    summary = train(small_config(tmp_path, steps=2, mu=3, **{"loss.loss_type": "grpo"}))
    steps = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert summary.steps == 2 and [s["step"] for s in steps] == [1, 2] and len(expected) == 6
    for s, updates in zip(steps, (expected[:3], expected[3:])):
        _assert_update_matches_reference(s, None, *_mean_of_updates(updates))


def test_beta_with_a_frozen_reference_starts_at_zero_kl(tmp_path):
    run, ro, adv = _one_generation(tmp_path, **{"loss.beta": "0.1"})
    assert run.ref_model is not None
    metrics = policy_update(run, ro, adv, None, reference_logprobs(run, ro))
    assert metrics["kl"] == 0.0  # the same weights through the same forward: exactly equal log-probs
    assert all(not p.requires_grad for p in run.ref_model.parameters())


def test_lora_reference_is_the_base_with_adapters_disabled(tmp_path):
    pytest.importorskip("peft")
    run, ro, adv = _one_generation(tmp_path, lora_r=4, lora_target_modules=["q_proj", "v_proj"],
                                   **{"loss.beta": "0.1"})
    assert run.ref_model is None
    trainable = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ref = reference_logprobs(run, ro)
    metrics = policy_update(run, ro, torch.linspace(-1, 1, adv.shape[0]), None, ref)
    assert metrics["kl"] == 0.0  # LoRA's B starts at zero: policy == base, bit for bit (x @ A @ 0 adds 0)
    # after the update the adapters differ from the base, and the reference did not move with them
    assert torch.equal(reference_logprobs(run, ro), ref)
    metrics = policy_update(run, ro, torch.linspace(-1, 1, adv.shape[0]), None, ref)
    assert metrics["kl"] > 0


def test_unscored_rows_and_user_rewards_by_path(tmp_path):
    run, ro, adv = _one_generation(tmp_path, rewards=[f"{REWARDS}:half_scored", f"{REWARDS}:constant_reward"],
                                   reward_weights=[1.0, 2.0])
    records = run.sampler.records[:4]
    rewards = score(run, records, ["1"] * 16, 4)
    assert rewards.shape == (16, 2)
    assert torch.isnan(rewards[1::2, 0]).all() and (rewards[:, 1] == 0.5).all()


@pytest.mark.parametrize("arch, template, weights", [
    ("llama", None, False),  # a config.json only: built with random weights
    ("qwen2", "{% for m in messages %}{{ m['content'] }}{% endfor %}", True),
])
def test_local_model_directory_and_jsonl_dataset(tmp_path, arch, template, weights):
    model_dir = save_local_model(tmp_path / "model", arch, template, weights)
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"max {a} {b}=", "answer": str(max(a, b))} for a in range(5) for b in range(5)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if template:  # conversational prompts go through the chat template
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
        data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = train(small_config(tmp_path, model=model_dir, dataset=str(data), eval_dataset=str(data), steps=2,
                                 lr=1e-3, rewards=["math"]))
    assert summary.steps == 2 and summary.eval_before is not None
    steps = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert all(s["loss"] is not None for s in steps)  # NaN would be written as null


def test_code_reward_dataset_runs_in_the_sandbox(tmp_path):
    data = tmp_path / "code.jsonl"
    rows = [{"prompt": "max 1 2=", "tests": ["assert 1 + 1 == 2", "assert f(1) == 2"]}] * 4
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run, ro, adv = _one_generation(tmp_path, dataset=str(data), rewards=["code"], steps=1)
    records = run.sampler.records[:1]
    rewards = score(run, records, ["def f(x):\n    return 2 * x", "f = None"], 2)
    assert rewards[:, 0].tolist() == [1.0, 0.5]  # both pass the first test; only the first defines f correctly


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads models"):
        setup(small_config(tmp_path, model="Qwen/Qwen2.5-0.5B"))


def test_too_long_prompt_names_the_option(tmp_path):
    # the whole dataset is checked at set-up (tests/test_cli_errors.py has a file's line numbers)
    with pytest.raises(ValueError, match=r"builtin:digits, record 0: the prompt is 10 tokens long once rendered, more "
                                         r"than TrainConfig.max_prompt_length 4 \(\d+ more prompts are too long\)"):
        setup(small_config(tmp_path, max_prompt_length=4))
    # and the rollout still refuses what set-up did not see
    run = setup(small_config(tmp_path))
    run.config.max_prompt_length = 4
    with pytest.raises(ValueError, match="TrainConfig.max_prompt_length: a prompt has"):
        rollout(run, run.sampler.records[:2], 2, SamplingParams(2), engine=engine_of(run))


def test_a_new_run_does_not_overwrite_an_earlier_one(tmp_path):
    train(small_config(tmp_path, steps=1))
    with pytest.raises(FileExistsError, match="already holds a run.*--resume.*--overwrite"):
        train(small_config(tmp_path, steps=1))
    summary = train(small_config(tmp_path, steps=1, overwrite=True))
    assert summary.steps == 1 and len(read_steps(tmp_path / "run" / "metrics.jsonl")) == 1


def test_eos_ids_include_the_generation_config(tmp_path):
    from grpo_fast.train.rollout import eos_token_ids

    run = setup(small_config(tmp_path))
    run.model.generation_config.eos_token_id = [run.tokenizer.eos_token_id, 7]
    assert eos_token_ids(run.model, run.tokenizer) == sorted({run.tokenizer.eos_token_id, 7})


def test_non_finite_reference_pass_skips_the_step(tmp_path):
    """NaN hidden states in the no-grad old/reference passes skip the step instead of aborting the run."""
    from grpo_fast.train.trainer import train_step

    run = setup(small_config(tmp_path, mu=2, **{"loss.beta": "0.1"}))
    before = _params(run.model)
    handle = run.ref_model.model.norm.register_forward_hook(lambda mod, inp, out: out * float("nan"))
    try:
        metrics = train_step(run)
    finally:
        handle.remove()
    assert run.skipped_updates == 1 and metrics["skipped_updates"] == 1 and "loss" not in metrics
    assert all(torch.equal(before[k], p.detach()) for k, p in run.model.named_parameters())


def test_bf16_autocast_keeps_float32_master_weights(tmp_path):
    """--dtype bfloat16: forwards under autocast, parameters and AdamW states stay float32 and do move."""
    run, ro, adv = _one_generation(tmp_path, dtype="bfloat16", **{"loss.beta": "0.1"})
    assert run.ref_model is not None and next(run.ref_model.parameters()).dtype == torch.bfloat16
    before = _params(run.model)
    metrics = policy_update(run, ro, torch.linspace(-1, 1, adv.shape[0]), None, reference_logprobs(run, ro))
    assert metrics["loss"] is not None and run.skipped_updates == 0
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    assert any(not torch.equal(before[k], p.detach()) for k, p in run.model.named_parameters())


def test_lora_on_the_lm_head_is_refused(tmp_path):
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match=r"lora_target_modules: \['lm_head'\] would put an adapter on the lm_head"):
        setup(small_config(tmp_path, lora_r=4, lora_target_modules=["q_proj", "lm_head"]))


def test_a_model_that_rescales_its_logits_is_refused(tmp_path, monkeypatch):
    """Cohere-style logit scaling: the fused log-probs would not be the ones the model samples from."""
    from grpo_fast.train import model as model_module

    real = model_module.tiny_model

    def scaled(tokenizer, seed):
        m = real(tokenizer, seed)
        m.lm_head.register_forward_hook(lambda mod, inp, out: out * 0.5)
        return m

    monkeypatch.setattr(model_module, "tiny_model", scaled)
    with pytest.raises(ValueError, match="logits are not softcap\\(lm_head\\(last hidden state\\)\\)"):
        setup(small_config(tmp_path))


def test_conversational_prompts_give_message_completions_to_rewards(tmp_path):
    seen = []

    run = setup(small_config(tmp_path))
    run.reward_funcs = [lambda prompts, completions, **kw: seen.extend(completions) or [1.0] * len(completions)]
    score(run, [{"prompt": [{"role": "user", "content": "max 1 2="}], "answer": "2"}], ["2"], 1)
    score(run, [{"prompt": "max 1 2=", "answer": "2"}], ["2"], 1)
    assert seen == [[{"role": "assistant", "content": "2"}], "2"]


def test_one_step_on_the_triton_kernel_path(tmp_path):
    """What CUDA runs by default (impl auto -> triton), here through the Triton interpreter: the trainer's calls
    (strided micro-batch slices, the reference pass, the cast weight) must suit the kernels too."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1, set by conftest on CPU machines)")
    torch.manual_seed(0)
    options = {"token_mean": "generation", "loss.beta": "0.1", "loss.entropy_coef": "0.01"}  # _reference_update's
    run_t, ro, adv = _one_generation(tmp_path / "t", impl="triton", **options)
    adv = torch.linspace(-1, 1, adv.shape[0])
    g_t = _record_gradients(run_t)
    m_t = policy_update(run_t, ro, adv, None, reference_logprobs(run_t, ro))
    torch.manual_seed(0)
    run_c, ro_c, _ = _one_generation(tmp_path / "c", impl="torch", **options)
    assert torch.equal(ro.completion_ids, ro_c.completion_ids)
    g_c = _record_gradients(run_c)
    ref_logps = reference_logprobs(run_c, ro_c)
    expected = [_reference_update(run_c, ro_c, adv, None, ref_logps, dtype) for dtype in (torch.float32, torch.float64)]
    m_c = policy_update(run_c, ro_c, adv, None, ref_logps)
    _assert_update_matches_reference(m_t, g_t, *expected)
    _assert_update_matches_reference(m_c, g_c, *expected)


@pytest.mark.parametrize("arch", ["gemma2", "qwen3", "llama"])
def test_architectures_sample_and_train_on_the_same_log_probs(tmp_path, arch):
    """Gemma-2 (final-logit softcap, a 4-token sliding window shorter than the prompts), Qwen3 (q/k norms) and Llama
    saved as local directories: the fused training log-probs equal the cached sampler's, and an update runs."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from grpo_fast.train.tasks import tiny_tokenizer

    tok = tiny_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    config, cls = {
        "gemma2": (Gemma2Config(**common, final_logit_softcapping=5.0, sliding_window=4), Gemma2ForCausalLM),
        "qwen3": (Qwen3Config(**common), Qwen3ForCausalLM),
        "llama": (LlamaConfig(**common), LlamaForCausalLM),
    }[arch]
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    run, ro, _ = _one_generation(tmp_path, model=str(tmp_path / "model"), **{"loss.beta": "0.1"})
    assert run.loss_config.softcap == (5.0 if arch == "gemma2" else None)
    metrics = policy_update(run, ro, torch.linspace(-1, 1, ro.completion_ids.shape[0]), None,
                            reference_logprobs(run, ro))
    # sampler vs trainer log-probs: no float64 sampler exists for the rule; 1e-5 per token is float32 rounding
    # through a few layers, far below any real mismatch (softcap, sliding window, q/k norms left out)
    assert metrics["sampling_logp_gap"] < 1e-5 and metrics["kl"] == 0.0 and run.skipped_updates == 0


def test_a_replaced_model_without_its_wrapper_is_refused(tmp_path):
    """Every pass goes through run.policy; replacing run.model alone would silently sample the old model."""
    from grpo_fast.train.distributed import PolicyForward
    from grpo_fast.train.tasks import tiny_model

    run = setup(small_config(tmp_path))
    run.model = tiny_model(run.tokenizer, seed=1)
    with pytest.raises(RuntimeError, match="Run.policy wraps another model than Run.model"):
        evaluate(run)
    run.policy = PolicyForward(run.model)
    assert evaluate(run) is not None


def test_token_mean_weight():
    """A micro-batch's token mean counts 1 / micro_batches of the generation's (TRL's), or its share of the tokens."""
    from grpo_fast.loss import token_mean_weight

    assert token_mean_weight("micro_batch", 3.0, 20.0, 4) == 0.25
    assert token_mean_weight("generation", 3.0, 20.0, 4) == 0.15
    assert token_mean_weight("generation", 0.0, 0.0, 1) == 0.0  # a generation without tokens divides by 1


def test_micro_batches_smaller_than_a_group_train(tmp_path):
    """micro_batch_size < group_size: no micro-batch holds a whole group, so the prompt is not shared (the planner
    divided by the shared token count, 0 here), and the run trains."""
    summary = train(small_config(tmp_path, steps=2, micro_batch_size=2, group_size=4))
    steps = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert summary.steps == 2 and len(steps) == 2
    assert all(s["prefix_saving"] == 1.0 and math.isfinite(s["grad_norm"]) for s in steps)
