"""The one resolver that picks an implementation for every op (DESIGN.md §6).

``auto`` means ``triton`` for CUDA tensors when the Triton path is available, ``torch`` elsewhere; ``reference`` is
only ever chosen explicitly. The choice is logged once per (op, impl, device type) at debug level.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger("grpo_fast")

IMPLS = ("auto", "triton", "torch", "reference")


def _probe_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_TRITON_AVAILABLE = _probe_triton()


def triton_available() -> bool:
    """True when triton imports (Linux); the kernels live in ``grpo_fast.kernels``."""
    return _TRITON_AVAILABLE


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _log_choice(op: str, impl: str, device_type: str) -> None:
    logger.debug("grpo_fast.%s: using impl=%r on %s", op, impl, device_type)


def resolve_impl(impl: str, device: torch.device, op: str, dtype: torch.dtype | None = None) -> str:
    """Turn ``impl`` (one of IMPLS) into the concrete implementation to run on ``device`` for ``dtype``.

    float64 always runs on the torch path under ``auto`` (the kernels compute in float32).
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "auto":
        use_triton = device.type == "cuda" and triton_available() and dtype != torch.float64
        impl = "triton" if use_triton else "torch"
    if impl == "triton" and dtype == torch.float64:
        raise ValueError(f"{op}: impl='triton' computes in float32 and takes float32, bfloat16 or float16 inputs, "
                         "got float64; use impl='torch' (or 'auto') for float64")
    if impl == "triton":
        if not triton_available():
            raise RuntimeError(f"{op}: impl='triton' requested but the Triton kernels are not available in this build")
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"{op}: impl='triton' needs CUDA tensors (got device {device}); set TRITON_INTERPRET=1 before "
                "importing triton to run the kernels on CPU through the interpreter, or use impl='torch'"
            )
    if not torch.compiler.is_compiling():
        _log_choice(op, impl, device.type)
    return impl
