"""grpo-fast inside verl 0.9.1's real actor (TrainingWorker around FSDPEngineWithLMHead, FSDP2, CPU): the
``grpo_fast`` fused-kernel backend and the ``grpo_fast.*`` policy losses give verl's numbers.

Every comparison is the project's one rule (grpo_fast.testing): a float32 run through grpo-fast against the same
actor run in float64 through verl's logits path and verl's own loss (the reference), within twice the error of verl's
float32 logits path plus float32's atol: log-probs and entropy of ``infer_batch``, and the loss, the gradient norm and
every parameter's gradient of one ``train_mini_batch`` (one mini-batch of two micro-batches)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as H  # noqa: E402

from grpo_fast.integrations import verl as gv  # noqa: E402
from grpo_fast.testing import assert_close_rule  # noqa: E402
from grpo_fast.verl_losses import LOSS_NAMES, REFUSED  # noqa: E402

VOCAB = 96
TEMPERATURE = 0.7
LAYOUTS = [(tied, rmpad) for tied in (True, False) for rmpad in (False, True)]
LAYOUT_IDS = [f"{'tied' if t else 'untied'}-{'packed' if p else 'padded'}" for t, p in LAYOUTS]
# each loss's own options, as a verl config would set them (the same on both sides)
LOSS_OPTIONS = {
    "dro": dict(policy_loss={"dro_beta": 0.1}),
    "kl_cov": dict(policy_loss={"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}),
    "clip_cov": dict(policy_loss={"clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}),
    "gspo": dict(clip_ratio_low=3e-3, clip_ratio_high=4e-3),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_tiny")
    return {tied: H.tiny_model_dir(root, tied=tied, vocab=VOCAB) for tied in (True, False)}


@pytest.fixture(scope="module")
def batch(model_dirs):
    """A rollout batch whose old log-probs are the model's own plus noise (ratios off 1: clipping acts), with KL
    reference log-probs and rollout importance weights."""
    raw = H.make_batch(VOCAB, batch=4, prompt_len=6, response_len=5, seed=0, rollout_is_weights=True)
    lp, _ = H.infer(H.make_actor(model_dirs[True], use_remove_padding=False, temperature=TEMPERATURE), raw)
    return H.with_old_log_probs(raw, lp, noise=0.3)


def run(model_dir, batch, rmpad, *, precision="fp32", backend=None, loss_mode="vanilla", **options):
    """infer() then one train_step() of a fresh actor: (log_probs, entropy, step)."""
    actor = H.make_actor(model_dir, use_remove_padding=rmpad, use_fused_kernels=backend is not None,
                         fused_backend=backend, temperature=TEMPERATURE, n_micro=2, precision=precision,
                         loss_mode=loss_mode, **options)
    lp, ent = H.infer(actor, batch)
    torch.manual_seed(1234)  # clip_cov draws its tokens from the global generator: the same draws on every side
    return lp, ent, H.train_step(actor, batch), actor


_REFERENCES: dict = {}


def verl_runs(model_dir, batch, rmpad, loss_mode="vanilla", **options):
    """verl's logits path with verl's own loss: (float64 reference, float32), cached per configuration."""
    key = (model_dir, rmpad, loss_mode, repr(sorted(options.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = tuple(run(model_dir, batch, rmpad, precision=p, loss_mode=loss_mode, **options)[:3]
                                 for p in ("fp64", "fp32"))
    return _REFERENCES[key]


def assert_verl_numbers(ours, verl32, ref64, what=""):
    """The rule on log-probs, entropy, loss, gradient norm and every gradient."""
    (lp, ent, step), (lp32, ent32, step32), (lp64, ent64, step64) = ours[:3], verl32, ref64
    assert lp.dtype == torch.float32 and lp64.dtype == torch.float64
    assert_close_rule(lp, lp32, lp64, torch.float32, f"{what} log_probs")
    assert_close_rule(ent, ent32, ent64, torch.float32, f"{what} entropy")
    for key in ("loss", "grad_norm"):
        assert_close_rule(*(torch.tensor(s[key], dtype=torch.float64) for s in (step, step32, step64)),
                          torch.float32, f"{what} {key}")
    assert sorted(step["grads"]) == sorted(step64["grads"])
    for name, g64 in step64["grads"].items():
        assert g64 is not None and step["grads"][name] is not None, name
        assert_close_rule(step["grads"][name], step32["grads"][name], g64, torch.float32, f"{what} d {name}")


@pytest.mark.parametrize("tied, rmpad", LAYOUTS, ids=LAYOUT_IDS)
def test_log_probs_entropy_loss_and_gradients_are_verls(model_dirs, batch, tied, rmpad):
    """The head alone (verl's vanilla loss), with the KL loss, an entropy bonus (its gradient runs through the fused
    entropy) and rollout importance weights; the untied head is an FSDP2 unit of its own (verl 0.9.1's wrapping)."""
    options = dict(use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.05, entropy_coeff=0.01)
    ours = run(model_dirs[tied], batch, rmpad, backend=gv.BACKEND, **options)
    assert_verl_numbers(ours, *reversed(verl_runs(model_dirs[tied], batch, rmpad, **options)))
    assert ("lm_head" in ours[3].worker.fsdp_unit_names()) is (not tied)


@pytest.mark.parametrize("tied, rmpad", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_every_policy_loss_gives_verls_numbers(model_dirs, batch, loss, tied, rmpad):
    """``policy_loss.loss_mode=grpo_fast.<loss>`` on the grpo_fast backend against verl's ``<loss>`` on its logits
    path."""
    options = LOSS_OPTIONS.get(loss, {})
    ours = run(model_dirs[tied], batch, rmpad, backend=gv.BACKEND, loss_mode=gv.LOSS_PREFIX + loss, **options)
    assert_verl_numbers(ours, *reversed(verl_runs(model_dirs[tied], batch, rmpad, loss_mode=loss, **options)),
                        what=loss)


@pytest.mark.parametrize("agg", ["token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_loss_agg_mode_gives_verls_numbers(model_dirs, batch, agg):
    options = dict(loss_agg_mode=agg, use_kl_loss=True, kl_loss_type="k3+", kl_loss_coef=0.05)
    ours = run(model_dirs[False], batch, True, backend=gv.BACKEND, loss_mode=gv.LOSS_PREFIX + "vanilla", **options)
    assert_verl_numbers(ours, *reversed(verl_runs(model_dirs[False], batch, True, **options)), what=agg)


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "packed"])
def test_same_numbers_as_verls_fused_path_where_it_runs(model_dirs, batch, rmpad):
    """Tied head: verl's own fused torch backend runs; both are held to the same float64 reference."""
    verls = run(model_dirs[True], batch, rmpad, backend="torch")
    ours = run(model_dirs[True], batch, rmpad, backend=gv.BACKEND)
    ref64, verl32 = verl_runs(model_dirs[True], batch, rmpad)
    assert_verl_numbers(verls, verl32, ref64, "verl fused")
    assert_verl_numbers(ours, verl32, ref64, "grpo-fast")


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "packed"])
def test_untied_head_runs_where_verls_fused_path_fails(model_dirs, batch, rmpad):
    """verl#5633: FSDP2 shards the untied lm_head as a unit of its own and verl's fused forward reads its weight
    outside its forward (a sharded DTensor); grpo-fast calls the head through an FSDP2 forward method."""
    verls = H.make_actor(model_dirs[False], use_remove_padding=rmpad, temperature=TEMPERATURE,
                         use_fused_kernels=True, fused_backend="torch")
    assert "lm_head" in verls.worker.fsdp_unit_names()
    with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
        H.infer(verls, batch)
    ours = run(model_dirs[False], batch, rmpad, backend=gv.BACKEND)
    assert_verl_numbers(ours, *reversed(verl_runs(model_dirs[False], batch, rmpad)))


