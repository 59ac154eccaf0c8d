"""A launch plan that is data: every GEMM, Triton kernel and torch op a launcher issues, recorded as it is issued.

A launcher (``grpo_fast.kernels.linear_logprobs``) issues its work through a ``Plan``: ``plan.gemm`` (cuBLAS through
``torch.mm``/``torch.addmm``), ``plan.kernel`` (a Triton launch through ``launch.launch``) and ``plan.torch_op``
(a copy, fill or reduction by torch), and takes its temporaries from ``plan.scratch`` and gives them back with
``plan.release``. Each call runs the work and appends a ``Step``: its kind, shape, matmul FLOPs and the bytes it
reads and writes at tensor granularity (every tensor it touches counted once). A Triton kernel's tensors come from
its own declaration (``traffic``, next to the kernel), a torch op's from its call. The plan also keeps the live and
peak bytes of its temporaries: memory beyond the inputs, the outputs and the gradients.

The cost model (``bench/cost_model.py``) runs the same launchers on meta tensors inside ``launch.capture(target)``:
torch ops on meta tensors only compute shapes, Triton launches are recorded instead of run, and the launchers choose
their configurations as on ``target``. So the plan the cost model prices is the plan a GPU runs, with no second
formula that could drift from it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from torch import Tensor

from grpo_fast.dispatch import device_index, fp32_accumulating_gemm
from grpo_fast.kernels.launch import launch


@dataclasses.dataclass(frozen=True)
class Step:
    """One launch of a plan. ``kind``: "gemm" (cuBLAS), "triton" or "torch" (an elementwise op, copy or
    reduction by PyTorch). ``shape``: ``(M, N, K)`` for a GEMM, the grid for a Triton kernel, the element count of
    the largest tensor for a torch op. ``flops``: matmul FLOPs (2MNK), 0 for memory-bound work."""

    kind: str
    name: str
    shape: tuple[int, ...]
    flops: int
    bytes_read: int
    bytes_written: int


def nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def out_dtype_gemm_supported(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` (a bf16/fp16 GEMM that accumulates into an fp32 matrix,
    cuBLAS's beta = 1) runs on ``device``: CUDA where ``dispatch.fp32_accumulating_gemm`` found it (torch >= 2.8),
    and meta, which stands for a GPU in the cost model and the static gate."""
    if device.type == "meta":
        return "dtype_out" in torch.ops.aten.addmm.overloads()
    return device.type == "cuda" and fp32_accumulating_gemm(device_index(device))


# id(kernel) -> (kernel, its traffic function): ``traffic`` fills it, ``Plan.kernel`` reads it
_TRAFFIC: dict[int, tuple[object, Callable]] = {}


def traffic(kernel):
    """Declares what a launch of ``kernel`` (a Triton kernel) reads and writes: decorates a function called with
    the launch's arguments (the positional ones, then the constexprs as keywords) that returns ``(reads, writes)``,
    the tensors it reads and the tensors it writes (a tensor updated in place in both; None entries count nothing).
    ``Plan.kernel`` records their bytes, so the description sits with the kernel, not at each call site."""
    def register(fn: Callable) -> Callable:
        _TRAFFIC[id(kernel)] = (kernel, fn)
        return fn

    return register


class Plan:
    """Runs a launcher's work and records it (see the module docstring)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self._scratch: dict[int, int] = {}

    # -------------------------------------------------------------------------------------------- temporaries
    def scratch(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> Tensor:
        """A temporary the launcher owns until ``release``: counted in ``live_bytes``/``peak_bytes``. ``zero``
        fills it (one more launch, recorded)."""
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        self._scratch[id(t)] = nbytes(t)
        self.live_bytes += nbytes(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if zero:
            self.torch_op("zero", lambda: t.zero_(), reads=(), writes=(t,))
        return t

    def release(self, *tensors: Tensor | None) -> None:
        for t in tensors:
            if t is not None:
                self.live_bytes -= self._scratch.pop(id(t))

    # -------------------------------------------------------------------------------------------- work
    def gemm(self, name: str, a: Tensor, b: Tensor, out: Tensor, *, accumulate: bool = False) -> None:
        """``out = a @ b`` (``out += a @ b`` with ``accumulate``) as one cuBLAS call writing into ``out``. A 16-bit
        product accumulated into a float32 ``out`` uses ``out_dtype`` (fp32 accumulation inside the GEMM, no
        rounded product, no second pass); on CPU (the interpreter tests) the operands are upcast instead, and on a
        CUDA torch without it this raises (``dispatch`` sends such machines to the torch path first)."""
        m, k = a.shape
        n = b.shape[1]
        if out.dtype == a.dtype:
            if accumulate:
                torch.addmm(out, a, b, out=out)
            else:
                torch.mm(a, b, out=out)
        elif out_dtype_gemm_supported(out.device):
            if accumulate:
                torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            else:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
        elif out.device.type == "cuda":  # dispatch keeps this case off the Triton path: never a silent fp32 copy
            raise RuntimeError("grpo_fast.kernels: this torch has no 16-bit GEMM accumulating into fp32 "
                               "(torch.addmm out_dtype, torch >= 2.8); use impl='torch'")
        elif accumulate:  # CPU (the interpreter tests): upcast copies
            out.addmm_(a.to(out.dtype), b.to(out.dtype))
        else:
            torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)
        read = nbytes(a) + nbytes(b) + (nbytes(out) if accumulate else 0)
        self.steps.append(Step("gemm", name, (m, n, k), 2 * m * n * k, read, nbytes(out)))

    def kernel(self, name: str, kernel, grid: tuple[int, ...], *args, num_warps: int, num_stages: int = 1,
               **constexprs) -> None:
        """A Triton launch (``launch.launch``: recorded instead of run inside ``launch.capture``); its bytes are what
        the kernel's ``traffic`` declaration says this launch reads and writes."""
        declared = _TRAFFIC.get(id(kernel))
        if declared is None or declared[0] is not kernel:
            raise LookupError(f"plan.kernel({name!r}): the kernel declares no traffic (decorate a function of its "
                              "arguments with grpo_fast.kernels.plan.traffic(kernel))")
        reads, writes = declared[1](*args, **constexprs)
        launch(kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        self.steps.append(Step("triton", name, tuple(grid), 0, sum(map(nbytes, reads)), sum(map(nbytes, writes))))

    def torch_op(self, name: str, fn: Callable[[], object], *, reads: Sequence[Tensor | None],
                 writes: Sequence[Tensor | None]):
        """An elementwise op, copy or reduction by torch (one launch); returns what ``fn`` returns."""
        result = fn()
        touched = [t for t in (*reads, *writes) if t is not None]
        shape = (max((t.numel() for t in touched), default=0),)
        self.steps.append(Step("torch", name, shape, 0, sum(map(nbytes, reads)), sum(map(nbytes, writes))))
        return result

    # -------------------------------------------------------------------------------------------- totals
    @property
    def launches(self) -> int:
        return len(self.steps)

    @property
    def flops(self) -> int:
        return sum(s.flops for s in self.steps)

    @property
    def hbm_bytes(self) -> int:
        return sum(s.bytes_read + s.bytes_written for s in self.steps)

    def extend(self, other: "Plan") -> "Plan":
        """This plan followed by ``other`` (a forward then its backward): steps concatenated, peak of the two (the
        forward's temporaries are released before the backward starts)."""
        merged = Plan()
        merged.steps = [*self.steps, *other.steps]
        merged.peak_bytes = max(self.peak_bytes, other.peak_bytes)
        return merged
