"""What ``grpo-fast doctor`` and the benchmarks in ``bench/`` share: the timers (``time_calls`` for repeated calls,
``PhaseTimer`` for the phases of a step that something else drives), the names of the machine and of the
installed distributions, and the Liger-Kernel baseline they compare with.

It lives in the package because the doctor is installed and ``bench/`` is not (the package never imports
``bench/``); ``bench.harness`` builds its measurements, CSV rows and process isolation on it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import time

import torch


def synchronize(device) -> None:
    """Wait until ``device`` has finished the work queued on it: CUDA kernels run asynchronously; elsewhere an op has
    finished when it returns, and this does nothing."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, *, device, reps: int, warmup: int = 0, setup=None) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn()``, after ``warmup`` untimed ones.

    ``setup()``, if given, runs untimed before every call, warm-up included (e.g. to drop the last call's gradients,
    so that each call allocates its own as a training step does). The device is synchronised before each call, so
    no earlier work is counted, and a call's time runs to the end of its device work: on CUDA by events recorded on
    the device's current stream around the call (host-side launch overhead shows as GPU idle time, as it does in
    training), elsewhere by ``time.perf_counter``. Medians and minima are the caller's to take.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"time_calls: need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    device = torch.device(device)
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        synchronize(device)
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            synchronize(device)
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return times


class PhaseTimer:
    """Milliseconds of named phases, one list per phase (``ms[name]``): ``with timer.phase(name): ...`` or
    ``start(name)`` ... ``stop(name)`` where a callback marks the ends (a trainer's step hooks). The device is
    synchronised at both ends, so a phase counts its own device work and no earlier work (the same clock as
    ``time_calls`` off CUDA: ``time.perf_counter``)."""

    def __init__(self, device="cpu", phases=()):
        self.device = torch.device(device)
        self.ms: dict[str, list[float]] = {p: [] for p in phases}
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        synchronize(self.device)
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        synchronize(self.device)
        if name not in self._started:
            raise RuntimeError(f"PhaseTimer.stop: phase {name!r} was not started (started: {sorted(self._started)})")
        self.ms.setdefault(name, []).append((time.perf_counter() - self._started.pop(name)) * 1e3)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.start(name)
        try:
            yield
        finally:  # a phase that raised still ends: the next start of it is not refused or mis-timed
            self.stop(name)


def dist_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device) -> str:
    """GPU name from torch, else the CPU model from /proc/cpuinfo (with the logical core count)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def liger_loss(config, compiled: bool = False):
    """Liger-Kernel's ``LigerFusedLinearGRPOLoss`` configured as ``config`` (a ``GRPOLossConfig``): the baseline the
    doctor and the benchmarks compare with. Every option Liger shares with GRPOLossConfig is passed explicitly, so a
    default of either side never decides (Liger's ``use_bias_correction_kl`` defaults to False, TRL's and ours to
    True)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # optional: only called when installed

    return LigerFusedLinearGRPOLoss(beta=config.beta, epsilon_low=config.epsilon, epsilon_high=config.eps_high,
                                    loss_type=config.loss_type.value, temperature=config.temperature,
                                    max_completion_length=config.max_completion_length,
                                    importance_sampling_level=config.importance_sampling_level,
                                    delta=config.delta, use_bias_correction_kl=config.use_bias_correction_kl,
                                    sapo_temperature_pos=config.sapo_temperature_pos,
                                    sapo_temperature_neg=config.sapo_temperature_neg,
                                    vespo_k_pos=config.vespo_k_pos, vespo_lambda_pos=config.vespo_lambda_pos,
                                    vespo_k_neg=config.vespo_k_neg, vespo_lambda_neg=config.vespo_lambda_neg,
                                    use_ref_model=config.beta != 0.0, compiled=compiled, chunk_size=1)
