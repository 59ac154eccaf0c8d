"""Rollout and training forward: the KV-cached sampler against plain full forwards of the same model."""

from __future__ import annotations

import pytest
import torch

from grpo_fast import fused_logprobs
from grpo_fast.train.forward import completion_hidden, head_of, position_ids_from_mask
from grpo_fast.train.rollout import SamplingParams, filter_logits, generate
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

PROMPTS = ["max 3 8 1=", "min 4 0 7 2 9=", "max 5 5 5 1="]  # uneven lengths: left padding is exercised


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return tiny_model(tok, seed=3).double()


def _encode(tok, prompts=PROMPTS):
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


def _full_logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits


def test_greedy_generation_equals_full_forward_decoding(model, tok):
    ids, mask = _encode(tok)
    ro = generate(model, ids, mask, 2, SamplingParams(max_new_tokens=6, temperature=0.0),
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # reference: no cache, the whole sequence recomputed each step, one row per prompt
    seq, seq_mask = ids.clone(), mask.clone()
    expected = []
    for _ in range(ro.completion_ids.shape[1]):
        nxt = _full_logits(model, seq, seq_mask)[:, -1].argmax(-1)
        expected.append(nxt)
        seq = torch.cat([seq, nxt[:, None]], 1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], 1)
    expected = torch.stack(expected, 1).repeat_interleave(2, dim=0)
    keep = ro.completion_mask.bool()
    assert torch.equal(ro.completion_ids[keep], expected[keep])
    assert torch.equal(ro.prompt_ids, ids.repeat_interleave(2, dim=0))


def test_sampling_logps_match_the_training_forward(model, tok):
    ids, mask = _encode(tok)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=8)
    ro = generate(model, ids, mask, 4, params, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  generator=gen)
    hidden = completion_hidden(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    head = head_of(model)
    logps = fused_logprobs(hidden, head.weight, ro.completion_ids, temperature=0.7, impl="reference")
    m = ro.completion_mask.bool()
    torch.testing.assert_close(ro.sampling_logps[m].double(), logps[m], atol=1e-6, rtol=0)
    assert (ro.sampling_logps[~m] == 0).all()


def test_completion_hidden_predicts_completion_tokens(model, tok):
    """hidden[:, t] through the lm_head equals the full model's logits at the position before token t."""
    ids, mask = _encode(tok)
    ro = generate(model, ids, mask, 2, SamplingParams(max_new_tokens=4), eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(1))
    hidden = completion_hidden(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    full = _full_logits(model, torch.cat([ro.prompt_ids, ro.completion_ids], 1),
                        torch.cat([ro.prompt_mask, ro.completion_mask], 1))
    P = ro.prompt_ids.shape[1]
    m = ro.completion_mask.bool()
    torch.testing.assert_close(model.lm_head(hidden)[m], full[:, P - 1 : -1][m], atol=1e-10, rtol=0)


def test_eos_stops_a_row_and_is_kept_in_the_mask(model, tok):
    """Uniform logits (zeroed lm_head): rows draw EOS at random steps; each must stop exactly at its first EOS."""
    ids, mask = _encode(tok)
    eos = tok.eos_token_id
    with torch.no_grad():
        saved = model.lm_head.weight.clone()
        model.lm_head.weight.zero_()
    try:
        ro = generate(model, ids, mask, 8, SamplingParams(max_new_tokens=6), eos_token_id=eos,
                      pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(2))
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
    for row, row_mask in zip(ro.completion_ids, ro.completion_mask):
        n = int(row_mask.sum())
        assert row_mask[:n].all() and not row_mask[n:].any()
        hit = (row[:n] == eos).nonzero()
        if n < ro.completion_ids.shape[1] or hit.numel():
            assert hit.numel() == 1 and int(hit[0]) == n - 1  # stopped exactly at its first EOS
        assert (row[n:] == tok.pad_token_id).all()


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    # top_p=0.8: 0.5 + 0.3 reaches it, the rest goes
    assert torch.isinf(filter_logits(logits, 0, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.01)).tolist() == [[False, True, True, True]]


def test_sampling_is_reproducible_with_a_seeded_generator(model, tok):
    ids, mask = _encode(tok)
    runs = [generate(model, ids, mask, 3, SamplingParams(max_new_tokens=4), eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].sampling_logps, runs[1].sampling_logps)


def test_prompt_chunks_concatenate_to_one_rollout(model, tok):
    """Generating the prompts in chunks gives the greedy completions of generating them together."""
    from grpo_fast.train.rollout import concat_rollouts

    ids, mask = _encode(tok)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    whole = generate(model, ids, mask, 2, params, **kw)
    parts = []
    for i in range(len(PROMPTS)):
        one_ids, one_mask = _encode(tok, PROMPTS[i : i + 1])
        parts.append(generate(model, one_ids, one_mask, 2, params, **kw))
    joined = concat_rollouts(parts, tok.pad_token_id)
    for name in ("prompt_ids", "prompt_mask", "completion_mask"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    keep = whole.completion_mask.bool()
    assert torch.equal(joined.completion_ids[keep], whole.completion_ids[keep])
    torch.testing.assert_close(joined.sampling_logps, whole.sampling_logps, atol=1e-9, rtol=0)


def test_the_cache_under_autocast_holds_the_autocast_dtype_and_samples_the_same(tok, monkeypatch):
    """float32 master weights under bf16 autocast: the rotary embedding makes float32 keys; the cache stores them in
    bf16 (a third less memory) and the sampled tokens and their log-probs do not change."""
    import grpo_fast.train.rollout as rollout_module
    from transformers import DynamicCache

    model = tiny_model(tok, seed=3)  # float32
    ids, mask = _encode(tok)
    params = SamplingParams(max_new_tokens=5, temperature=1.0)

    def sample():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate(model, ids, mask, 4, params, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = rollout_module.new_cache(torch.device("cpu"))
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{rollout_module._cache_keyword(model): cache})
    layer = cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.bfloat16
    cast = sample()
    monkeypatch.setattr(rollout_module, "new_cache", lambda device: DynamicCache())
    plain = sample()
    assert torch.equal(cast.completion_ids, plain.completion_ids)
    assert torch.equal(cast.sampling_logps, plain.sampling_logps)
