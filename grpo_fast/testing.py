"""The one tolerance rule every test uses (docs/design.md §5).

``err(out, out_ref) <= 2 * err(out_pt, out_ref) + ATOL[dtype]`` where ``out_ref`` is the float64 reference,
``out_pt`` the same reference run in the dtype under test and ``out`` the implementation under test. Errors are max
absolute differences. No per-test tolerances.
"""

from __future__ import annotations

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
