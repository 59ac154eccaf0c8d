"""PPO, the baseline GRPO is measured against: actor, critic, frozen reference, GAE, clipped policy and value losses.

It follows TRL's ``PPOTrainer`` (and OpenRLHF's PPO, which computes the same quantities), on grpo-fast's own pieces
so that a comparison with GRPO differs only where the algorithms differ:

1. rollout: :func:`grpo_fast.train.rollout.generate`, the GRPO trainer's sampler (``B`` prompts x ``group_size``
   samples, each prompt prefilled once);
2. scores: a rule-based reward function of the rollout (as GRPO's rewards, or OpenRLHF's reward functions; a learned
   reward model would add one more frozen model to PPO and GRPO alike);
3. no-grad passes: the reference model's log-probs and the critic's values; the old log-probs are the rollout's
   own sampling log-probs (the same policy in the same dtype: TRL recomputes them in a forward pass of the same model);
4. per-token rewards: ``-kl_coef * KL`` at every completion token, plus the score at the last one
   (:func:`kl_penalized_rewards`; TRL's ``non_score_reward``, OpenRLHF's ``compute_reward``);
5. GAE(gamma, lambda) -> advantages (whitened over the batch's tokens) and returns (:func:`gae`);
6. ``epochs`` updates: the clipped policy loss plus ``vf_coef`` times the clipped value loss, one backward, one
   optimizer step over actor and critic (TRL wraps policy and value model in one module with one optimizer).

Defaults are TRL's ``PPOConfig``: kl_coef 0.05 (k1 estimator), gamma 1.0, lambda 0.95, cliprange 0.2,
cliprange_value 0.2, vf_coef 0.1.

    critic = Critic.from_policy(policy)
    ref = frozen_copy(policy, dtype)                        # grpo_fast.train.model
    optimizer = torch.optim.AdamW([*policy.parameters(), *critic.parameters()], lr=1e-6)
    metrics = ppo_step(policy, critic, ref, optimizer, prompt_ids, prompt_mask, reward_fn, PPOConfig(),
                       SamplingParams(max_new_tokens=256), eos_token_id=eos, pad_token_id=pad)
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from grpo_fast import fused_logprobs
from grpo_fast.train.forward import completion_hidden, decoder_of, head_of, unwrap
from grpo_fast.train.model import autocast
from grpo_fast.train.rollout import Rollout, SamplingParams, generate

KL_ESTIMATORS = ("k1", "k3")


@dataclass(frozen=True)
class PPOConfig:
    """PPO's hyper-parameters (TRL ``PPOConfig`` names and defaults); validated on construction."""

    kl_coef: float = 0.05
    kl_estimator: str = "k1"  # k1: log(pi/pi_ref); k3: pi_ref/pi - 1 - log(pi_ref/pi)
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    whiten_advantages: bool = True
    epochs: int = 1  # updates per rollout (TRL: num_ppo_epochs, over minibatches)
    temperature: float = 1.0
    max_grad_norm: float = 1.0  # 0: no clipping

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"PPOConfig.kl_estimator: expected one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        for name in ("kl_coef", "cliprange", "cliprange_value", "vf_coef", "max_grad_norm"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"PPOConfig.{name}: expected a finite number >= 0, got {value!r}")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"PPOConfig.{name}: expected a number in [0, 1], got {value!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"PPOConfig.temperature: expected a number > 0, got {self.temperature!r}")
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise ValueError(f"PPOConfig.epochs: expected an integer >= 1, got {self.epochs!r}")


# ------------------------------------------------------------------------------------------------ the critic


