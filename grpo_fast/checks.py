"""Input validation at the public boundary (docs/design.md §9): every error names the argument, what was expected and
what came. Value checks (finiteness, ranges, id ranges) read the data once; they are skipped while torch.compile
traces."""

from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# The ops take their scalar options (clip ranges, temperatures, coefficients) as float32: a value beyond float32's
# range would become inf there (or, in torch.where, a RuntimeError in step 1), so the configs refuse it up front.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # 1.2e-38, the smallest normal float32 (GPUs flush below it)
# The smallest temperature: of sampling (--temperature), of the loss and fused_logprobs (the logits are divided by it)
# and of SAPO's gates. The logits z are divided by T in float32, so z / T overflows once T < |z| / 3.4e38 (T = 1e-40,
# a float32 subnormal, overflows for every |z| > 0.034); long before that the log-probs, of size |z| / T, outgrow the
# loss's exponentials: the KL term exp(ref - logp) overflows once a logit moves by 88 T between the policy and the
# reference. vLLM, one of the rollout engines, raises any temperature below 1e-2 to 1e-2 (with a warning): a smaller
# one would train on other log-probs than those sampled. SAPO's gate gives -4 sigmoid(tau (r - 1)) / tau * A, a
# constant 2 A / tau plus (r - 1) A: 4 / tau overflows float32 below tau = 1.2e-38, and its value is noise long before.
MIN_TEMPERATURE = 1e-2
TEMPERATURE_RANGE = f"[{MIN_TEMPERATURE:g}, {FLOAT32_MAX:.3g}]"


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    kind = type(x).__name__
    if type(x).__module__ == "numpy":  # numpy.bool is no bool, and says so only by its module
        kind = f"numpy.{kind}"
    return f"{kind} {x!r}"


def _tracing() -> bool:
    return torch.compiler.is_compiling()


def check_tensor(fn: str, name: str, x, *, shape=None, ndim=None, dtypes=None, device=None, like="hidden",
                 optional=False):
    """Type, shape (a tuple where None matches any size), ndim, dtype and device (that of the argument ``like``)
    of one argument."""
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
    allowed = ndim if isinstance(ndim, tuple) else (ndim,)
    if ndim is not None and x.dim() not in allowed:
        raise ValueError(f"{fn}: {name} must have {' or '.join(map(str, allowed))} dimensions, got {describe(x)}")
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
        raise ValueError(f"{fn}: {name} must be on {device} like {like}, got {describe(x)}")


# Log-probs are <= 0. Every producer of them we know (log_softmax in any dtype, TRL's selective_log_softmax,
# fused_logprobs, vLLM) forms z_y - logsumexp(z) from one set of logits, which rounds to <= 0 exactly; the slack is
# for one that takes the two from different float32 summations (a few ulps of |z|, ~1e-5 at |z| ~ 100). A log-prob
# accepted at +1e-3 moves a ratio by 0.1%, far inside any clip range, while a probability passed by mistake is
# refused at every token whose probability is above 0.1%.
LOGPROB_SLACK = 1e-3


def check_values(fn: str, name: str, x: torch.Tensor, where: torch.Tensor | None = None, *, low=-math.inf,
                 high=math.inf, expected: str = "finite", where_name: str = "completion_mask"):
    """``x`` finite and in ``[low, high]`` (only at positions where the bool ``where``, of x's shape, is True, when
    given). One min/max pass and one host sync, with no NaN test of its own: min/max propagate NaN. ``expected``
    describes the range in the message."""
    if x is None or _tracing() or x.numel() == 0:
        return
    # this reads whole lm_head weights: no temporaries without a mask; padding gets a value inside the range
    vals = x if where is None else x.masked_fill(~where, min(max(0.0, low), high))
    lo, hi = torch.aminmax(vals)
    if bool(torch.isfinite(lo) & torch.isfinite(hi) & (lo >= low) & (hi <= high)):
        return
    bad = ~(torch.isfinite(x) & (x >= low) & (x <= high))
    if where is not None:
        bad &= where
    shown = ", ".join(f"{v:.4g}" for v in x[bad][:3].tolist())
    at = "" if where is None else f" where {where_name} is 1"
    what = "NaN/inf value(s)" if expected == "finite" else "value(s) outside that"
    raise ValueError(f"{fn}: {name} must be {expected}{at}, got {int(bad.sum())} {what} ({shown}) in {describe(x)}")


def check_finite(fn: str, name: str, x: torch.Tensor, where: torch.Tensor | None = None):
    """No NaN/inf in ``x`` (only at positions where ``where`` is True, when given)."""
    check_values(fn, name, x, where)


def check_logprobs(fn: str, name: str, x: torch.Tensor, where: torch.Tensor | None):
    """Log-probabilities: finite and <= ``LOGPROB_SLACK`` where ``where`` is True (NaN refused too). Probabilities,
    or anything positive, would make every ratio and KL term wrong without an error."""
    check_values(fn, name, x, where, high=LOGPROB_SLACK,
                 expected=f"log-probabilities (finite and <= {LOGPROB_SLACK:g})")


def check_token_ids(fn: str, name: str, ids: torch.Tensor, vocab: int, rows: str = "the rows of weight"):
    """Ids in ``[0, vocab)``: one min/max pass and one host sync."""
    if _tracing() or ids.numel() == 0:
        return
    lo, hi = torch.stack(list(torch.aminmax(ids))).tolist()
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{fn}: {name} must hold ids in [0, {vocab}) ({rows}), got values in [{lo}, {hi}]")