def test_lora_adapters_get_verls_gradients(model_dirs, batch):
    options = dict(lora_rank=4, lora_alpha=8, model_overrides={"target_modules": "all-linear"})
    ours = run(model_dirs[False], batch, True, backend=gv.BACKEND, **options)
    ref64, verl32 = verl_runs(model_dirs[False], batch, True, **options)
    assert ours[2]["grads"] and all("lora_" in name for name in ours[2]["grads"])
    assert_verl_numbers(ours, verl32, ref64, "lora")


def test_the_triton_kernels_give_verls_numbers(model_dirs, batch, monkeypatch):
    """GRPO_FAST_VERL_IMPL=triton: the Triton log-prob kernels (through the interpreter here) in verl's packed
    layout, ``[1, tokens, H]``."""
    monkeypatch.setenv(gv.IMPL_ENV, "triton")
    ours = run(model_dirs[False], batch, True, backend=gv.BACKEND)
    assert_verl_numbers(ours, *reversed(verl_runs(model_dirs[False], batch, True)), "triton")


@pytest.mark.parametrize("breakage", ["temperature", "entropy gradient", "labels"])
def test_a_broken_backend_fails_the_comparison(model_dirs, batch, monkeypatch, breakage):
    """The comparison sees what a wrong head would get wrong: a temperature off by 1%, an entropy without its
    gradient (the entropy bonus then trains nothing), labels not rolled."""
    head = gv._head_logprobs

    def broken(self, hidden, labels, temperature, text_config):
        if breakage == "temperature":
            return head(self, hidden, labels, temperature * 1.01, text_config)
        if breakage == "labels":
            return head(self, hidden, torch.roll(labels, 1, -1), temperature, text_config)
        logp, entropy = head(self, hidden, labels, temperature, text_config)
        return logp, entropy.detach()

    monkeypatch.setattr(gv, "_head_logprobs", broken)
    options = dict(entropy_coeff=0.5)
    ours = run(model_dirs[False], batch, True, backend=gv.BACKEND, **options)
    with pytest.raises(AssertionError):
        assert_verl_numbers(ours, *reversed(verl_runs(model_dirs[False], batch, True, **options)))


