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
kept aside (a few bytes per 64 weights), never re-quantized, also when the repacking or the restore is interrupted
part-way (every layer goes back before the interrupt goes on). Memory stays that of one 4-bit copy.

When: :func:`packed_generation` says. The inference kernel computes in bf16 (it casts its input and its scales to
bf16), so it serves only runs whose compute dtype is bf16 (whose sampled log-probs it moves by bf16 rounding only); a
float32 run sampling through it would draw from a bf16-rounded policy, not the one it trains. It needs the CPU
instruction (bitsandbytes registers the kernel only where ``has_avx512bf16``; elsewhere its generic kernel would read
the repacked weight as if it were not). Before the first use, one layer is repacked and restored and compared byte for
byte (:func:`round_trip_exact`): a bitsandbytes whose private format changed is left in the training layout.
"""

from __future__ import annotations

import contextlib
import sys

import torch

# the scale fields bitsandbytes' repacking replaces (nested: double quantization's state2 and offset)
_SCALE_FIELDS = ("absmax", "state2", "offset", "nested", "dtype")
_MISSING = object()  # a field the state did not have


def quiet_cpu_kernel_message() -> None:
    """Leaves out bitsandbytes' one message that its optional CPU 4-bit kernel is missing (``Failed to load CPU
    gemm_4bit_forward from kernels-community``): peft imports bitsandbytes whenever it is installed (and
    transformers and TRL import peft), so it would show on every CPU run and TRL import, while only a 4-bit run on a
    CPU would use that kernel (docs/train.md, QLoRA). bitsandbytes' other messages still show. Idempotent; call it
    before bitsandbytes is imported."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_cpu_kernel_message)  # once: the same filter


def _not_cpu_kernel_message(record) -> bool:
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


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


def packed_generation(model, device: torch.device, dtype: torch.dtype) -> tuple[bool, str | None]:
    """Whether a generation on ``model`` should run in the CPU inference layout, and why (for the log; None when
    ``model`` has no 4-bit layer, so that there is nothing to say)."""
    layers = linear4bit_layers(model)
    if not layers:
        return False, None
    if device.type != "cpu":
        return False, f"on {device.type} bitsandbytes has no repacked layout"
    if dtype != torch.bfloat16:
        return False, (f"the run computes in {str(dtype).removeprefix('torch.')}; bitsandbytes' repacked CPU kernel "
                       "computes in bfloat16, which would sample from another policy than the one trained")
    if not cpu_has_avx512bf16():
        return False, "this CPU has no AVX512-BF16, which bitsandbytes' repacked kernel needs"
    packable = [layer for layer in layers if _packable(layer.weight.quant_state)]
    if not packable:
        return False, "no 4-bit layer has a shape bitsandbytes repacks (out features a multiple of 32)"
    if not round_trip_exact(packable[0]):
        return False, "this bitsandbytes repacks in a layout grpo-fast cannot undo exactly (its private format changed)"
    return True, (f"bfloat16 on a CPU with AVX512-BF16: bitsandbytes' repacked inference kernel, "
                  f"{len(packable)} of {len(layers)} 4-bit layers")


@contextlib.contextmanager
def inference_layout(model, enabled: bool = True):
    """Within the block, ``model``'s 4-bit layers are in bitsandbytes' CPU inference layout (those of a shape it
    repacks, and not already repacked by an enclosing block); on the way out, an exception included, they hold
    exactly the tensors they held before. ``enabled=False`` changes nothing."""
    if not enabled:
        yield
        return
    kept = _repack([layer for layer in linear4bit_layers(model)
                    if not is_packed(layer) and _packable(layer.weight.quant_state)])
    try:
        yield
    finally:
        _restore_all(kept)


def _repack(layers) -> list:
    """Repacks ``layers``; returns (layer, its scale fields as they were) for each. A failure part-way (an
    interrupt, memory) puts every layer back as it was before raising."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    kept = []
    try:
        for layer in layers:
            state = layer.weight.quant_state
            scales = _scales_of(state)
            try:
                # bitsandbytes changes the state in place and returns the new weight: on a failure the weight is
                # still the old one and only the state needs its fields back
                layer.weight.data, _ = _convert_weight_packed_for_cpu(layer.weight.data, state)
            except BaseException:
                _put_scales(state, scales)
                raise
            kept.append((layer, scales))
    except BaseException:
        _restore_all(kept)
        raise
    return kept


def _restore_all(kept) -> None:
    """Restores every layer of ``kept`` even if one fails, then raises the first failure."""
    failure = None
    for layer, scales in reversed(kept):
        try:
            _restore(layer, scales)
        except BaseException as e:  # the other layers still go back
            failure = failure or e
    if failure is not None:
        raise failure


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
    data = ((nibbles[0::2] << 4) | nibbles[1::2]).reshape(state.original_qshape)  # the even element: high nibble
    storage = getattr(state, "original_storage_type", None)
    layer.weight.data = data.view(storage) if storage is not None else data
    _put_scales(state, scales)


def _scales_of(state) -> dict:
    """The scale fields bitsandbytes' repacking replaces, as they are (:data:`_MISSING` for one the state lacks)."""
    return {name: getattr(state, name, _MISSING) for name in _SCALE_FIELDS}


def _put_scales(state, scales: dict) -> None:
    """Puts back what :func:`_scales_of` took, and marks the state as in the training layout."""
    for name, value in scales.items():
        if value is _MISSING:
            if hasattr(state, name):
                delattr(state, name)
        else:
            setattr(state, name, value)
    state.packing_format_for_cpu = False


def round_trip_exact(layer) -> bool:
    """Whether repacking ``layer`` and restoring it gives back its bytes and scale tensors: the check that this
    bitsandbytes repacks the way :func:`_restore` undoes (a private function of bitsandbytes' that may change). The
    layer is left as it was either way (repacking makes new tensors: the original weight is kept by reference)."""
    state = layer.weight.quant_state
    original = layer.weight.data
    scales = _scales_of(state)
    _restore_all(_repack([layer]))
    exact = (layer.weight.data.dtype == original.dtype and layer.weight.data.shape == original.shape
             and torch.equal(layer.weight.data.view(torch.uint8), original.view(torch.uint8))
             and all(getattr(state, name, _MISSING) is value for name, value in scales.items()))
    layer.weight.data = original
    _put_scales(state, scales)
    return exact
