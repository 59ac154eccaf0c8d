"""Smoke tests of the CPU harness that drives verl 0.9.1's real actor (harness.py): verl's logits path against an
independent float64 recompute, gradients, determinism, verl's own fused torch backend (and verl issue #5633 with an
untied lm_head under FSDP2), and one run through a Ray worker group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as H  # noqa: E402

from grpo_fast.testing import assert_close_rule  # noqa: E402

VOCAB = 96
T = 0.7


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_tiny")
    return {tied: H.tiny_model_dir(root, tied=tied, vocab=VOCAB) for tied in (True, False)}


@pytest.fixture(scope="module")
def batch():
    return H.make_batch(VOCAB, batch=4, prompt_len=6, response_len=5, seed=0)


@pytest.fixture(scope="module")
def logits_path(model_dirs, batch):
    """verl's logits path (use_fused_kernels=False) per (tied, use_remove_padding): infer() and one train_step()
    with two micro-batches, each from a fresh worker."""
    cache = {}

    def get(tied, rmpad):
        if (tied, rmpad) not in cache:
            actor = H.make_actor(model_dirs[tied], use_remove_padding=rmpad, temperature=T, n_micro=2)
            lp, ent = H.infer(actor, batch)
            cache[tied, rmpad] = (lp, ent, H.train_step(actor, batch))
        return cache[tied, rmpad]

    return get


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_path_matches_float64_recompute(model_dirs, batch, logits_path, tied, rmpad):
    lp, ent, _ = logits_path(tied, rmpad)
    ref_lp, ref_ent = H.hf_reference_logprobs(model_dirs[tied], batch, temperature=T)
    mask = batch.batch["response_mask"].bool()
    assert lp.shape == ent.shape == mask.shape and lp.dtype == torch.float32
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    pt_lp, pt_ent = H.hf_reference_logprobs(model_dirs[tied], batch, temperature=T, dtype=torch.float32)
    assert_close_rule(lp, pt_lp, ref_lp, torch.float32, "log_probs")
    assert_close_rule(ent, pt_ent, ref_ent, torch.float32, "entropy")
    assert ref_lp[mask].std() > 0.1  # the tiny model's log-probs vary: a comparison that means something


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_train_step_gives_finite_nonzero_gradients(model_dirs, logits_path, tied, rmpad):
    _, _, out = logits_path(tied, rmpad)
    actor_params = H.hf_param_shapes(model_dirs[tied])
    assert sorted(out["grads"]) == sorted(actor_params)
    assert ("lm_head.weight" in out["grads"]) is (not tied)
    for name, g in out["grads"].items():
        assert g.dtype == torch.float32 and g.shape == actor_params[name], name
        assert torch.isfinite(g).all(), name
        assert g.abs().max() > 0, name
    m = out["metrics"]
    for key in ("loss", "grad_norm", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert key in m, key
    # the captured gradients are the ones verl's grad_norm is computed from (before clipping)
    norm64 = torch.sqrt(sum((g.double() ** 2).sum() for g in out["grads"].values()))
    norm32 = torch.sqrt(sum((g ** 2).sum() for g in out["grads"].values()))
    assert_close_rule(torch.tensor(out["grad_norm"]), norm32, norm64, torch.float32, "grad_norm")
    assert out["grad_norm"] > 1.0  # clip_grad=1.0 acts on this step: the capture is upstream of it


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused-torch"])
def test_two_workers_from_one_dir_are_bit_identical(model_dirs, batch, fused):
    kw = dict(use_remove_padding=True, temperature=T, n_micro=2, use_fused_kernels=fused,
              fused_backend="torch" if fused else None)
    runs = []
    for _ in range(2):
        actor = H.make_actor(model_dirs[True], **kw)
        runs.append((*H.infer(actor, batch), H.train_step(actor, batch)))
    (lp_a, ent_a, out_a), (lp_b, ent_b, out_b) = runs
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert out_a["loss"] == out_b["loss"] and out_a["grad_norm"] == out_b["grad_norm"]
    assert all(torch.equal(out_a["grads"][k], out_b["grads"][k]) for k in out_a["grads"])


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "packed"])
def test_verl_fused_torch_backend_untied_issue_5633(model_dirs, batch, logits_path, rmpad):
    """verl#5633 reproduces in one CPU process: FSDP2 makes an untied lm_head a unit of its own (0.9.1 always does,
    `_select_fsdp2_wrap_targets`); verl's fused forward reads `self.lm_head.weight` without calling lm_head, so that
    unit never all-gathers and the weight is still a sharded DTensor. With lm_head kept in the root unit it works and
    runs."""
    kw = dict(use_remove_padding=rmpad, temperature=T, n_micro=2, use_fused_kernels=True, fused_backend="torch")
    default = H.make_actor(model_dirs[False], **kw)
    assert "lm_head" in default.worker.fsdp_unit_names()
    with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
        H.infer(default, batch)

    root = H.make_actor(model_dirs[False], lm_head_own_fsdp_unit=False, **kw)
    assert "lm_head" not in root.worker.fsdp_unit_names()
    H.infer(root, batch)  # runs (its numbers: tests/in_verl/test_verl_backend.py)


def test_fused_patch_stays_local_to_its_worker(model_dirs, batch, logits_path):
    """verl's fused-kernel patch assigns Qwen2ForCausalLM.forward class-wide; the harness moves it onto the worker's
    model so a later logits-path worker (and the HF reference) still run HF's forward."""
    from transformers import Qwen2ForCausalLM

    before = Qwen2ForCausalLM.__dict__["forward"]
    H.make_actor(model_dirs[True], use_remove_padding=True, temperature=T, use_fused_kernels=True,
                 fused_backend="torch")
    assert Qwen2ForCausalLM.__dict__["forward"] is before
    later = H.make_actor(model_dirs[True], use_remove_padding=True, temperature=T)
    lp, ent = H.infer(later, batch)
    lp0, ent0, _ = logits_path(True, True)
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)


@pytest.mark.slow
def test_ray_worker_group_infer_matches_in_process(model_dirs, batch, logits_path):
    import ray

    H.ray_init(num_cpus=2)
    try:
        actor = H.make_ray_actor(model_dirs[True], use_remove_padding=True, temperature=T)
        lp, ent = H.infer(actor, batch)
    finally:
        ray.shutdown()
    lp0, ent0, _ = logits_path(True, True)
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
