"""The PPO baseline (grpo_fast/ppo.py): GAE on a hand-computed case, the losses against autograd of their formulas
written out token by token, the KL-penalised rewards, the critic's alignment, and one real step."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from grpo_fast.ppo import (
    Critic,
    PPOConfig,
    gae,
    kl_penalized_rewards,
    masked_whiten,
    policy_loss,
    ppo_step,
    value_loss,
)
from grpo_fast.train.model import frozen_copy
from grpo_fast.train.rollout import SamplingParams
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

F64 = torch.float64


def test_gae_matches_a_hand_computed_case():
    # gamma 0.9, lambda 0.8 (gamma * lambda = 0.72). Row 0, three tokens, V = [0.5, 0.6, 0.7], r = [0, 0, 1]:
    #   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                      A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03                   A1 = 0.03 + 0.72*0.3 = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04                   A0 = 0.04 + 0.72*0.246 = 0.21712
    # Row 1, two tokens then padding (its value 9 and reward 5 must not leak in), V = [1, -0.5], r = [0.25, 2]:
    #   t=1: delta = 2 + 0.9*0 + 0.5 = 2.5                      A1 = 2.5
    #   t=0: delta = 0.25 + 0.9*(-0.5) - 1 = -1.2               A0 = -1.2 + 0.72*2.5 = 0.6
    # returns = A + V
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, -0.5, 9.0]], dtype=F64)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.25, 2.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected_adv = torch.tensor([[0.21712, 0.246, 0.3], [0.6, 2.5, 0.0]], dtype=F64)
    expected_ret = torch.tensor([[0.71712, 0.846, 1.0], [1.6, 2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(advantages, expected_adv, rtol=0, atol=1e-15)
    torch.testing.assert_close(returns, expected_ret, rtol=0, atol=1e-15)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 7, generator=gen, dtype=F64), torch.randn(3, 7, generator=gen, dtype=F64)
    mask = torch.ones(3, 7, dtype=torch.long)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(advantages, reward_to_go - values, rtol=0, atol=1e-13)
    torch.testing.assert_close(returns, reward_to_go, rtol=0, atol=1e-13)


def test_kl_penalized_rewards_put_the_score_on_the_last_token():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -4.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores = torch.tensor([2.0, -1.0], dtype=F64)
    rewards, kl = kl_penalized_rewards(scores, logps, ref, mask, kl_coef=0.1, estimator="k1")
    # k1 = logp - ref: row 0 -> [0.5, -1.0, 0.0], row 1 -> [0.1, 1.0, (pad) 0]
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.1, 1.0, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    expected = torch.tensor([[-0.05, 0.1, 2.0], [-0.01, -0.1 - 1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-15)
    _, kl3 = kl_penalized_rewards(scores, logps, ref, mask, kl_coef=0.1, estimator="k3")
    d = ref - logps  # k3 = exp(d) - 1 - d
    torch.testing.assert_close(kl3, torch.where(mask.bool(), d.exp() - 1 - d, 0.0), rtol=0, atol=1e-15)


def test_kl_penalized_rewards_refuse_an_empty_row():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"kl_penalized_rewards: every row of mask needs a token, got rows \[1\]"):
        kl_penalized_rewards(torch.zeros(2), x, x, torch.tensor([[1, 0, 0], [0, 0, 0]]), 0.1)


def test_masked_whiten_uses_the_unbiased_variance_of_the_masked_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 6.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    values = [1.0, 2.0, 3.0, 6.0, 7.0]  # mean 3.8, unbiased variance 6.7
    mean = sum(values) / 5
    var = sum((v - mean) ** 2 for v in values) / 4
    assert math.isclose(var, 6.7)
    out = masked_whiten(x, mask)
    scale = 1 / math.sqrt(var + 1e-8)
    expected = [[(1 - mean) * scale, (2 - mean) * scale, 0.0], [(3 - mean) * scale, (6 - mean) * scale,
                                                              (7 - mean) * scale]]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="mask needs at least 2 masked-in positions for a variance, got 1"):
        masked_whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def _written_out_policy_loss(logps, old, adv, mask, c):
    """TRL's formula token by token: mean over masked tokens of max(-A r, -A clip(r, 1-c, 1+c))."""
    total, count = 0.0, 0
    for i in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if mask[i, t]:
                r = torch.exp(logps[i, t] - old[i, t])
                r_clip = torch.clamp(r, 1 - c, 1 + c)
                total = total + torch.max(-adv[i, t] * r, -adv[i, t] * r_clip)
                count += 1
    return total / count


def _written_out_value_loss(values, old, returns, mask, c):
    total, count = 0.0, 0
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[i, t]:
                v_clip = old[i, t] + torch.clamp(values[i, t] - old[i, t], -c, c)
                total = total + torch.max((values[i, t] - returns[i, t]) ** 2, (v_clip - returns[i, t]) ** 2)
                count += 1
    return 0.5 * total / count


def _batch(seed=0, R=4, T=9):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(R, T, generator=gen, dtype=F64) * 3
    # log-ratios spread over [-0.6, 0.6]: tokens inside the clip range and beyond either end
    logps = (old + (torch.rand(R, T, generator=gen, dtype=F64) - 0.5) * 1.2).requires_grad_(True)
    adv = torch.randn(R, T, generator=gen, dtype=F64)
    mask = torch.arange(T)[None] < torch.tensor([T, 5, 1, 7])[:, None]
    return logps, old, adv, mask


