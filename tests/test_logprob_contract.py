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
    @torch.compile(fullgraph=True, backend="eager")
    def key(x, temperature):
        return x * len(LogprobParams(temperature, 30.0, True).to_json())

    assert key(torch.ones(1), 0.7).item() == len(LogprobParams(0.7, 30.0, True).to_json())


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
    gradient not asked for and, for the rest, values within the tolerance rule of the torch backend run in float64
    (itself held to the float64 reference in test_logprobs_torch)."""
    from grpo_fast.dispatch import triton_interpreting
    from grpo_fast.ops import logprob_backend
    from grpo_fast.testing import assert_close_rule, head_inputs

    if impl == "triton" and not (torch.cuda.is_available() or triton_interpreting()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    head = head_inputs((9,), 16, 70, gen, draw_dtype=torch.float64, bias_scale=0.5)
    g, ge = upstream_grads(9, gen, dead=[4], no_logp_grad=[1], no_entropy_grad=[2])
    params = LogprobParams(0.8, 5.0, True)

    def run(name, dtype, need):
        backend = logprob_backend(name)
        hidden, weight, bias = (x.to(device, dtype) for x in head[:3])
        targets = head[3].to(device)
        logp, ent, m, log_s = backend.forward(hidden, weight, targets, bias, params)
        grads = BackwardInputs(SavedStats(m, log_s, ent), g.to(device, m.dtype), ge.to(device, m.dtype), *need)
        return [logp, ent, *backend.backward(hidden, weight, targets, bias, params, grads)]

    for need in ((True, True, True), (False, True, False), (True, False, True)):
        out, pt = run(impl, torch.float32, need), run("torch", torch.float32, need)
        ref = run("torch", torch.float64, need)
        assert [x is not None for x in out[2:]] == list(need)
        for name, a, b, c in zip(("logp", "entropy", "d hidden", "d weight", "d bias"), out, pt, ref):
            assert_close_rule(None if a is None else a.cpu(), None if b is None else b.cpu(),
                              None if c is None else c.cpu(), torch.float32, name)