def check_mask(fn: str, name: str, mask: torch.Tensor) -> torch.Tensor:
    """A {0, 1} mask of any dtype -> bool."""
    if mask.dtype == torch.bool:
        return mask
    if not _tracing() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{fn}: {name} must hold only 0 and 1, got other values in {describe(mask)}")
    return mask != 0


def check_completion_length(fn: str, max_len: int | None, mask: torch.Tensor):
    """dr_grpo divides by ``B * config.max_completion_length``: a token counted past the first ``max_len`` columns
    of ``mask [B, T]`` is a completion longer than that. Columns past it that are all padding (TRL's
    ``pad_to_multiple_of``) are fine; nothing is read when ``T <= max_len``."""
    T = mask.shape[1]
    if max_len is None or max_len >= T or _tracing():
        return
    if bool(mask[:, max_len:].any()):
        raise ValueError(
            f"{fn}: config.max_completion_length must be at least the longest completion, got {max_len} while "
            f"completion_mask counts tokens past its first {max_len} columns (T={T}); dr_grpo divides the loss by "
            "B * max_completion_length: set it to the generation limit (or None to use T)"
        )


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


def float32_value(label: str, value, *, low=None, high=None, strict=False) -> float:
    """``real_value`` of a scalar the ops take as float32: also within float32's range (``|value| <= 3.4e38``)."""
    number = real_value(label, value, low=low, high=high, strict=strict)
    if abs(number) > FLOAT32_MAX:
        raise ValueError(f"{label} must be within float32's range (|x| <= {FLOAT32_MAX:.3g}: the ops take it as a "
                         f"float32 scalar), got {value!r}")
    return number


LOGITS_TEMPERATURE = ("the logits are divided by it, and below 0.01 their float32 quotients overflow or outgrow the "
                      "loss's exponentials (vLLM samples at 0.01 there)")
SAPO_TEMPERATURE = ("the loss holds 4 / tau, whose constant part 2 A / tau swamps the value below 0.01 and overflows "
                    "float32 below 1.2e-38")


def temperature_value(label: str, value, reason: str = LOGITS_TEMPERATURE) -> float:
    """A temperature (sampling's, the loss's, fused_logprobs', a SAPO gate's) in ``TEMPERATURE_RANGE``: finite, at
    least ``MIN_TEMPERATURE`` (why: its comment) and a float32. ``label`` names it as the caller knows it; ``reason``
    says what a value below the floor breaks."""
    number = real_value(label, value)
    if number < MIN_TEMPERATURE * (1 - 2**-23):  # np.float32(0.01), 0.0099999998, is 0.01 too
        raise ValueError(f"{label} must be in {TEMPERATURE_RANGE}, got {value!r}: {reason}")
    if number > FLOAT32_MAX:
        raise ValueError(f"{label} must be in {TEMPERATURE_RANGE}, got {value!r}: the ops take it as a float32 scalar")
    return number


def check_bool(label: str, value) -> bool:
    """``value`` as a Python bool: a bool or a numpy bool (which is no ``bool`` subclass); anything else (1, "no")
    is refused rather than read as true or false."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{label} must be True or False, got {describe(value)}")


def _float_or_inf(value) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return math.inf if value > 0 else -math.inf


def real_vector(fn: str, name: str, value, size: int, *, dtype: torch.dtype, device, what: str) -> torch.Tensor:
    """``size`` finite numbers given as a list or tuple of Python or numpy numbers, a numpy array or a real tensor,
    as a ``[size]`` tensor of ``dtype`` on ``device``; ``what`` says what they are ("one per reward column")."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) >= 1:  # an array; a numpy scalar is refused
        value = value.tolist()
    if isinstance(value, torch.Tensor):
        ok = not (value.dtype == torch.bool or value.is_complex() or value.is_meta) and tuple(value.shape) == (size,)
    else:
        ok = isinstance(value, (list, tuple)) and len(value) == size and all(is_real(v) for v in value)
    if not ok:
        raise ValueError(f"{fn}: {name} must have {size} entries ({what}), finite numbers as a list, tuple or 1-d "
                         f"tensor; got {describe(value)}")
    if isinstance(value, torch.Tensor):
        tensor = value.to(device=device, dtype=dtype)
    else:
        tensor = torch.tensor([_float_or_inf(v) for v in value], dtype=dtype, device=device)
    check_finite(fn, name, tensor)
    return tensor


def check_positive_scalar(fn: str, name: str, value, optional=False) -> float | None:
    """A finite number > 0 (Python or numpy), returned as a Python float; None passes when ``optional``."""
    if value is None and optional:
        return None
    number = real_value(f"{fn}: {name}", value) if is_real(value) else math.nan
    if not number > 0:
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {value!r}")
    return number


def check_softcap(label: str, value) -> float | None:
    """None (off) or a softcap ``s`` of ``s * tanh(z / s)`` a float32 can hold as a divisor: a normal float32
    (``[1.2e-38, 3.4e38]``; a subnormal one is 0 on a GPU, and z / 0 is NaN)."""
    if value is None:
        return None
    number = real_value(label, value)
    if not FLOAT32_TINY <= number <= FLOAT32_MAX:
        raise ValueError(f"{label} must be in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}] (a normal float32: the logits "
                         f"are divided by it), got {value!r}")
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
