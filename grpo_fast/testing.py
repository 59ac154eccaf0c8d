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


def loss_inputs(batch: int, seq: int, hidden_size: int, vocab: int, *, seed: int = 0, device="cpu",
                dtype: torch.dtype | None = None, draw_dtype: torch.dtype = torch.float32, min_length: int = 1,
                full_first_row: bool = False, mask_dtype: torch.dtype = torch.bool, logps_center=None,
                logps_noise: float = 0.5, old_logps: bool = False, requires_grad: bool = False) -> dict:
    """Seeded random inputs of the loss head and the loss, the one builder of the doctor's self-check, the benchmarks
    and bench/micro: hidden ``[B, T, H]`` ~ N(0, 1), weight ``[V, H]`` ~ N(0, 1 / H) (logits of unit scale),
    uniform ``target_ids [B, T]``, a ``completion_mask [B, T]`` whose lengths are uniform in ``[min_length, T]``
    (row 0 full with ``full_first_row``), ``advantages [B]`` ~ N(0, 1) and ``ref_logps [B, T]`` (with
    ``old_logps``, also ``old_logps``) = ``logps_center`` + N(0, ``logps_noise``^2).

    One generator seeded with ``seed`` on ``device`` draws everything, in this order: hidden, weight, target_ids,
    lengths, advantages, old then reference log-probs. The same arguments give the same tensors in every process on
    the same device type, and the order is what the committed benchmark results were measured with: keep it. (Drawn
    on the device: a CPU draw of a large weight would cost seconds per process on a GPU machine.)

    Values are drawn in ``draw_dtype`` (float64: exact inputs for a float64 oracle, cast per implementation by the
    caller); hidden and weight are then cast to ``dtype`` (default ``draw_dtype``) and, with ``requires_grad``, made
    leaves that require grad; advantages and log-probs are float32. ``logps_center``: None for ``-log(V) - 0.5``,
    near what a random unit-scale policy gives a target, so that the k3 KL term stays moderate; or a function
    ``(hidden, weight, target_ids) -> [B, T]`` (the policy's own log-probs, e.g. ``grpo_fast.reference``'s, run
    without grad on the values as drawn), for importance ratios near 1 of which some clip.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    fkw = dict(kw, dtype=draw_dtype)
    hidden = torch.randn(batch, seq, hidden_size, **fkw)
    weight = torch.randn(vocab, hidden_size, **fkw) / math.sqrt(hidden_size)
    target_ids = torch.randint(0, vocab, (batch, seq), **kw)
    lengths = torch.randint(min_length, seq + 1, (batch,), **kw)
    if full_first_row:
        lengths[0] = seq
    mask = (torch.arange(seq, device=device)[None, :] < lengths[:, None]).to(mask_dtype)
    if logps_center is None:
        center = -math.log(vocab) - 0.5
    else:
        with torch.no_grad():
            center = logps_center(hidden, weight, target_ids)
    x = {"hidden": hidden.to(dtype or draw_dtype), "weight": weight.to(dtype or draw_dtype), "target_ids": target_ids,
         "completion_mask": mask, "advantages": torch.randn(batch, **fkw).float()}
    if requires_grad:
        x["hidden"].requires_grad_(True)
        x["weight"].requires_grad_(True)
    for name in ("old_logps", "ref_logps") if old_logps else ("ref_logps",):
        x[name] = (center + logps_noise * torch.randn(batch, seq, **fkw)).float()
    return x
