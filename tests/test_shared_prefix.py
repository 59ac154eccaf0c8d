"""The shared-prefix forward against the unshared one: hidden states, log-probs and every parameter gradient.

The reference is :func:`grpo_fast.train.forward.completion_hidden` on the G-times repeated prompts (the forward the
trainer runs without sharing). In float64 both sides agree to rounding (the float64 tolerance of the rule); the
isolation tests check the attention pattern itself, so that equality cannot come from both sides being wrong alike.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

import grpo_fast
from grpo_fast import GRPOLossConfig, grpo_loss
from grpo_fast.testing import assert_close_rule
from grpo_fast.train.forward import completion_hidden, head_of
from grpo_fast.train.rollout import SamplingParams, generate
from grpo_fast.train.shared_prefix import (
    PREFIX,
    SharedPrefixUnsupported,
    shared_prefix_forward,
    token_counts,
    unsupported_reason,
)

V = 64
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),  # with a window it is refused
}


@pytest.fixture(autouse=True)
def rms_norm_in_the_input_dtype(monkeypatch):
    """transformers' RMSNorms compute in float32 whatever the input dtype. The shared forward adds a prompt's G
    upstream gradients before that float32 cast, the unshared one after it, so in float64 the two would differ at
    float32 rounding (~1e-7 relative, measured) for a reason that is not the shared pattern. The tests run the norms
    in the input dtype; the float32 test below keeps transformers' own norms."""

    def exact(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in (modeling_llama, modeling_qwen2, modeling_qwen3, modeling_mistral):
        for name in dir(module):
            if name.endswith("RMSNorm"):
                monkeypatch.setattr(getattr(module, name), "forward", exact)


def build(arch: str, dtype=torch.float64, seed: int = 0, **extra):
    config_cls, model_cls, own = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SMALL, **own, **extra})).to(dtype)
    return model.train()


