"""bench/lockstep_trl.py in a reduced form: grpo-fast's training loop fed TRL's rollouts must compute what TRL's
GRPOTrainer computes, quantity by quantity, step after step (a few steps of a tiny model), and each side's own sampling
must be TRL's. A change that breaks equality with TRL's loop fails here."""

import math

import pytest
import torch

pytest.importorskip("trl")

from bench import lockstep_trl  # noqa: E402
from grpo_fast import LossType  # noqa: E402

SMALL = {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8}


def _assert_lockstep(rows):
    first = lockstep_trl.first_difference(rows)
    assert first is None, lockstep_trl.report(rows)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {},  # the default run's options: dapo, beta 0.04 with the bias-corrected KL, the shared-prompt forward
    {"loss.loss_type": "bnpo", "shared_prefix": "off"},  # a per-micro-batch token mean (TRL's shuffle off)
    {"loss.loss_type": "grpo", "mu": "2", "loss.entropy_coef": "0.01"},  # old log-probs, two updates, the bonus
], ids=["default", "bnpo", "grpo-mu2-entropy"])
def test_loop_equals_trl(options):
    rows = lockstep_trl.lockstep(steps=3, seed=1, overrides={**SMALL, **options})
    quantities = {r.quantity.split(" (update")[0] for r in rows}
    # every quantity of the step is compared, in every step
    for name in ("prompt token ids and attention mask", "position ids in generation (prompt prefill)",
                 "position ids in the training forward", "rewards", "advantages", "reference per-token log-probs",
                 "policy per-token log-probs (training forward)", "loss (sum over micro-batches)",
                 "gradient norm (before clipping)", "learning rate of the update"):
        assert name in quantities, name
    assert {r.step for r in rows} == {1, 2, 3}
    _assert_lockstep(rows)


@pytest.mark.slow
def test_lockstep_finds_a_broken_micro_batch_weight(monkeypatch):
    """The comparison can fail: a trainer whose micro-batch weight is off by 10% is caught at the loss, the first
    quantity the weight enters (at the first step whose loss is not 0: at step 1 no group has a reward spread)."""
    from grpo_fast.train import trainer

    original = trainer.micro_batch_scale
    monkeypatch.setattr(trainer, "micro_batch_scale", lambda *a: 1.1 * original(*a))
    rows = lockstep_trl.lockstep(steps=2, seed=1, overrides=SMALL)
    first = lockstep_trl.first_difference(rows)
    assert first is not None and first.quantity == "loss (sum over micro-batches)", first


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", [t.value for t in LossType if t.in_trl])
def test_multi_turn_loss_mask_equals_trls_tool_mask(loss_type):
    """Multi-turn rollouts (tool spans inside the completions, TRL's ``env_mask``): grpo-fast's loop replays them with
    ``Rollout.loss_mask`` and must compute TRL's loss, normaliser (``num_items_in_batch``), gradients and update, for
    every loss type; for dapo (the default) with two updates per generation too, so that the old log-probs and the
    clipped ratios enter. (Two Adam steps in one generation with the others meet the comparison's known limit: a
    gradient element within float32 rounding of zero, 1e-9 against 8e-3, moves its parameter by a different fraction
    of the learning rate on each side; the gradients agree.)"""
    options = {**SMALL, "loss.loss_type": loss_type, "mu": "2" if loss_type == "dapo" else "1"}
    rows = lockstep_trl.lockstep(steps=2, seed=3, overrides=options, tool_turns=True)
    _assert_lockstep(rows)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_lockstep_finds_trained_tool_tokens(loss_type):
    """The comparison can fail: replayed without the loss mask (the tool tokens trained, the bug multi-turn trainers
    keep meeting), grpo-fast's update differs from TRL's: the loss, or its gradient where the on-policy loss's value
    happens to agree."""
    rows = lockstep_trl.lockstep(steps=2, seed=3, overrides={**SMALL, "loss.loss_type": loss_type, "mu": "2"},
                                 tool_turns=True, train_tool_tokens=True)
    first = lockstep_trl.first_difference(rows)
    assert first is not None and first.quantity.startswith(("loss", "gradient norm")), first


@pytest.mark.slow
def test_token_mean_generation_differs_from_trl():
    """token_mean='generation' is grpo-fast's own bnpo (the whole generation's token mean): not TRL's, which the
    lockstep refuses to pass to TRL (bench_peer has no counterpart for it)."""
    with pytest.raises(ValueError, match="token_mean='generation' has no TRL counterpart"):
        lockstep_trl.lockstep(steps=1, seed=1, overrides={**SMALL, "loss.loss_type": "bnpo",
                                                          "token_mean": "generation"})


@pytest.mark.slow
def test_sampling_is_trls():
    s = lockstep_trl.sampling(samples=4000, seed=1, overrides=SMALL)
    assert s["identical_same_state"] == 1.0  # the same RNG state draws the same completions
    assert s["samples"] == 4000
    for key in ("trl_vs_exact", "grpo_fast_vs_exact", "trl_vs_grpo_fast"):
        stat, dof, p = s[key]
        assert dof > 5 and p > 1e-3, (key, s[key])  # seeded: the same p-values every run


def test_chi_square_against_known_values():
    # 2 bins, chi-square 4 with 1 dof: p = 0.0455 (erfc(sqrt(2)))
    stat, dof, p = lockstep_trl.chi_square_p(torch.tensor([60.0, 40.0]), torch.tensor([50.0, 50.0]))
    assert (stat, dof) == (4.0, 1) and p == pytest.approx(math.erfc(math.sqrt(2.0)), rel=1e-9)
    # counts equal to their expectation: statistic 0, p = 1; small expected bins are merged
    stat, dof, p = lockstep_trl.chi_square_p(torch.tensor([50.0, 48.0, 1.0, 1.0]), torch.tensor([50.0, 48.0, 1, 1]))
    assert (stat, dof, p) == (0.0, 2, 1.0)
    stat, dof, p = lockstep_trl.homogeneity_p(torch.tensor([30.0, 70.0]), torch.tensor([70.0, 30.0]))
    assert (stat, dof) == (32.0, 1) and p < 1e-7
