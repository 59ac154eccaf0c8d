"""The trainer's learning-rate schedule (``model.lr_scheduler``: ``transformers.get_scheduler``'s constant and cosine
schedules, grpo-fast's own linear factor) gives, update after update, exactly the rates of the formula the trainer has
always used: linear warm-up from lr 0, then constant, linear or cosine to 0. Every schedule, every warm-up (0, shorter
than, as long as and longer than the run), every update and the rate left after the last one (a final checkpoint keeps
it)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_fast.train.config import TrainConfig
from grpo_fast.train.model import lr_scheduler

SCHEDULES = ("constant", "linear", "cosine")


def formula(schedule: str, warmup: int, total: int, update: int) -> float:
    """The learning-rate factor of update ``update`` (counted from 0) of ``total``, in float arithmetic."""
    if update < warmup:
        return update / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _scheduler(schedule: str, warmup: int, total: int, lr: float = 1.0):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    config = TrainConfig(output_dir="unused", lr_schedule=schedule, warmup_steps=warmup)
    return optimizer, lr_scheduler(optimizer, config, total)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_factor_is_the_formula_to_the_bit(schedule):
    for total in range(1, 65):
        for warmup in range(total + 3):
            _, scheduler = _scheduler(schedule, warmup, total)
            factor = scheduler.lr_lambdas[0]
            got = [factor(k) for k in range(total + 1)]
            assert got == [formula(schedule, warmup, total, k) for k in range(total + 1)], (total, warmup)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 30), (1, 1), (4, 20), (7, 30), (29, 30), (30, 30), (45, 30)])
def test_the_optimizer_steps_with_the_formulas_rates(schedule, warmup, total):
    """The rate each update is made with, as the optimizer holds it (``base_lr * factor``), then the one left."""
    lr = 5e-4
    optimizer, scheduler = _scheduler(schedule, warmup, total, lr)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    rates.append(optimizer.param_groups[0]["lr"])
    assert rates == [lr * formula(schedule, warmup, total, k) for k in range(total + 1)]
    assert scheduler.get_last_lr() == [rates[-1]]
    if warmup:
        assert rates[0] == 0.0 and (warmup > total or rates[warmup] == lr)

