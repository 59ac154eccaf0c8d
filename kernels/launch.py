"""How every kernel in ``grpo_fast.kernels`` is launched: one function, so that a launch is data before it runs.

A launcher builds its arguments and calls ``launch(kernel, grid, *args, num_warps=..., num_stages=..., **constexprs)``.
Normally that launches the kernel on the device of its first tensor argument (a device guard: a tensor on ``cuda:1``
runs on ``cuda:1`` whatever the current device). Inside ``capture(target)`` it records a ``Launch`` instead and runs
nothing, and ``current_target(device)`` answers ``target``: the static GPU gate (``bench/kernel_report.py``) calls the
real launchers on meta tensors under a GPU target that this machine does not have, and compiles exactly what they
would launch there, through Triton's own specialisation rules.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Iterator

import torch

from grpo_fast.dispatch import device_index, device_target, family_of

_CAPTURE: contextvars.ContextVar[tuple[list, Any, int] | None] = contextvars.ContextVar("grpo_fast_capture",
                                                                                        default=None)
# SMs (CUs) a launcher assumes under the interpreter: few, so that small test shapes take the split paths too
INTERPRETER_SMS = 4


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)``."""

    kernel: Any  # a triton JITFunction (InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        """``module:function`` of the kernel."""
        fn = getattr(self.kernel, "fn", self.kernel)
        return f"{fn.__module__}:{fn.__qualname__}"


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU target: ``backend`` "cuda" (``arch`` the compute capability as an int, 90 for sm_90) or "hip" (``arch``
    the gfx name); ``warp_size`` 32 or 64. The same fields as ``triton.backends.compiler.GPUTarget``."""

    backend: str
    arch: int | str
    warp_size: int

    @property
    def family(self) -> str:
        """The key of the launch-configuration tables: "sm80", "sm86", "sm89", "sm90", "sm100", "sm120" (other
        capabilities from sm_80 up map to the nearest lower one) or "cdna" (gfx90a, gfx942)."""
        family = family_of(self.backend, self.arch)
        if family is None:
            raise RuntimeError(f"grpo_fast kernels: no launch configuration for {self.backend} {self.arch}; the "
                               "kernels are compiled and gated for sm_80 and later and for gfx90a/gfx942 "
                               "(impl='torch' runs everywhere)")
        return family


def launch(kernel, grid: tuple[int, ...], *args, num_warps: int, num_stages: int, **constexprs) -> None:
    """Launch ``kernel`` on the device of its first tensor argument, or record it inside ``capture``."""
    recorded = _CAPTURE.get()
    if recorded is not None:
        recorded[0].append(Launch(kernel, tuple(grid), args, constexprs, num_warps, num_stages))
        return
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)


@contextlib.contextmanager
def capture(target: Target, sms: int = 132) -> Iterator[list[Launch]]:
    """Record the launches made inside the block (nothing runs) as if the device were ``target`` with ``sms``
    streaming multiprocessors (compute units)."""
    token = _CAPTURE.set(([], target, sms))
    try:
        yield _CAPTURE.get()[0]
    finally:
        _CAPTURE.reset(token)


def capturing() -> bool:
    """Inside ``capture``: launchers choose as on the capture's target, even under the interpreter."""
    return _CAPTURE.get() is not None


def current_target(device: torch.device) -> Target:
    """The GPU target of ``device`` (the capture's target inside ``capture``). Under the interpreter, on a CPU
    tensor, a stand-in sm_90 target: the interpreter ignores launch configurations, only the tile sizes matter."""
    recorded = _CAPTURE.get()
    if recorded is not None:
        return recorded[1]
    if device.type != "cuda":
        return Target("cuda", 90, 32)
    backend, arch, _ = device_target(device_index(device))
    return Target(backend, arch, 64 if backend == "hip" and family_of(backend, arch) else 32)


def current_sms(device: torch.device) -> int:
    """Streaming multiprocessors (AMD: compute units) of ``device``: the capture's count inside ``capture``,
    ``INTERPRETER_SMS`` for a CPU tensor (the interpreter)."""
    recorded = _CAPTURE.get()
    if recorded is not None:
        return recorded[2]
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _sm_count(device_index(device))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
