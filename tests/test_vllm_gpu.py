"""The ``vllm`` engine's GPU options: bf16, gpu_memory_utilization, max_model_len and sleep mode (the engine's memory
handed to the policy update and taken back before generating). Skipped without CUDA or without vLLM for CUDA: no GPU
has run them yet (``bench/gpu_check.sh`` installs nothing, and a lent machine starts without vLLM)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
vllm = pytest.importorskip("vllm")

from test_vllm_engine import TOK, _perturb, _prompts, recomputed_logps  # noqa: E402

from grpo_fast.train.rollout import SamplingParams, generate  # noqa: E402
from grpo_fast.train.tasks import tiny_model  # noqa: E402
from grpo_fast.train.vllm_engine import VLLMEngine  # noqa: E402


def _engine(model, **kw):
    return VLLMEngine(model, dtype=kw.pop("dtype", torch.bfloat16), seed=0, max_model_len=64,
                      gpu_memory_utilization=kw.pop("gpu_memory_utilization", 0.2), **kw)


def _sample(engine, seed):
    pi, pm = _prompts()
    return engine.generate(pi.cuda(), pm.cuda(), 8, SamplingParams(6, 1.0), eos_token_id=TOK.eos_token_id,
                           pad_token_id=TOK.pad_token_id, seed=seed)


def test_bf16_engine_tracks_the_trainer_within_bf16_rounding():
    model = tiny_model(TOK, seed=0).cuda().eval()
    engine = _engine(model)
    try:
        _perturb(model.cpu(), seed=1)
        model.cuda()
        engine.update_weights(model)
        ro = _sample(engine, 0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            trainer = recomputed_logps(model, ro)
        assert (ro.sampling_logps - trainer).abs().max() < 0.1  # bf16 on both sides, different kernels
    finally:
        engine.close()


def test_fp32_greedy_equals_hf_on_cuda():
    model = tiny_model(TOK, seed=0).cuda().eval()
    engine = _engine(model, dtype=torch.float32)
    try:
        pi, pm = _prompts()
        params = SamplingParams(6, 0.0)
        v = engine.generate(pi.cuda(), pm.cuda(), 1, params, eos_token_id=TOK.eos_token_id,
                            pad_token_id=TOK.pad_token_id, seed=0)
        h = generate(model, pi.cuda(), pm.cuda(), 1, params, eos_token_id=TOK.eos_token_id,
                     pad_token_id=TOK.pad_token_id)
        assert torch.equal(v.completion_ids, h.completion_ids)
    finally:
        engine.close()


def test_sleep_mode_frees_memory_and_wakes_with_the_new_weights():
    model = tiny_model(TOK, seed=0).cuda().eval()
    engine = _engine(model, dtype=torch.float32, enable_sleep_mode=True)
    try:
        _sample(engine, 0)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free_awake  # the KV cache (and weights, level 2) handed back
        _perturb(model.cpu(), seed=2)
        model.cuda()
        engine.update_weights(model)  # wakes the weights first, then writes them
        ro = _sample(engine, 1)
        torch.testing.assert_close(ro.sampling_logps, recomputed_logps(model, ro), rtol=0, atol=1e-4)
    finally:
        engine.close()
