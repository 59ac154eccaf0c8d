"""Input validation at the public boundary (DESIGN.md §9): every error names the argument, what was expected and
what came. Value checks (finiteness, id ranges) read the data once; they are skipped while torch.compile traces."""

from __future__ import annotations

import math
import numbers

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
    if x.is_meta and not _tracing():
        raise ValueError(
            f"{fn}: {name} must hold data, got a meta tensor ({describe(x)}); materialise the model first "
            "(e.g. module.to_empty(device=...) and load its weights)"
        )
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


def is_real(value) -> bool:
    """A real number given as a Python int/float or a numpy scalar (``numbers.Real``); bools are not numbers here."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real_value(label: str, value, *, low=None, high=None, strict=False) -> float:
    """``value`` as a Python float after checking it is a finite real number in ``[low, high]`` (``(low, high]``
    with ``strict``); ``label`` names the argument in the message ("fn: name" or "Config.field")."""
    if not is_real(value):
        raise ValueError(f"{label} must be a finite number, got {describe(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{label} must be a finite number, got {value!r}")
    if low is not None and (number <= low if strict else number < low):
        raise ValueError(f"{label} must be {'>' if strict else '>='} {low}, got {value!r}")
    if high is not None and number > high:
        raise ValueError(f"{label} must be <= {high}, got {value!r}")
    return number


def check_positive_scalar(fn: str, name: str, value, optional=False) -> float | None:
    """A finite number > 0 (Python or numpy), returned as a Python float; None passes when ``optional``."""
    if value is None and optional:
        return None
    number = real_value(f"{fn}: {name}", value) if is_real(value) else math.nan
    if not number > 0:
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {value!r}")
    return number


def check_count(fn: str, name: str, value):
    """A token denominator such as ``num_items_in_batch``: None, or finite and > 0 whatever its type (Python or numpy
    number, 0-dim or one-element tensor). Returns None, a Python float or a detached 0-dim tensor.

    A number is checked on the host for free. A tensor is checked on the host too, which for a CUDA tensor is one
    device sync at the public boundary (the value checks of the other inputs already sync there, so the stream is
    drained and it costs no overlap); no check runs inside the ops, so they stay free of syncs. While torch.compile
    traces, the tensor's value is not checked (as with every value check here). Pass a Python number to avoid it.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex() or value.is_meta:
            raise ValueError(
                f"{fn}: {name} must be a finite number > 0 or a one-element real tensor, got {describe(value)}"
            )
        value = value.detach().reshape(())
        if not _tracing() and not bool(torch.isfinite(value) & (value > 0)):
            raise ValueError(f"{fn}: {name} must be finite and > 0, got {value.item()!r} ({describe(value)})")
        return value
    if not is_real(value):
        raise TypeError(f"{fn}: {name} must be a finite number > 0 or a one-element tensor, got {describe(value)}")
    number = real_value(f"{fn}: {name}", value)
    if not number > 0:
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {value!r}")
    return number


def check_constant(fn: str, name: str, x):
    """Refuse an input that requires grad but would get none: advantages, old/ref log-probs and sampling ratios are
    constants of the GRPO objective (TRL detaches them), so no implementation differentiates through them."""
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{fn}: {name} must not require grad ({describe(x)}, requires_grad=True): advantages, old_logps, "
            f"ref_logps and sampling_ratio are constants of the GRPO objective and get no gradient (TRL detaches "
            f"them too); pass {name}.detach()"
        )