def batch(B: int, G: int, P: int, T: int, seed: int = 0):
    """Left-padded prompts of uneven lengths (one of a single token) and right-padded completions of uneven lengths
    (one of a single token, one of the full T)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(1, V, (B, P), generator=gen)
    prompt_lengths = torch.randint(1, P + 1, (B,), generator=gen)
    prompt_lengths[0], prompt_lengths[-1] = P, 1
    prompt_mask = (torch.arange(P) >= P - prompt_lengths[:, None]).long()
    prompt_ids = prompt_ids * prompt_mask  # padding id 0
    completion_ids = torch.randint(1, V, (B * G, T), generator=gen)
    lengths = torch.randint(1, T + 1, (B * G,), generator=gen)
    lengths[0], lengths[1] = T, 1
    completion_mask = (torch.arange(T) < lengths[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask


def unshared(model, prompt_ids, prompt_mask, completion_ids, completion_mask, G):
    return completion_hidden(model, prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0),
                             completion_ids, completion_mask)


def loss_and_grads(model, hidden, completion_ids, completion_mask, advantages):
    out = grpo_loss(hidden, head_of(model).weight, completion_ids, advantages, completion_mask, impl="torch",
                    config=GRPOLossConfig(loss_type="bnpo"))
    model.zero_grad(set_to_none=True)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_equal_at_fp64(got, want, name):
    assert_close_rule(got, want, want, torch.float64, name)


@pytest.mark.parametrize("G", [2, 8, 16])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_hidden_logps_and_gradients_equal_the_unshared_forward(arch, G):
    model = build(arch)
    data = batch(B=3, G=G, P=7, T=6, seed=G)
    prompt_ids, prompt_mask, completion_ids, completion_mask = data
    mask = completion_mask.bool()
    advantages = torch.randn(3 * G, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    h_ref = unshared(model, *data, G)
    out_ref, grads_ref = loss_and_grads(model, h_ref, completion_ids, completion_mask, advantages)
    h = shared_prefix_forward(model, *data, group_size=G)
    out, grads = loss_and_grads(model, h, completion_ids, completion_mask, advantages)

    assert h.shape == h_ref.shape == (3 * G, 6, 32)
    assert_equal_at_fp64(h[mask], h_ref[mask], "hidden")
    assert_equal_at_fp64(out.per_token_logps[mask], out_ref.per_token_logps[mask], "per-token log-probs")
    assert_equal_at_fp64(out.loss, out_ref.loss, "loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert grads_ref[name].abs().max() > 0, name  # every parameter is reached, so the comparison means something
        assert_equal_at_fp64(grads[name], grads_ref[name], name)


def test_float32_within_the_tolerance_rule(monkeypatch):
    monkeypatch.undo()  # transformers' own (float32) norms
    model = build("qwen2")
    data = batch(B=2, G=4, P=5, T=4)
    mask = data[3].bool()
    h_ref = unshared(model, *data, 4)
    model32 = build("qwen2", torch.float32)
    h_pt = unshared(model32, *data, 4)
    h = shared_prefix_forward(model32, *data, group_size=4)
    assert_close_rule(h[mask], h_pt[mask], h_ref[mask], torch.float32, "hidden")


def test_gradient_checkpointing_recomputes_the_shared_pattern():
    model = build("llama")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    data = batch(B=2, G=4, P=5, T=4)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.5, 1.5, -2.0], dtype=torch.float64)
    _, grads_ref = loss_and_grads(model, unshared(model, *data, 4), data[2], data[3], adv)
    _, grads = loss_and_grads(model, shared_prefix_forward(model, *data, group_size=4), data[2], data[3], adv)
    for name in grads:
        assert_equal_at_fp64(grads[name], grads_ref[name], name)


def test_a_completion_sees_only_the_prompt_and_its_own_tokens():
    model = build("qwen3")
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(B=2, G=4, P=6, T=5)
    h = shared_prefix_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=4)
    changed = completion_ids.clone()
    changed[1] = (changed[1] + 1) % V  # another completion of the same prompt
    h2 = shared_prefix_forward(model, prompt_ids, prompt_mask, changed, completion_mask, group_size=4)
    others = [r for r in range(8) if r != 1]
    assert torch.equal(h2[others], h[others])
    assert not torch.allclose(h2[1, 1:], h[1, 1:])  # its own later positions do change
    padded = prompt_ids.clone()
    padded[prompt_mask == 0] = 7  # the values under the prompt's padding never matter
    assert torch.equal(shared_prefix_forward(model, padded, prompt_mask, completion_ids, completion_mask, 4), h)


def test_gradients_of_all_completions_reach_the_prompt():
    model = build("qwen2")
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(B=1, G=3, P=4, T=3)
    embeds = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: embeds.append(o) or o.retain_grad())
    h = shared_prefix_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=3)
    hook.remove()
    per_row = []
    for row in range(3):  # each completion's loss on its own: its gradient reaches the one prompt copy
        embeds[0].grad = None
        h[row, -1].sum().backward(retain_graph=True)
        per_row.append(embeds[0].grad[0, :4].clone())
    assert all(g.abs().max() > 0 for g in per_row)
    embeds[0].grad = None
    h[:, -1].sum().backward()
    torch.testing.assert_close(embeds[0].grad[0, :4], sum(per_row), rtol=1e-12, atol=1e-12)


def test_lora_model_shares_the_prompt():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    data = batch(B=2, G=4, P=5, T=4)
    adv = torch.linspace(-1, 1, 8, dtype=torch.float64)
    _, grads_ref = loss_and_grads(model, unshared(model, *data, 4), data[2], data[3], adv)
    _, grads = loss_and_grads(model, shared_prefix_forward(model, *data, group_size=4), data[2], data[3], adv)
    lora = [n for n in grads if "lora_" in n]
    assert lora
    for name in lora:
        assert_equal_at_fp64(grads[name], grads_ref[name], name)


def test_ordinary_calls_are_unchanged_after_the_switch():
    model = build("qwen2").eval()
    prompt_ids, prompt_mask, *_ = batch(B=3, G=1, P=6, T=2)
    before = model(input_ids=prompt_ids, attention_mask=prompt_mask).logits
    shared_prefix_forward(model, *batch(B=3, G=2, P=6, T=2), group_size=2)
    assert model.config._attn_implementation == PREFIX + "sdpa"
    after = model(input_ids=prompt_ids, attention_mask=prompt_mask).logits
    assert torch.equal(after[prompt_mask.bool()], before[prompt_mask.bool()])


def test_flex_backend_forward_matches():
    model = build("llama")
    data = batch(B=2, G=4, P=6, T=5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention warns that it runs uncompiled on CPU
        h = shared_prefix_forward(model, *data, group_size=4, backend="flex")
        h_ref = unshared(model, *data, 4)
    mask = data[3].bool()
    assert_equal_at_fp64(h[mask], h_ref[mask], "hidden (flex)")


# ------------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_prefilled_once_equals_independent_prefills(temperature):
    model = build("qwen2", seed=4)
    prompt_ids, prompt_mask, *_ = batch(B=3, G=1, P=6, T=1, seed=5)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=0.95 if temperature else 1.0)
    kwargs = dict(eos_token_id=V - 1, pad_token_id=0)
    shared = generate(model, prompt_ids, prompt_mask, 4, params, generator=torch.Generator().manual_seed(3), **kwargs)
    independent = generate(model, prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0), 1, params,
                           generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(shared.completion_ids, independent.completion_ids)
    assert torch.equal(shared.completion_mask, independent.completion_mask)
    torch.testing.assert_close(shared.sampling_logps, independent.sampling_logps, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------- refusals


def test_unsupported_architecture_is_refused():
    model = Gemma2ForCausalLM(Gemma2Config(**{**SMALL, "head_dim": 8, "attn_implementation": "eager"}))
    data = batch(B=1, G=2, P=3, T=2)
    with pytest.raises(SharedPrefixUnsupported, match="model type 'gemma2'"):
        shared_prefix_forward(model, *data, group_size=2)


def test_eager_attention_is_refused_with_the_fix():
    model = build("llama", attn_implementation="eager")
    assert "attn_implementation='sdpa'" in unsupported_reason(model)
    with pytest.raises(SharedPrefixUnsupported, match="eager"):
        shared_prefix_forward(model, *batch(B=1, G=2, P=3, T=2), group_size=2)


@pytest.mark.parametrize("arch, options", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    ("mistral", dict(sliding_window=4)),
])
def test_sliding_window_layers_are_refused(arch, options):
    model = build(arch, **options)
    with pytest.raises(SharedPrefixUnsupported, match="sliding-window"):
        shared_prefix_forward(model, *batch(B=1, G=2, P=3, T=2), group_size=2)


def test_a_layer_that_bypasses_the_registry_is_caught(monkeypatch):
    model = build("llama")
    attn = model.model.layers[1].self_attn
    forward = attn.forward
    monkeypatch.setattr(attn, "forward", lambda *a, grpo_fast_prefix=None, **k: forward(*a, **k))
    with pytest.raises(SharedPrefixUnsupported, match="1 of the model's 2 attention layers"):
        shared_prefix_forward(model, *batch(B=1, G=2, P=3, T=2), group_size=2)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: (d[0], d[1], d[2][:-1], d[3][:-1]), "expected B\\*G = 2\\*3 = 6 rows"),
        (lambda d: (d[0], d[1].flip(1), d[2], d[3]), "left-padded"),
        (lambda d: (d[0], d[1][:, :-1], d[2], d[3]), "prompt_ids, prompt_mask"),
        (lambda d: (d[0], d[1], d[2], d[3][:, :-1]), "completion_ids, completion_mask"),
    ],
    ids=["rows", "right-padded-prompt", "prompt-mask-shape", "completion-mask-shape"],
)
def test_bad_shapes_name_the_argument(change, match):
    model = build("llama")
    data = change(batch(B=2, G=3, P=4, T=3))
    with pytest.raises(ValueError, match=match):
        shared_prefix_forward(model, *data, group_size=3)
    assert model.config._attn_implementation == "sdpa"  # a refused call leaves the model as it was


def _meta(x):
    return x.to("meta")


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda d: (d[0], d[1] * 0.5, d[2], d[3]), ValueError,
         r"shared_prefix_forward: prompt_mask must hold only 0 and 1, got other values in tensor of shape \(2, 4\), "
         r"dtype torch.float32"),
        (lambda d: (d[0], d[1] * 2, d[2], d[3]), ValueError, "prompt_mask must hold only 0 and 1"),
        (lambda d: (d[0] + V, d[1], d[2], d[3]), ValueError,
         rf"shared_prefix_forward: prompt_ids must hold ids in \[0, {V}\) \(the rows of the model's input "
         rf"embedding\), got values in \[{V}, "),
        (lambda d: (d[0], d[1], d[2] - 1, d[3]), ValueError,  # the padding ids 0 become -1
         rf"completion_ids must hold ids in \[0, {V}\) .* got values in \[-1, "),
        (lambda d: (d[0].float(), d[1], d[2], d[3]), TypeError, "prompt_ids must be an integer tensor of token ids"),
        (lambda d: (d[0].tolist(), d[1], d[2], d[3]), TypeError, "prompt_ids must be a torch.Tensor, got list"),
        (lambda d: (_meta(d[0]), d[1], d[2], d[3]), ValueError, "prompt_ids must hold data, got a meta tensor"),
        (lambda d: (d[0], d[1], _meta(d[2]), _meta(d[3])), ValueError,
         "completion_ids must hold data, got a meta tensor"),
        (lambda d: (d[0][:0], d[1][:0], d[2][:0], d[3][:0]), ValueError,
         r"shared_prefix_forward: prompt_ids must hold at least one prompt \(B >= 1\), got tensor of shape \(0, 4\)"),
    ],
    ids=["mask-half", "mask-two", "prompt-ids-past-V", "negative-completion-ids", "float-ids", "list", "meta-prompt",
         "meta-completion", "no-prompts"],
)
def test_bad_values_name_the_argument(change, error, match):
    model = build("llama")
    data = change(batch(B=2, G=3, P=4, T=3))
    with pytest.raises(error, match=match):
        shared_prefix_forward(model, *data, group_size=3)
    assert model.config._attn_implementation == "sdpa"  # checked before the switch


def test_a_model_that_is_not_a_transformers_model_is_refused():
    with pytest.raises(SharedPrefixUnsupported, match="shared_prefix_forward: model: expected a transformers "
                                                      "PreTrainedModel .* got Linear"):
        shared_prefix_forward(torch.nn.Linear(4, 4), *batch(B=1, G=2, P=3, T=2), group_size=2)


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = build("llama")
    with pytest.raises(ValueError, match="model must hold data, got its parameter model.embed_tokens.weight on the "
                                         "meta device; materialise the model first"):
        shared_prefix_forward(model, *batch(B=1, G=2, P=3, T=2), group_size=2)


def test_empty_completions_give_empty_hidden_states():
    """T = 0: ``[B*G, 0, H]`` like the unshared forward, not the prompt's last hidden state."""
    model = build("llama")
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(B=2, G=3, P=4, T=2)
    completion_ids, completion_mask = completion_ids[:, :0], completion_mask[:, :0]
    got = shared_prefix_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=3)
    want = unshared(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 3)
    assert got.shape == want.shape == (6, 0, SMALL["hidden_size"])
    assert got.dtype == want.dtype


