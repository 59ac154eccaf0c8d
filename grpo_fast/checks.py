"""Input validation at the public boundary (DESIGN.md §9): every error names the argument, what was expected and
what came. Value checks (finiteness, id ranges) read the data once; they are skipped while torch.compile traces."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__} {x!r}"


def _tracing() -> bool:
    return torch.compiler.is_compiling()


def check_tensor(fn: str, name: str, x, *, shape=None, ndim=None, dtypes=None, device=None, optional=False):
    """Type, shape (a tuple where None matches any size), ndim, dtype and device of one argument."""
    if x is None:
        if optional:
            return
        raise TypeError(f"{fn}: {name} is required, got None")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {describe(x)}")
    if ndim is not None and x.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{fn}: {name} must have {ndim} dimensions, got {describe(x)}")
    if shape is not None:
        ok = len(shape) == x.dim() and all(s is None or s == d for s, d in zip(shape, x.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{fn}: {name} must have shape {want}, got {describe(x)}")
    if dtypes == "float" and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: {name} must be float32, bfloat16, float16 or float64, got {describe(x)}")
    if dtypes == "int" and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
        raise TypeError(f"{fn}: {name} must be an integer tensor of token ids, got {describe(x)}")
    if device is not None and x.device != device:
        raise ValueError(f"{fn}: {name} must be on {device} like hidden, got {describe(x)}")


def check_finite(fn: str, name: str, x: torch.Tensor, where: torch.Tensor | None = None):
    """No NaN/inf in ``x`` (only at positions where ``where`` is True, when given)."""
    if x is None or _tracing() or x.numel() == 0:
        return
    if where is None:
        # one reduction pass and no temporaries (this reads whole lm_head weights); min/max propagate NaN
        lo, hi = torch.aminmax(x)
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return
        bad = ~torch.isfinite(x)
    else:
        bad = ~torch.isfinite(x) & where
        if not bool(bad.any()):
            return
    raise ValueError(f"{fn}: {name} must be finite, got {int(bad.sum())} NaN/inf value(s) in {describe(x)}")


def check_token_ids(fn: str, name: str, ids: torch.Tensor, vocab: int):
    if _tracing() or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{fn}: {name} must hold ids in [0, {vocab}) (the rows of weight), got values in [{lo}, {hi}]")


def check_mask(fn: str, name: str, mask: torch.Tensor) -> torch.Tensor:
    """A {0, 1} mask of any dtype -> bool."""
    if mask.dtype == torch.bool:
        return mask
    if not _tracing() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{fn}: {name} must hold only 0 and 1, got other values in {describe(mask)}")
    return mask != 0


def check_positive_scalar(fn: str, name: str, value, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {value!r}")