def test_policy_loss_equals_autograd_of_the_written_out_formula():
    logps, old, adv, mask = _batch()
    ratio = torch.exp(logps.detach() - old)[mask]
    assert (ratio > 1.2).any() and (ratio < 0.8).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    loss, clipfrac = policy_loss(logps, old, adv, mask, cliprange=0.2)
    (grad,) = torch.autograd.grad(loss, logps)
    expected = _written_out_policy_loss(logps, old, adv, mask, 0.2)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-15)
    assert (grad[~mask] == 0).all()
    # clipped tokens have no gradient; the clip fraction counts the tokens where the clipped term is larger
    r = torch.exp(logps.detach() - old)
    clipped = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
    assert (grad[clipped & mask] == 0).all() and (grad[~clipped & mask] != 0).all()
    assert clipfrac == pytest.approx(float((clipped & mask).sum() / mask.sum()))


def test_value_loss_equals_autograd_of_the_written_out_formula():
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, 9, generator=gen, dtype=F64)
    values = (old + (torch.rand(4, 9, generator=gen, dtype=F64) - 0.5)).requires_grad_(True)
    returns = old + torch.randn(4, 9, generator=gen, dtype=F64)
    mask = torch.arange(9)[None] < torch.tensor([9, 5, 1, 7])[:, None]
    loss, clipfrac = value_loss(values, old, returns, mask, cliprange_value=0.2)
    (grad,) = torch.autograd.grad(loss, values)
    expected = _written_out_value_loss(values, old, returns, mask, 0.2)
    (expected_grad,) = torch.autograd.grad(expected, values)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-15)
    assert 0 < float(clipfrac) < 1


def _tiny(seed=0):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed)
    model.train()
    return model


def test_critic_value_at_t_sees_the_prompt_and_completion_tokens_before_t():
    model = _tiny()
    critic = Critic.from_policy(model)
    assert critic.decoder is not model.model and not hasattr(critic, "lm_head")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 20, (2, 5), generator=gen)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    completion = torch.randint(3, 20, (2, 6), generator=gen)
    completion_mask = torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad():
        values = critic(prompt, prompt_mask, completion, completion_mask)
        changed = completion.clone()
        changed[:, 3] = (changed[:, 3] + 1 - 3) % 17 + 3  # another token at position 3
        values2 = critic(prompt, prompt_mask, changed, completion_mask)
    assert values.shape == (2, 6) and values.dtype == torch.float32
    torch.testing.assert_close(values[:, :4], values2[:, :4], rtol=0, atol=0)  # states before token 3 is chosen
    assert (values[:, 4:] != values2[:, 4:]).all()


def test_ppo_step_updates_actor_and_critic_and_leaves_the_reference_alone():
    torch.manual_seed(0)
    model = _tiny()
    critic = Critic.from_policy(model)
    ref = frozen_copy(model, torch.float32)
    optimizer = torch.optim.AdamW([*model.parameters(), *critic.parameters()], lr=1e-3)
    before = {name: [p.detach().clone() for p in m.parameters()] for name, m in
              (("actor", model), ("critic", critic), ("ref", ref))}
    prompt = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    phases = []

    def phase(name):
        phases.append(name)
        return contextlib.nullcontext()

    metrics = ppo_step(model, critic, ref, optimizer, prompt, torch.ones_like(prompt),
                       lambda ro: (ro.completion_ids % 2 == 0).float().mean(1), PPOConfig(epochs=2),
                       SamplingParams(max_new_tokens=5), eos_token_id=1, pad_token_id=0, group_size=4,
                       generator=torch.Generator().manual_seed(0), phase=phase)
    assert phases == ["rollout", "prepare"] + ["forward", "backward", "optimizer"] * 2
    assert all(math.isfinite(v) for v in metrics.values())
    changed = {name: any(not torch.equal(a, b) for a, b in zip(params, m.parameters())) for (name, params), m in
               zip(before.items(), (model, critic, ref))}
    assert changed == {"actor": True, "critic": True, "ref": False}
    assert all(p.grad is None for p in [*model.parameters(), *critic.parameters()])
    assert metrics["pg_clipfrac"] > 0  # the second epoch sees ratios away from 1


@pytest.mark.parametrize("field, value, expected", [
    ("kl_estimator", "k2", r"PPOConfig.kl_estimator: expected one of \('k1', 'k3'\), got 'k2'"),
    ("gamma", 1.5, r"PPOConfig.gamma: expected a number in \[0, 1\], got 1.5"),
    ("cliprange", -0.1, "PPOConfig.cliprange: expected a finite number >= 0, got -0.1"),
    ("epochs", 0, "PPOConfig.epochs: expected an integer >= 1, got 0"),
    ("temperature", 0.0, "PPOConfig.temperature: expected a number > 0, got 0.0"),
])
def test_ppo_config_names_the_bad_field(field, value, expected):
    with pytest.raises(ValueError, match=expected):
        PPOConfig(**{field: value})