def test_ulysses_sequence_parallelism_is_refused_by_name(model_dirs, batch, monkeypatch):
    import verl.utils.ulysses as ulysses

    actor = H.make_actor(model_dirs[True], use_remove_padding=True, temperature=TEMPERATURE, use_fused_kernels=True,
                         fused_backend=gv.BACKEND)
    monkeypatch.setattr(ulysses, "get_ulysses_sequence_parallel_world_size", lambda group=None: 2)
    with pytest.raises(NotImplementedError, match="Ulysses sequence parallelism.*ulysses_sequence_parallel_size=2"):
        H.infer(actor, batch)


def test_a_lora_adapter_on_the_lm_head_is_refused_by_name(model_dirs, batch):
    """fused_logprobs reads lm_head.weight: an adapter there would be left out (verl's own fused path leaves it out
    without a word). verl 0.9.1's FSDP2 wrapping cannot shard such a head as a unit of its own (``__class__
    assignment: 'FSDPLinear' object layout differs``): kept in the root unit, it builds."""
    actor = H.make_actor(model_dirs[False], use_remove_padding=True, temperature=TEMPERATURE, use_fused_kernels=True,
                         fused_backend=gv.BACKEND, lora_rank=4, lm_head_own_fsdp_unit=False,
                         model_overrides={"target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(NotImplementedError, match="lm_head carries a LoRA adapter"):
        H.infer(actor, batch)


def test_vision_language_models_and_a_bad_impl_are_refused_by_name(monkeypatch):
    from types import SimpleNamespace

    from verl.models.transformers import monkey_patch

    model = SimpleNamespace(config=SimpleNamespace(model_type="qwen2_vl"))
    with pytest.raises(NotImplementedError, match="model_type 'qwen2_vl'"):
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=gv.BACKEND)
    with pytest.raises(NotImplementedError, match="model_type 'qwen2_vl'"):  # verl's arguments, given by position
        monkey_patch.patch_forward_with_backends(model, True, gv.BACKEND)
    monkeypatch.setenv(gv.IMPL_ENV, "cuda")
    with pytest.raises(ValueError, match="GRPO_FAST_VERL_IMPL must be one of auto, triton, torch, got 'cuda'"):
        gv._impl()
    monkeypatch.setenv(gv.IMPL_ENV, "reference")  # the materialised logits: never the backend
    with pytest.raises(ValueError, match="got 'reference'"):
        gv._impl()


def test_a_verl_other_than_the_tested_one_is_named(monkeypatch, caplog):
    import logging

    import verl
    from verl.models.transformers import monkey_patch

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    monkeypatch.setattr(gv, "_installed", False)
    monkeypatch.setattr(monkey_patch, "patch_forward_with_backends", monkey_patch.patch_forward_with_backends)
    with caplog.at_level(logging.WARNING, logger=gv.__name__):
        gv.install()
    assert "tested with verl 0.9.1; this is verl 0.10.0" in caplog.text


def test_refused_losses_say_why(batch):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    for name, reason in REFUSED.items():
        with pytest.raises(NotImplementedError, match=f"'grpo_fast.{name}' is not offered by grpo-fast"):
            get_policy_loss_fn(gv.LOSS_PREFIX + name)(None, None, None, None)
        assert reason


def test_the_entry_point_installs_grpo_fast_on_import_verl_only():
    """``import verl`` loads the plugin (as in every Ray worker); VERL_USE_EXTERNAL_PLUGINS=none keeps it out."""
    probe = ("import verl; from verl.models.transformers import monkey_patch as m; "
             "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as r; "
             "print(getattr(m.patch_forward_with_backends, 'grpo_fast_backend', None), "
             "sorted(k for k in r if k.startswith('grpo_fast.')))")
    for policy, installed in (("auto", True), ("none", False)):
        env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": policy}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        module, names = out.stdout.strip().split(" ", 1)
        assert (module == gv.BACKEND) is installed, out.stdout
        want = sorted(gv.LOSS_PREFIX + n for n in (*LOSS_NAMES, *REFUSED))
        assert names == (repr(want) if installed else "[]"), out.stdout


@pytest.mark.slow
def test_through_a_ray_worker_group(model_dirs, batch):
    """verl's RayWorkerGroup (use_gpu=False) of two ranks: each worker process imports verl, which loads the plugin
    there; each rank holds half of every parameter, the untied head an FSDP2 unit of its own gathered around the
    fused call: the log-probs are the in-process ones bit for bit, and one train_mini_batch gives verl's loss and
    gradient norm by the rule."""
    import copy

    import ray
    from verl.utils import tensordict_utils as tu

    kw = dict(use_remove_padding=True, temperature=TEMPERATURE, use_fused_kernels=True, fused_backend=gv.BACKEND)
    H.ray_init(num_cpus=2)
    try:
        two = H.make_ray_actor(model_dirs[False], world_size=2, **kw)
        assert "lm_head" in two.group.fsdp_unit_names()[0]
        td = H.infer_tensordict(batch, TEMPERATURE)
        tu.assign_non_tensor(td, micro_batch_size_per_gpu=len(batch) // 2)
        lp2, ent2 = H._unpack_infer(two.group.infer_batch(copy.copy(td)).get(), td)
        out = two.group.train_mini_batch(copy.copy(H.train_tensordict(batch, TEMPERATURE, n_micro=2)))
        out = out.get() if hasattr(out, "get") and not isinstance(out, dict) else out
        metrics = tu.get(out[0] if isinstance(out, list) else out, "metrics")
    finally:
        ray.shutdown()
    lp0, ent0 = H.infer(H.make_actor(model_dirs[False], **kw), batch)
    assert torch.equal(lp2, lp0) and torch.equal(ent2, ent0)
    ref64, verl32 = verl_runs(model_dirs[False], batch, True)
    for key in ("loss", "grad_norm"):
        assert_close_rule(torch.tensor(float(metrics[key][0]), dtype=torch.float64),
                          *(torch.tensor(r[2][key], dtype=torch.float64) for r in (verl32, ref64)), torch.float32,
                          f"two ranks: {key}")



def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          final_logit_softcapping=2.0, initializer_range=1.0,
                                          attn_implementation="eager"))


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    return CohereForCausalLM(CohereConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, logit_scale=3.0,
                                          initializer_range=0.5,
                                          attn_implementation="eager"))


@pytest.mark.parametrize("make", [_gemma2, _cohere], ids=["gemma2-softcap", "cohere-logit-scale"])
def test_what_a_model_does_to_its_logits_is_applied(make):
    """A model that scales (Cohere ``logit_scale``) or caps (Gemma 2 ``final_logit_softcapping``) its logits: the
    backend's log-probs and entropy are those of the model's own logits (verl's fused torch path,
    FusedLinearForPPO, applies neither), held to the float64 model by the rule."""
    from verl.models.transformers import monkey_patch

    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    labels = torch.roll(ids, -1, -1)

    def recompute(m):
        logp = torch.log_softmax(m(input_ids=ids).logits / TEMPERATURE, -1)
        return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)

    with torch.no_grad():
        ref_lp, ref_ent = recompute(copy.deepcopy(model).double())
        pt_lp, pt_ent = recompute(model)
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=gv.BACKEND)
        out = model(input_ids=ids, temperature=TEMPERATURE, return_dict=True)
    assert ref_ent.std() > 0.01  # the logits vary: a comparison that means something
    assert_close_rule(out.log_probs, pt_lp, ref_lp, torch.float32, "log_probs")
    assert_close_rule(out.entropy, pt_ent, ref_ent, torch.float32, "entropy")