@pytest.mark.parametrize("group_size", [0, 2.0, True])
def test_bad_group_size(group_size):
    with pytest.raises(ValueError, match="group_size: expected a positive int"):
        shared_prefix_forward(build("llama"), *batch(B=2, G=1, P=4, T=3), group_size=group_size)


def test_public_name_and_token_counts():
    assert grpo_fast.shared_prefix_forward is shared_prefix_forward
    unshared_tokens, shared_tokens = token_counts(prompt_len=100, completion_len=10, groups=2, group_size=16)
    assert (unshared_tokens, shared_tokens) == (2 * 16 * 110, 2 * (100 + 160))


# ----------------------------------------------------------------------------------------------------- trainer


def _train(tmp_path, steps: int, **overrides):
    from train_helpers import small_config

    from grpo_fast.train.trainer import setup, train_step

    run = setup(small_config(tmp_path, steps=steps, **overrides))
    start = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = [train_step(run) for _ in range(steps)]
    return run, start, metrics


def test_shared_and_unshared_training_runs_stay_together(tmp_path):
    options = dict(mu=2, **{"loss.beta": "0.04"})  # the old-policy and the reference passes share the prompt too
    run_on, start, on = _train(tmp_path / "on", 4, shared_prefix="on", **options)
    run_off, _, off = _train(tmp_path / "off", 4, shared_prefix="off", **options)
    for a, b in zip(on, off):
        assert a["reward"] == b["reward"]  # same samples: generation does not depend on the training forward
        assert a["forward_tokens"] < b["forward_tokens"] and a["prefix_saving"] > 2 and b["prefix_saving"] == 1.0
        # Not the tolerance rule: two float32 training runs of 4 steps, whose updates feed back into the next
        # step, have no float64 oracle (the trainer has no float64 mode); the forwards differ only in float32
        # summation order, so the bound is a few ulps of each metric grown over 4 steps (a masking or position
        # bug moves them by 1e-2 or more). The single-forward tests above compare with the rule.
        for key in ("loss", "kl", "entropy", "grad_norm", "clip_ratio_region"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in run_off.model.named_parameters())
    params_off = dict(run_off.model.named_parameters())
    gap = max(float((p.detach() - params_off[n].detach()).abs().max()) for n, p in run_on.model.named_parameters())
    assert moved > 1e-3
    assert gap < 1e-2 * moved  # float32 summation order only: the two runs follow one trajectory


