"""The log-prob backends' contract: the options cross the custom ops as JSON and come back equal, in one type each;
the backward's inputs refuse an entropy gradient without the forward's entropy."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_fast.logprob_contract import BackwardInputs, LogprobParams, SavedStats
from grpo_fast.testing import upstream_grads


@pytest.mark.parametrize("params", [
    LogprobParams(),
    LogprobParams(0.7, 30.0, True, 300, 40, 12 * 2**20),
    LogprobParams(1e-7, 1.0 / 3.0, False, None, 17),
])
def test_params_round_trip_through_json(params):
    text = params.to_json()
    assert json.loads(text) == {"temperature": params.temperature, "softcap": params.softcap,
                                "return_entropy": params.return_entropy, "vocab_chunk": params.vocab_chunk,
                                "token_chunk": params.token_chunk, "budget": params.budget}
    assert LogprobParams.from_json(text) == params


def test_params_hold_one_type_per_option():
    """An int temperature or softcap becomes a float: the kernels they select do not depend on how it was typed."""
    params = LogprobParams(2, 30)
    assert type(params.temperature) is float and type(params.softcap) is float
    assert params.to_json() == LogprobParams(2.0, 30.0).to_json()


def test_params_to_json_traces_under_compile():
    """Made inside compiled code (as ``fused_logprobs`` makes it) from the options a compiled step closes over: each
    temperature gives its own exact string, with no graph break. (A recompile that turns a changed float into a
    symbolic one breaks the graph here, as the input checks of ``fused_logprobs`` already did.)"""
    for temperature in (0.7, 0.9, 1.0 / 3.0):
        torch._dynamo.reset()

        @torch.compile(fullgraph=True, backend="eager")
        def key(x):
            return x + 1, LogprobParams(temperature, 30.0, True).to_json()

        assert key(torch.ones(1))[1] == LogprobParams(temperature, 30.0, True).to_json()


@pytest.mark.parametrize("field,value,message", [
    ("temperature", 0.0, "temperature must be a finite number > 0, got 0.0"),
    ("temperature", float("inf"), "temperature must be a finite number, got inf"),
    ("softcap", float("nan"), "softcap must be a finite number, got nan"),
    ("vocab_chunk", 0, "vocab_chunk must be a positive integer or None, got 0"),
])
def test_params_refuse_what_their_json_cannot_carry(field, value, message):
    with pytest.raises(ValueError, match=message):
        LogprobParams(**{field: value})
    with pytest.raises(TypeError):
        LogprobParams(token_chunk=2.5)  # not an integer


def test_an_entropy_gradient_needs_the_saved_entropy():
    v = torch.zeros(3)
    BackwardInputs(SavedStats(v, v, v), v, v)
    with pytest.raises(ValueError, match="entropy gradient `ge` needs the forward's entropy"):
        BackwardInputs(SavedStats(v, v), v, v)


def test_both_backends_implement_the_same_signatures():
    """The contract's positional parameters, in order, on both backends (the GPU one adds keywords only)."""
    import inspect

    from grpo_fast import logprobs_torch
    from grpo_fast.kernels import linear_logprobs

    want = {"forward": ["hidden", "weight", "target_ids", "bias", "params"],
            "backward": ["hidden", "weight", "target_ids", "bias", "params", "grads"], "stats_dtype": ["dtype"]}
    for backend in (logprobs_torch, linear_logprobs):
        for name, names in want.items():
            parameters = inspect.signature(getattr(backend, name)).parameters.values()
            assert [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD] == names, (backend, name)
            assert all(p.kind is p.KEYWORD_ONLY for p in parameters if p.name not in names), (backend, name)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_backend_returns_what_the_backward_inputs_ask_for(impl):
    """Called directly (no custom op): the forward's statistics feed the backward, which returns None for every
    gradient not asked for and, for the rest, the float64 reference's within the tolerance rule."""
    from grpo_fast.dispatch import triton_interpreting
    from grpo_fast.ops import logprob_backend
    from grpo_fast.reference import logprobs_reference
    from grpo_fast.testing import assert_close_rule, head_inputs

    if impl == "triton" and not (torch.cuda.is_available() or triton_interpreting()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    head = head_inputs((9,), 16, 70, gen, draw_dtype=torch.float64, bias_scale=0.5)
    g, ge = upstream_grads(9, gen, dead=[4], no_logp_grad=[1], no_entropy_grad=[2])
    params = LogprobParams(0.8, 5.0, True)
    targets = head[3].to(device)

    def ours(dtype, need):
        backend = logprob_backend(impl)
        hidden, weight, bias = (x.to(device, dtype) for x in head[:3])
        logp, ent, m, log_s = backend.forward(hidden, weight, targets, bias, params)
        grads = BackwardInputs(SavedStats(m, log_s, ent), g.to(device, m.dtype), ge.to(device, m.dtype), *need)
        return [logp, ent, *backend.backward(hidden, weight, targets, bias, params, grads)]

    def reference(dtype, need):
        leaves = [x.to(device, dtype, copy=True).requires_grad_(want) for x, want in zip(head[:3], need)]
        logp, ent = logprobs_reference(*leaves[:2], targets, leaves[2], 0.8, 5.0, True)
        ((logp * g.to(device, logp.dtype)).sum() + (ent * ge.to(device, ent.dtype)).sum()).backward()
        return [logp.detach(), ent.detach(), *(x.grad for x in leaves)]

    for need in ((True, True, True), (False, True, False), (True, False, True)):
        out = ours(torch.float32, need)
        assert [x is not None for x in out[2:]] == list(need)
        pt, ref = reference(torch.float32, need), reference(torch.float64, need)
        for name, a, b, c in zip(("logp", "entropy", "d hidden", "d weight", "d bias"), out, pt, ref):
            assert_close_rule(*(None if x is None else x.cpu() for x in (a, b, c)), torch.float32, name)
