"""Which memory layout a 4-bit (bitsandbytes) base keeps: the one it trains in, and the CPU inference one only around
a generation.

On a CPU with AVX512-BF16, bitsandbytes >= 0.49's ``Linear4bit.forward`` repacks its weight the first time it runs in
eval mode without grad (``packing_format_for_cpu``): the nibbles are reordered for its fused bf16 kernel, the
double-quantized block scales are expanded and rounded to bf16, and from then on every forward of the layer goes
through that inference kernel. A training forward after it fails (``RuntimeError: a view of a leaf Variable that
requires grad is being used in an in-place operation``), and would have no backward to the input if it did not: the
inference kernel is outside bitsandbytes' autograd function. bitsandbytes' own way back
(``_convert_weight_packed_for_cpu_inverse``) quantizes the bf16 scales again, so a round trip changes the weights.

Here the trained model never repacks by itself (:func:`keep_training_layout`, at load), and the rollout engine may
ask for the inference layout around a generation (:func:`inference_layout`), which puts back afterwards exactly the
tensors the layers had: the nibble order is a permutation undone bit for bit, and the scales are the very tensors
kept aside (a few bytes per 64 weights), never re-quantized. Memory stays that of one 4-bit copy.

When: :func:`packed_generation` says. The inference kernel computes in bf16 (it casts its input and scales), so it
serves only runs whose compute dtype is bf16; a float32 run sampling through it would draw from a rounded policy, not
the one it trains. It needs the CPU instruction (bitsandbytes' ``has_avx512bf16``); without it the kernel would stop
the process with an illegal instruction.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch

logger = logging.getLogger("grpo_fast.train")

# the scale fields bitsandbytes' repacking replaces (nested: double quantization's state2 and offset)
_SCALE_FIELDS = ("absmax", "state2", "offset", "nested", "dtype")


def linear4bit_layers(model) -> list:
    """Every bitsandbytes ``Linear4bit`` in ``model``. No 4-bit layer exists before bitsandbytes is imported, and
    this does not import it (its import is slow and prints warnings on a CPU)."""
    if "bitsandbytes" not in sys.modules:
        return []
    from bitsandbytes.nn import Linear4bit

    return [m for m in model.modules() if isinstance(m, Linear4bit)]


def is_packed(layer) -> bool:
    """Whether ``layer``'s weight is in bitsandbytes' CPU inference layout."""
    return bool(getattr(getattr(layer.weight, "quant_state", None), "packing_format_for_cpu", False))


def keep_training_layout(model, what: str = "model") -> int:
    """Stops every 4-bit layer of ``model`` from repacking itself in an eval-mode forward without grad (the switch
    bitsandbytes sets per layer from the CPU's flags); returns how many layers there are. A layer that was already
    repacked is refused: its scales were rounded to bf16 and cannot be put back exactly."""
    layers = linear4bit_layers(model)
    packed = [layer for layer in layers if is_packed(layer)]
    if packed:
        raise ValueError(f"{what}: {len(packed)} of {len(layers)} 4-bit layers are already in bitsandbytes' CPU "
                         "inference layout (an eval-mode forward without grad ran on a CPU with AVX512-BF16), which "
                         "cannot train and whose scales were rounded to bf16: load the model again and train it "
                         "before any such forward")
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def cpu_has_avx512bf16() -> bool:
    """bitsandbytes' own test of the CPU flag its inference kernel needs (False without bitsandbytes)."""
    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16())


def packed_generation(model, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a generation on ``model`` should run in the CPU inference layout, and why (for the log)."""
    if not linear4bit_layers(model):
        return False, "no 4-bit layers"
    if device.type != "cpu":
        return False, f"on {device.type} bitsandbytes has no repacked layout"
    if dtype != torch.bfloat16:
        return False, (f"the run computes in {str(dtype).removeprefix('torch.')}; bitsandbytes' repacked CPU kernel "
                       "computes in bfloat16, which would sample from another policy than the one trained")
    if not cpu_has_avx512bf16():
        return False, "this CPU has no AVX512-BF16, which bitsandbytes' repacked kernel needs"
    return True, "bfloat16 on a CPU with AVX512-BF16: bitsandbytes' repacked inference kernel"


@contextlib.contextmanager
def inference_layout(model, enabled: bool = True):
    """Within the block, ``model``'s 4-bit layers are in bitsandbytes' CPU inference layout; on the way out (an
    exception included) they hold exactly the tensors they held before. ``enabled=False`` changes nothing."""
    if not enabled:
        yield
        return
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    kept = []
    try:
        for layer in linear4bit_layers(model):
            state = layer.weight.quant_state
            if is_packed(layer) or not _packable(state):
                continue
            kept.append((layer, {name: getattr(state, name, None) for name in _SCALE_FIELDS}))
            layer.weight.data, _ = _convert_weight_packed_for_cpu(layer.weight.data, state)
        yield
    finally:
        for layer, scales in reversed(kept):
            _restore(layer, scales)


def _packable(state) -> bool:
    """bitsandbytes' repacking takes ``[N, K]`` weights with N a multiple of 32 and K of the block size; a layer of
    another shape stays in the training layout (each layer's forward follows its own layout)."""
    n, k = state.shape
    return n % 32 == 0 and k % state.blocksize == 0


def _restore(layer, scales: dict) -> None:
    """The inverse of bitsandbytes' repacking for one layer: the nibbles back in their order, the scales put back
    as they were (bitsandbytes' own inverse would quantize the bf16 scales again)."""
    state = layer.weight.quant_state
    packed = layer.weight.data
    n, k_half = packed.shape
    low, high = packed.reshape(-1, 32) & 0xF, packed.reshape(-1, 32) >> 4  # rows 0-15 / 16-31 of a block of 32
    nibbles = torch.cat([low, high], dim=-1).reshape(n // 32, k_half, 32, 2).transpose(1, 2).reshape(-1)
    data = (nibbles[0::2] << 4) | nibbles[1::2]  # bitsandbytes' order: the even element in the high nibble
    data = data.reshape(state.original_qshape)
    storage = getattr(state, "original_storage_type", None)
    layer.weight.data = data.view(storage) if storage is not None else data
    for name, value in scales.items():
        if value is None and name == "state2":
            if hasattr(state, "state2"):
                delattr(state, "state2")
            continue
        setattr(state, name, value)
    state.packing_format_for_cpu = False