def test_auto_mode_logs_its_decision_and_the_tokens_saved(tmp_path, caplog):
    caplog.set_level("INFO", logger="grpo_fast.train")
    _, _, metrics = _train(tmp_path, 1)  # small prompts, 3 new tokens, G=4: well over the 1.3x threshold
    line = next(r.getMessage() for r in caplog.records if "shared-prefix forward on at step 1" in r.getMessage())
    assert f"{int(metrics[0]['forward_tokens'])} tokens per training forward instead of" in line
    assert metrics[0]["prefix_saving"] >= 1.3


def test_auto_mode_stays_off_when_the_saving_is_small(tmp_path, caplog):
    caplog.set_level("INFO", logger="grpo_fast.train")
    # G=2 and completions longer than the prompts: G(P+T)/(P+GT) < 1.3
    _, _, metrics = _train(tmp_path, 1, group_size=2, micro_batch_size=4, max_new_tokens=24)
    assert metrics[0]["prefix_saving"] == 1.0
    assert any("shared-prefix forward off at step 1" in r.getMessage() for r in caplog.records)


def test_auto_mode_falls_back_with_one_warning(tmp_path, caplog):
    caplog.set_level("INFO", logger="grpo_fast.train")
    _, _, metrics = _train(tmp_path, 2, micro_batch_size=6)  # G=4: a micro-batch would split a group
    warnings_ = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings_ == ["shared-prefix forward off: micro_batch_size 6 is not a multiple of group_size 4 (a "
                         "micro-batch must hold whole groups)"]
    assert [m["prefix_saving"] for m in metrics] == [1.0, 1.0]


