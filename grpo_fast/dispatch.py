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


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when the Triton launchers can be imported (the kernels land with the Triton issue)."""
    try:
        import grpo_fast.kernels.launchers  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _log_choice(op: str, impl: str, device_type: str) -> None:
    logger.debug("grpo_fast.%s: using impl=%r on %s", op, impl, device_type)


def resolve_impl(impl: str, device: torch.device, op: str) -> str:
    """Turn ``impl`` (one of IMPLS) into the concrete implementation to run on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if device.type == "cuda" and triton_available() else "torch"
    if impl == "triton":
        if not triton_available():
            raise RuntimeError(f"{op}: impl='triton' requested but the Triton kernels are not available in this build")
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"{op}: impl='triton' needs CUDA tensors (got device {device}); set TRITON_INTERPRET=1 before "
                "importing triton to run the kernels on CPU through the interpreter, or use impl='torch'"
            )
    _log_choice(op, impl, device.type)
    return impl
