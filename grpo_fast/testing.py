"""The one tolerance rule every test uses (docs/design.md §5), and the one seeded builder of random loss inputs.

``err(out, out_ref) <= 2 * err(out_pt, out_ref) + ATOL[dtype]`` where ``out_ref`` is the float64 reference,
``out_pt`` the same reference run in the dtype under test and ``out`` the implementation under test. Errors are max
absolute differences. No per-test tolerances.
"""

from __future__ import annotations

import math

import torch

ATOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = (a.detach().double() - b.detach().double()).abs()
    nan_mismatch = torch.isnan(a.detach().double()) != torch.isnan(b.detach().double())
    if nan_mismatch.any():
        return float("inf")
    return float(torch.nan_to_num(diff, nan=0.0).max()) if diff.numel() else 0.0


def rule_error(out, out_pt, out_ref, dtype: torch.dtype) -> tuple[float, float, float]:
    """``(err, err_pt, bound)`` of the reference rule for one tensor; the rule holds when ``err <= bound``."""
    err_pt = max_abs_err(out_pt, out_ref)
    return max_abs_err(out, out_ref), err_pt, 2.0 * err_pt + ATOL[dtype]


def assert_close_rule(out, out_pt, out_ref, dtype: torch.dtype, name: str = "value") -> None:
    """Assert the reference rule for one tensor (or None on all three)."""
    if out is None or out_ref is None:
        if not (out is None and out_ref is None and out_pt is None):
            raise AssertionError(f"{name}: one side is None (out={out is None}, ref={out_ref is None})")
        return
    err, err_pt, bound = rule_error(out, out_pt, out_ref, dtype)
    if not err <= bound:
        raise AssertionError(
            f"{name}: error vs float64 reference {err:.3e} exceeds 2 * {err_pt:.3e} (PyTorch at {dtype}) "
            f"+ {ATOL[dtype]:.0e} = {bound:.3e}"
        )