def test_on_mode_refuses_what_it_cannot_do(tmp_path):
    from train_helpers import small_config

    with pytest.raises(ValueError, match="micro_batch_size must be a multiple of group_size 4, got 6"):
        small_config(tmp_path, micro_batch_size=6, shared_prefix="on")
    with pytest.raises(ValueError, match="shared_prefix must be one of auto, on, off"):
        small_config(tmp_path, shared_prefix="yes")
    from grpo_fast.train.trainer import shared_prefix_allowed

    eager = build("llama", attn_implementation="eager")
    with pytest.raises(ValueError, match="TrainConfig.shared_prefix is 'on' but attention implementation 'eager'"):
        shared_prefix_allowed(small_config(tmp_path, shared_prefix="on"), [eager])
    assert shared_prefix_allowed(small_config(tmp_path), [eager]) is False  # auto: the warning, then unshared


# ------------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_cuda_bfloat16_within_the_tolerance_rule(monkeypatch, backend):
    """On the GPU in bfloat16, both backends (FlexAttention compiled, with its CUDA backward): hidden states and the
    lm_head and embedding gradients against the float64 unshared forward, by the tolerance rule."""
    monkeypatch.undo()  # transformers' own norms, as users run them
    data = [x.cuda() for x in batch(B=4, G=8, P=40, T=24)]
    mask = data[3].bool()
    advantages = torch.linspace(-1, 1, 32, device="cuda")

    def run(dtype, shared):
        model = build("qwen2", dtype).cuda()
        h = (shared_prefix_forward(model, *data, group_size=8, backend=backend) if shared
             else unshared(model, *data, 8))
        _, grads = loss_and_grads(model, h, data[2], data[3], advantages.to(dtype))
        return h, grads

    h_ref, g_ref = run(torch.float64, False)
    h_pt, g_pt = run(torch.bfloat16, False)
    h, g = run(torch.bfloat16, True)
    assert_close_rule(h[mask], h_pt[mask], h_ref[mask], torch.bfloat16, "hidden")
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert_close_rule(g[name], g_pt[name], g_ref[name], torch.bfloat16, name)
