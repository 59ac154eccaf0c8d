"""A supervised warm-up on demonstration transcripts: what a model that has never seen the tool format needs before
GRPO can reward its calls (a random policy never writes a parseable call, so no group has a reward spread to learn
from). The demonstrations go through the same tokens a rollout produces (the tool-call format's suffix, never
re-tokenised) and the same mask: only the model's tokens are trained, the tool's are context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grpo_fast.logprobs import fused_logprobs
from grpo_fast.train.forward import completion_hidden, head_of

__all__ = ["Demonstration", "supervised_warmup"]


@dataclass(frozen=True)
class Demonstration:
    """A transcript: the prompt's ids, then segments of ids, each the model's (trained) or the tool's (context)."""

    prompt_ids: list[int]
    segments: tuple[tuple[tuple[int, ...], bool], ...]

    @property
    def completion(self) -> tuple[list[int], list[int]]:
        ids = [t for segment, _ in self.segments for t in segment]
        mask = [int(trained) for segment, trained in self.segments for _ in segment]
        return ids, mask


def _batch(demos: Sequence[Demonstration], pad_id: int) -> tuple[torch.Tensor, ...]:
    P = max(len(d.prompt_ids) for d in demos)
    pairs = [d.completion for d in demos]
    T = max(len(ids) for ids, _ in pairs)
    prompt_ids = torch.full((len(demos), P), pad_id)
    prompt_mask = torch.zeros((len(demos), P), dtype=torch.long)
    ids = torch.full((len(demos), T), pad_id)
    attention = torch.zeros((len(demos), T), dtype=torch.long)
    trained = torch.zeros((len(demos), T), dtype=torch.long)
    for i, (d, (c, m)) in enumerate(zip(demos, pairs)):
        prompt_ids[i, P - len(d.prompt_ids):] = torch.tensor(d.prompt_ids)
        prompt_mask[i, P - len(d.prompt_ids):] = 1
        ids[i, : len(c)] = torch.tensor(c)
        attention[i, : len(c)] = 1
        trained[i, : len(m)] = torch.tensor(m)
    return prompt_ids, prompt_mask, ids, attention, trained


def supervised_warmup(model, demos: Sequence[Demonstration], *, steps: int, batch_size: int, lr: float, seed: int,
                      pad_id: int, progress: Callable[[int, float], None] | None = None) -> list[float]:
    """``steps`` AdamW steps of token-mean cross-entropy on the demonstrations' model tokens, batches drawn with
    ``seed``; returns the losses. The model is left in train mode."""
    if steps < 1 or batch_size < 1 or not demos:
        raise ValueError(f"supervised_warmup needs steps >= 1, batch_size >= 1 and demonstrations, got steps={steps}, "
                         f"batch_size={batch_size}, {len(demos)} demonstrations")
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        pick = torch.randint(len(demos), (batch_size,), generator=generator).tolist()
        prompt_ids, prompt_mask, ids, attention, trained = (
            t.to(device) for t in _batch([demos[i] for i in pick], pad_id))
        hidden = completion_hidden(model, prompt_ids, prompt_mask, ids, attention)
        logps = fused_logprobs(hidden, head_of(model).weight, ids, impl="torch")
        loss = -(logps * trained).sum() / trained.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    return losses