def right_padded_mask(batch: int, seq: int, generator: torch.Generator, *, min_length: int = 1,
                      full_first_row: bool = False, empty_middle_row: bool = False, device="cpu",
                      dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """A ``[batch, seq]`` completion mask of right-padded rows whose lengths are uniform in ``[min_length, seq]``
    (one draw of ``generator``); row 0 full with ``full_first_row``, row ``batch // 2`` empty with
    ``empty_middle_row`` (when ``batch > 2``: a sequence with no completion token at all)."""
    lengths = torch.randint(min_length, seq + 1, (batch,), generator=generator, device=device)
    if full_first_row:
        lengths[0] = seq
    if empty_middle_row and batch > 2:
        lengths[batch // 2] = 0
    return (torch.arange(seq, device=device)[None, :] < lengths[:, None]).to(dtype)


def head_inputs(rows: tuple[int, ...], hidden_size: int, vocab: int, generator: torch.Generator, *, device="cpu",
                draw_dtype: torch.dtype = torch.float32, logit_scale: float = 1.0, bias_scale: float | None = None):
    """``(hidden [*rows, H], weight [V, H], bias [V] or None, target_ids [*rows])`` of a log-prob head, drawn from
    ``generator`` in this order: hidden ~ N(0, ``logit_scale``^2), weight ~ N(0, 1 / H) (logits of scale
    ``logit_scale``), bias ~ N(0, ``bias_scale``^2) (only with ``bias_scale``), uniform targets."""
    kw = dict(generator=generator, device=device, dtype=draw_dtype)
    hidden = torch.randn(*rows, hidden_size, **kw)
    if logit_scale != 1.0:
        hidden = hidden * logit_scale
    weight = torch.randn(vocab, hidden_size, **kw) / math.sqrt(hidden_size)
    bias = None if bias_scale is None else torch.randn(vocab, **kw) * bias_scale
    target_ids = torch.randint(0, vocab, rows, generator=generator, device=device)
    return hidden, weight, bias, target_ids


def upstream_grads(n: int, generator: torch.Generator, *, dead=(), no_logp_grad=(), no_entropy_grad=(),
                   dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream gradients ``(g, ge)`` of a log-prob backward, ``[n]`` each: g for the log-probs, ge for the entropy,
    ~ N(0, 1) drawn in ``dtype`` (g first), with exact zeros: rows ``dead`` in both (padding: no matmul work), rows
    ``no_logp_grad`` in g only and rows ``no_entropy_grad`` in ge only (each a sequence of row indices or a
    slice)."""
    g = torch.randn(n, generator=generator, dtype=dtype)
    ge = torch.randn(n, generator=generator, dtype=dtype)
    for rows, targets in ((dead, (g, ge)), (no_logp_grad, (g,)), (no_entropy_grad, (ge,))):
        rows = rows if isinstance(rows, slice) else torch.as_tensor(list(rows), dtype=torch.long)
        for x in targets:
            x[rows] = 0.0
    return g, ge


def loss_inputs(batch: int, seq: int, hidden_size: int, vocab: int, *, seed: int = 0, device="cpu",
                dtype: torch.dtype | None = None, draw_dtype: torch.dtype = torch.float32, min_length: int = 1,
                full_first_row: bool = False, empty_middle_row: bool = False, mask_dtype: torch.dtype = torch.bool,
                logit_scale: float = 1.0, bias_scale: float | None = None, advantages_per_token: bool = False,
                logps_center=None, logps_noise: float = 0.5, old_logps: bool = False, sampling: str | None = None,
                requires_grad: bool = False) -> dict:
    """Seeded random inputs of the loss head and the loss, the one builder of the doctor's self-check, the benchmarks,
    bench/micro and the tests: the head (``head_inputs``: hidden ``[B, T, H]``, weight ``[V, H]``, a bias ``[V]`` with
    ``bias_scale``, uniform ``target_ids [B, T]``), a ``completion_mask [B, T]`` (``right_padded_mask``),
    ``advantages`` ~ N(0, 1), ``[B]`` (``[B, T]`` with ``advantages_per_token``), ``ref_logps [B, T]`` (with
    ``old_logps``, also ``old_logps``) = ``logps_center`` + N(0, ``logps_noise``^2) and, with ``sampling`` "token" or
    "sequence", a ``sampling_ratio`` (``[B, T]`` or ``[B, 1]``) uniform in ``[0.5, 1.5)``.

    One generator seeded with ``seed`` on ``device`` draws everything, in this order: hidden, weight, bias,
    target_ids, lengths, advantages, old then reference log-probs, the sampling ratio. The same arguments give the
    same tensors in every process on the same device type, and the order is what the committed benchmark results
    were measured with: keep it. (Drawn on the device: a CPU draw of a large weight would cost seconds per process
    on a GPU machine.)

    Values are drawn in ``draw_dtype`` (float64: exact inputs for a float64 oracle, cast per implementation by the
    caller); hidden, weight and bias are then cast to ``dtype`` (default ``draw_dtype``) and, with ``requires_grad``,
    hidden and weight made leaves that require grad; advantages, log-probs and the ratio are float32.
    ``logps_center``: None for ``-log(V) - 0.5``, near what a random unit-scale policy gives a target, so that the k3
    KL term stays moderate; or a function ``(hidden, weight, target_ids, bias) -> [B, T]`` (the policy's own
    log-probs, e.g. ``grpo_fast.reference.logprobs_reference``, run without grad on the values as drawn), for
    importance ratios near 1 of which some clip. ``bias`` and ``sampling_ratio`` are keys only when drawn.
    """
    if sampling not in (None, "token", "sequence"):
        raise ValueError(f"loss_inputs: sampling must be None, 'token' or 'sequence', got {sampling!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    fkw = dict(generator=g, device=device, dtype=draw_dtype)
    hidden, weight, bias, target_ids = head_inputs((batch, seq), hidden_size, vocab, g, device=device,
                                                   draw_dtype=draw_dtype, logit_scale=logit_scale,
                                                   bias_scale=bias_scale)
    mask = right_padded_mask(batch, seq, g, min_length=min_length, full_first_row=full_first_row,
                             empty_middle_row=empty_middle_row, device=device, dtype=mask_dtype)
    if logps_center is None:
        center = -math.log(vocab) - 0.5
    else:
        with torch.no_grad():
            center = logps_center(hidden, weight, target_ids, bias)
    cast = dtype or draw_dtype
    x = {"hidden": hidden.to(cast), "weight": weight.to(cast), "target_ids": target_ids, "completion_mask": mask,
         "advantages": torch.randn((batch, seq) if advantages_per_token else (batch,), **fkw).float()}
    if bias is not None:
        x["bias"] = bias.to(cast)
    if requires_grad:
        x["hidden"].requires_grad_(True)
        x["weight"].requires_grad_(True)
    for name in ("old_logps", "ref_logps") if old_logps else ("ref_logps",):
        x[name] = (center + logps_noise * torch.randn(batch, seq, **fkw)).float()
    if sampling is not None:
        x["sampling_ratio"] = (torch.rand(batch, seq if sampling == "token" else 1, **fkw).float() + 0.5)
    return x
