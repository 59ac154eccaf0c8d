"""The one resolver that picks an implementation for every op (docs/design.md §6).

``auto`` means ``triton`` for CUDA tensors when the Triton path is available and the GPU is one the kernels are
compiled and gated for, ``torch`` elsewhere; ``reference`` is only ever chosen explicitly. float64 inputs of the ops
that multiply hidden states by the lm_head weight go to the torch path under ``auto`` (the log-prob kernels keep
their statistics in float32; the elementwise loss and advantage kernels run float64 as float64). float32 inputs stay
on the Triton path: its matmuls are cuBLAS GEMMs, which follow PyTorch's own TF32 switches like the user's other
float32 matmuls (``tf32_allowed`` reads them, for ``grpo-fast doctor``). The choice is logged once per (op, impl,
device type) at debug level.
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


# ops that multiply hidden states by the lm_head weight (cuBLAS GEMMs around the log-prob kernels)
MATMUL_OPS = ("fused_logprobs", "grpo_loss")


def tf32_allowed() -> bool:
    """Whether the user allowed TF32 for float32 matmuls on CUDA, by PyTorch's own switches (which cuBLAS follows):
    torch >= 2.9's ``torch.backends.cuda.matmul.fp32_precision`` ("tf32" / "ieee"; "none" defers to
    ``torch.backends.fp32_precision``), else the legacy ``allow_tf32`` and ``set_float32_matmul_precision``. Reading
    the legacy flag after the new API was used raises in torch 2.13, so the new one is read first."""
    for owner in (torch.backends.cuda.matmul, torch.backends):
        try:
            precision = getattr(owner, "fp32_precision", None)
        except RuntimeError:
            precision = None
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the new API was used, and said neither tf32 nor ieee
        return False


# GPU families whose every launch the static gate compiles and holds (bench/kernel_report.py): the keys of the
# log-prob launchers' configuration table; auto uses the kernels only on these (family_of)
GATED_FAMILIES = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "cdna")
_SM_FAMILIES = (80, 86, 89, 90, 100, 120)
_CDNA = ("gfx90a", "gfx942")


def family_of(backend: str, arch: int | str) -> str | None:
    """The launch-configuration family of a GPU target ("sm90", "cdna", ...), or None for one the kernels are not
    compiled and gated for (NVIDIA below sm_80: no bf16 tensor-core MMA; AMD other than CDNA2/CDNA3)."""
    if backend == "hip":
        return "cdna" if str(arch).split(":")[0] in _CDNA else None
    arch = int(arch)
    return None if arch < 80 else f"sm{max(k for k in _SM_FAMILIES if k <= arch)}"


@functools.lru_cache(maxsize=None)
def device_target(index: int) -> tuple[str, int | str, str]:
    """(backend, arch, name) of CUDA/ROCm device ``index``: arch is the capability as an int (90) or the gfx name."""
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        return "hip", props.gcnArchName.split(":")[0], props.name
    return "cuda", props.major * 10 + props.minor, props.name


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` ("cuda" alone: the current device)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def device_family(device: torch.device) -> str | None:
    return family_of(*device_target(device_index(device))[:2])


@functools.lru_cache(maxsize=None)
def fp32_accumulating_gemm(index: int) -> bool:
    """Whether torch runs, on CUDA device ``index``, a 16-bit GEMM that accumulates into an fp32 matrix in place
    (``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``, torch >= 2.8): the Triton log-prob path's d-hidden
    GEMM. Probed once per device with a 2 x 2 call (an unsupported combination raises)."""
    if "dtype_out" not in torch.ops.aten.addmm.overloads():
        return False
    try:
        acc = torch.zeros(2, 2, device=torch.device("cuda", index))
        ones = torch.ones(2, 2, dtype=torch.bfloat16, device=acc.device)
        torch.addmm(acc, ones, ones, out_dtype=torch.float32, out=acc)
        return bool((acc == 2).all())
    except (RuntimeError, TypeError):
        return False


def _no_fp32_gemm_reason() -> str:
    return (f"torch {torch.__version__} has no 16-bit GEMM accumulating into fp32 in place "
            "(torch.addmm(..., out_dtype=torch.float32), torch >= 2.8), which the Triton log-prob path needs")


def auto_impl(device: torch.device, op: str, dtype: torch.dtype | None) -> tuple[str, str]:
    """What ``auto`` picks for ``op`` on ``device`` for inputs of ``dtype``, and why (one short phrase)."""
    if device.type != "cuda":
        return "torch", f"{device.type} tensors"
    if not triton_available():
        return "torch", "triton is not installed"
    if dtype == torch.float64 and op in MATMUL_OPS:
        return "torch", "float64 (the log-prob kernels keep their statistics in float32)"
    if device_family(device) is None:
        backend, arch, name = device_target(device_index(device))
        return "torch", f"{name} ({backend} {arch}) is not a target the kernels are compiled and gated for"
    if op in MATMUL_OPS and dtype in (torch.bfloat16, torch.float16) and not fp32_accumulating_gemm(
            device_index(device)):
        return "torch", _no_fp32_gemm_reason()
    return "triton", "CUDA tensors"


def resolve_impl(impl: str, device: torch.device, op: str, dtype: torch.dtype | None = None) -> str:
    """Turn ``impl`` (one of IMPLS) into the concrete implementation to run on ``device`` for ``dtype``
    (see ``auto_impl`` for what ``auto`` picks)."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "auto":
        impl = auto_impl(device, op, dtype)[0]
    if impl == "triton" and dtype == torch.float64 and op in MATMUL_OPS:
        raise ValueError(f"{op}: impl='triton' computes in float32 and takes float32, bfloat16 or float16 inputs, "
                         "got float64; use impl='torch' (or 'auto') for float64")
    if (impl == "triton" and device.type == "cuda" and op in MATMUL_OPS and dtype in (torch.bfloat16, torch.float16)
            and not fp32_accumulating_gemm(device_index(device))):
        raise RuntimeError(f"{op}: impl='triton' cannot run here: {_no_fp32_gemm_reason()}; upgrade torch or use "
                           "impl='torch'")
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