class Critic(nn.Module):
    """The value model: a decoder of the policy's architecture and a scalar head on its last hidden states.

    ``values[:, t] = value_head(hidden[:, t])`` with the policy's alignment (``hidden[:, t]`` is the state in which
    ``completion_ids[:, t]`` is chosen; TRL's ``vpred[:, context_length - 1 : -1]``). The head has no bias and is
    initialised ``N(0, 1 / (H + 1))`` as OpenRLHF's critic. No lm_head: the critic never makes logits.
    """

    def __init__(self, decoder: nn.Module, hidden_size: int, *, seed: int = 0):
        super().__init__()
        self.decoder = decoder
        self.value_head = nn.Linear(hidden_size, 1, bias=False)
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(self.value_head.weight.shape, generator=generator) / (hidden_size + 1)
        with torch.no_grad():
            self.value_head.weight.copy_(weight)

    @classmethod
    def from_policy(cls, model, *, seed: int = 0) -> "Critic":
        """A critic whose decoder starts as a copy of the policy's (TRL and OpenRLHF start it from a reward or SFT
        model of the same architecture), on the policy's device and in its parameter dtype."""
        decoder = copy.deepcopy(decoder_of(model))
        weight = head_of(model).weight
        critic = cls(decoder, unwrap(model).config.hidden_size, seed=seed)
        return critic.to(device=weight.device, dtype=weight.dtype)

    def get_decoder(self) -> nn.Module:
        """What ``grpo_fast.train.forward.completion_hidden`` runs (it takes the decoder of a causal LM)."""
        return self.decoder

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, forward=completion_hidden):
        """``[R, T]`` float32 values of the completion states; prompts ``[R, P]`` left-padded, completions
        ``[R, T]`` right-padded."""
        hidden = forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask)
        return self.value_head(hidden).squeeze(-1).float()


# ------------------------------------------------------------------------------------------------ the math


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * m) / sum(m)`` over masked-in positions (masked-out values never enter, even if not finite)."""
    m = mask.bool()
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked-in positions, with the unbiased variance (TRL's
    ``masked_whiten``, ``shift_mean=True``); masked-out positions become 0."""
    m = mask.bool()
    n = int(m.sum())
    if n < 2:
        raise ValueError(f"masked_whiten: mask needs at least 2 masked-in positions for a variance, got {n}")
    mean = masked_mean(x, m)
    var = torch.where(m, (x - mean) ** 2, 0.0).sum() / (n - 1)
    return torch.where(m, (x - mean) * torch.rsqrt(var + eps), 0.0)


def kl_penalized_rewards(scores, logps, ref_logps, mask, kl_coef: float, estimator: str = "k1"):
    """Per-token rewards ``[R, T]``: ``-kl_coef * kl_t`` at every completion token, plus ``scores[r]`` at the last
    one. Returns ``(rewards, kl)``.

    scores: ``[R]``; logps (the sampling policy's) and ref_logps: ``[R, T]``; mask: ``[R, T]`` right-padded, every
    row at least one token. ``kl_t = logp - ref`` (k1) or ``exp(ref - logp) - 1 - (ref - logp)`` (k3).
    """
    m = mask.bool()
    lengths = m.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError(f"kl_penalized_rewards: every row of mask needs a token, got rows "
                         f"{torch.nonzero(lengths == 0).flatten().tolist()} empty")
    log_ratio = torch.where(m, ref_logps - logps, 0.0)
    kl = -log_ratio if estimator == "k1" else torch.expm1(log_ratio) - log_ratio
    rewards = torch.where(m, -kl_coef * kl, 0.0)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, lengths - 1] += scores.to(rewards.dtype)
    return rewards, torch.where(m, kl, 0.0)


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalized advantage estimation over right-padded rows; returns ``(advantages, returns)``, both ``[R, T]``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V = 0`` past the last token), ``A_t = delta_t + gamma * lam *
    A_{t+1}``, ``returns = A + V``; masked-out positions hold 0.
    """
    m = mask.to(values.dtype)
    values, rewards = values * m, rewards * m
    T = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    reversed_advantages = []
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages, advantages + values


def policy_loss(logps, old_logps, advantages, mask, cliprange: float):
    """PPO's clipped surrogate ``masked_mean(max(-A r, -A clamp(r, 1 - c, 1 + c)))`` with ``r = exp(logp - old)``;
    returns ``(loss, clip_fraction)`` (the fraction of tokens where the clipped term is the larger, detached)."""
    ratio = torch.exp(logps - old_logps)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask).detach()


def value_loss(values, old_values, returns, mask, cliprange_value: float):
    """``0.5 * masked_mean(max((V - R)^2, (clamp(V, V_old - c, V_old + c) - R)^2))``; returns ``(loss,
    clip_fraction)``."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask).detach()


# ------------------------------------------------------------------------------------------------ one step


def completion_logprobs(model, ro: Rollout, *, temperature: float = 1.0, impl: str = "auto",
                        forward=completion_hidden) -> torch.Tensor:
    """``[R, T]`` float32 log-probs of the rollout's completion tokens under ``model`` (differentiable unless run
    under ``no_grad``), from its hidden states and lm_head (``impl="reference"`` materialises the ``[R, T, V]``
    logits, as TRL's and OpenRLHF's trainers do)."""
    hidden = forward(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the lm_head runs in the compute dtype, as the trainer's does
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    head = head_of(model)
    bias = None if head.bias is None else head.bias.to(hidden.dtype)
    return fused_logprobs(hidden, head.weight.to(hidden.dtype), ro.completion_ids, bias=bias,
                          temperature=temperature, softcap=head.softcap, impl=impl).float()


def _no_phase(name: str):
    return contextlib.nullcontext()


def ppo_step(
    actor,
    critic: Critic,
    ref_model,
    optimizer: torch.optim.Optimizer,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    reward_fn: Callable[[Rollout], torch.Tensor],
    config: PPOConfig,
    sampling: SamplingParams,
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    group_size: int = 1,
    generator: torch.Generator | None = None,
    impl: str = "auto",
    compute_dtype: torch.dtype = torch.float32,
    phase: Callable[[str], contextlib.AbstractContextManager] = _no_phase,
) -> dict:
    """One PPO iteration: rollout, scores, reference log-probs and values, KL-penalised rewards, GAE, then
    ``config.epochs`` updates of actor and critic. Returns the metrics (scalars).

    ``reward_fn(rollout) -> [R]`` scores; prompts ``[B, P]`` left-padded, ``R = B * group_size`` samples.
    ``compute_dtype``: the forward passes run under autocast in it (the trainer's mixed precision).
    ``phase(name)`` wraps the stages ("rollout", "prepare", "forward", "backward", "optimizer") for a profiler or
    memory tracker; the gradients are dropped after each optimizer step, outside any phase.
    """
    device = prompt_ids.device
    with phase("rollout"):
        with autocast(device, compute_dtype):
            ro = generate(actor, prompt_ids, prompt_mask, group_size, sampling, eos_token_id=eos_token_id,
                          pad_token_id=pad_token_id, generator=generator)
        scores = reward_fn(ro).to(device=device, dtype=torch.float32)
    mask = ro.completion_mask.bool()
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with phase("prepare"):
        with torch.no_grad(), autocast(device, compute_dtype):
            ref_logps = completion_logprobs(ref_model, ro, temperature=config.temperature, impl=impl)
            old_values = critic(*args)
        old_logps = ro.sampling_logps
        rewards, kl = kl_penalized_rewards(scores, old_logps, ref_logps, mask, config.kl_coef, config.kl_estimator)
        advantages, returns = gae(rewards, old_values, mask, config.gamma, config.lam)
        if config.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    metrics = {"score": float(scores.mean()), "kl": float(masked_mean(kl, mask))}
    for _ in range(config.epochs):
        with phase("forward"):
            with autocast(device, compute_dtype):
                logps = completion_logprobs(actor, ro, temperature=config.temperature, impl=impl)
                values = critic(*args)
            pg_loss, pg_clip = policy_loss(logps, old_logps, advantages, mask, config.cliprange)
            vf_loss, vf_clip = value_loss(values, old_values, returns, mask, config.cliprange_value)
            loss = pg_loss + config.vf_coef * vf_loss
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics.update(pg_loss=float(pg_loss.detach()), vf_loss=float(vf_loss.detach()), pg_clipfrac=float(pg_clip),
                       vf_clipfrac=float(vf_clip), grad_norm=float(grad_norm))
    return metrics
