"""The memory model of one training step: bytes by phase and component, from the parameter count and measured
coefficients.

The phases and components are those of ``bench/bench_memory.py`` and ``bench/memtrack.py`` (rollout, prepare,
forward, backward, optimizer; weights, gradients, optimizer, activations, logits, critic, kv_cache). For each phase
the model adds up what is alive at the phase's largest moment, and the step's peak is the largest phase:

  states      exact from the parameter count. Full fine-tuning: float32 master weights (4 B/param), AdamW (8 B/param),
              the frozen reference in the compute dtype; PPO adds the critic's weights and AdamW (12 B/param of decoder
              + value head). LoRA: the frozen base in the compute dtype, float32 adapters with their AdamW states
              (12 B per adapter parameter), no reference (it is the base with the adapters disabled)
  gradients   exact: 4 B per trained parameter (PPO: the critic's too, which its backward makes first)
  kv_cache    2 x layers x kv_heads x head_dim x rows x (P + T) x bytes per element, MEASURED per training mode (full
              fine-tuning under bf16 autocast: 3, the keys leave the rotary embedding in float32; LoRA's bf16 base:
              2); Gemma-2's sliding layers keep at most 4096 positions
  activations MEASURED per architecture and training mode (``DecoderBytes``): one and two decoder layers of the real
              widths, under the storage tracker at three lengths: what a training forward leaves for the backward,
              the forward's own peak and the backward's peak beyond it, per token, per S^2 (eager attention) and
              per layer. With activation checkpointing the forward leaves each layer's input and the backward
              recomputes one layer at a time; under bf16 autocast the float32 weights' bf16 copies stay cached until
              the forward ends
  logits      MEASURED per method: the most [N, V]-sized bytes alive at once in each phase of a small full step,
              per N x V (e.g. 3 fp32 copies in PPO's backward), times the projected N x V
  optimizer   the optimizer's states (``Training.optim``): AdamW's two float32 moments, or bitsandbytes' 8-bit ones
              (2 B per element and a float32 scale per 256-element block; tensors under 4096 elements and, in full
              fine-tuning, the embedding keep 32-bit states). Step temporaries: none for the fused and the 8-bit
              kernels (measured on CPU by bench/bench_qlora.py; analytic on CUDA); torch's unfused AdamW on CPU two
              copies of the largest trained parameter (measured), on CUDA one fp32 temporary per trained parameter
              (the foreach step; analytic)
  fused loss  the fused log-prob op's tiles and row buffers: on CPU its own chunk sizes; on CUDA the 64 MiB bound of
              docs/design.md §7 -- not measured

LoRA ranks other than the calibrated one (``calibration["lora_r"]``) add or remove, per target projection, token and
layer, the ``[S, r]`` output of ``lora_A`` that ``lora_B`` saves (compute-dtype bytes): analytic, checked by
``tests/test_memory.py`` at another rank.

QLoRA (``Training.load_in_4bit``): the decoder's linear weights in bitsandbytes' 4-bit layout, exact: half a byte
per weight, a scale per 64-weight block (with double quantization one byte, plus a float32 per 256 scales and the
code tables), everything else (embeddings, an untied lm_head, norms, biases) in the compute dtype. The activations
are LoRA's: bench/bench_qlora.py measured every phase's activations of a QLoRA step equal to LoRA's over a float
base (the 4-bit matmul saves what the float one saves). Analytic: the 4-bit matmul dequantizes its weight into a
compute-dtype temporary each time it runs (forward, backward, no-grad passes), so the moments inside the decoder
hold one dequantized weight of the largest projection.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from grpo_fast.memory.models import ModelShape

METHODS = {  # the bench's configurations, minus ppo_fused (a diagnostic, not a method people run)
    "ppo": dict(ppo=True, fused=False, shared=False),
    "grpo_reference": dict(ppo=False, fused=False, shared=False),
    "grpo_fused": dict(ppo=False, fused=True, shared=False),
    "grpo_shared": dict(ppo=False, fused=True, shared=True),
}
GEMMA2_WINDOW = 4096
MAX_COMPLETION = 65536  # the longest T the search tries
FUSED_CUDA_WORKSPACE = 64 * 2**20  # docs/design.md §7's bound on the Triton path's working memory


def calibration_path() -> Path:
    """The calibration shipped with the package (``grpo-fast fit --calibrate`` rewrites it in a checkout)."""
    return Path(str(resources.files("grpo_fast.memory").joinpath("calibration.json")))


CALIBRATION_KEYS = {"machine": str, "date": str, "lora_r": int, "decoder": dict, "step": dict}  # what fit reads


def load_calibration(path=None) -> dict:
    path = Path(path) if path is not None else calibration_path()
    if not path.exists():
        raise FileNotFoundError(f"--calibration: {path} does not exist; make it with grpo-fast fit --calibrate")
    try:
        calibration = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"--calibration: {path} is not valid JSON ({e}); make it with grpo-fast fit --calibrate") \
            from None
    if not isinstance(calibration, dict):
        raise ValueError(f"--calibration: {path} must hold a JSON object, got {type(calibration).__name__}")
    for key, kind in CALIBRATION_KEYS.items():
        if key not in calibration:
            raise ValueError(f"--calibration: {path} has no {key!r} entry (a calibration holds "
                             f"{', '.join(map(repr, CALIBRATION_KEYS))}); make it with grpo-fast fit --calibrate")
        if not isinstance(calibration[key], kind) or isinstance(calibration[key], bool):
            kind_name = {str: "string", int: "integer", dict: "object"}[kind]
            raise ValueError(f"--calibration: {path}: {key!r} must be a JSON {kind_name}, "
                             f"got {calibration[key]!r:.60}")
    return calibration


# --------------------------------------------------------------------------------------------------------------------
# How the policy is trained


def lora_targets() -> tuple[str, ...]:
    """The trainer's default ``lora_target_modules`` (the attention projections), read from ``TrainConfig``."""
    from grpo_fast.train.config import TrainConfig

    return tuple(TrainConfig().lora_target_modules)


def optimizers() -> tuple[str, ...]:
    """The trainer's ``--optim`` names (``grpo_fast.train.config.OPTIMIZERS``; the first is its default)."""
    from grpo_fast.train.config import OPTIMIZERS

    return OPTIMIZERS


DEFAULT_OPTIM = "adamw_torch_fused"  # the trainer's (TRL's) default
EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")


@dataclass(frozen=True)
class Training:
    """How the policy is trained, as ``grpo-fast train`` sets it up. ``lora_r`` > 0: rank-r LoRA adapters on the
    trainer's default target modules, the frozen base stored in the compute dtype, the reference = the base with
    the adapters disabled; ``checkpointing``: transformers' activation checkpointing of every decoder layer;
    ``load_in_4bit``: the base's decoder linear layers in 4 bits (QLoRA; ``double_quant``: their scales too);
    ``optim``: the trainer's ``--optim``."""

    lora_r: int = 0
    checkpointing: bool = False
    load_in_4bit: bool = False
    double_quant: bool = True
    optim: str = DEFAULT_OPTIM

    def __post_init__(self):
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise ValueError(f"--lora-r: expected an integer >= 0 (0: full fine-tuning), got {self.lora_r!r}")
        if self.optim not in optimizers():
            raise ValueError(f"--optim: expected one of {', '.join(optimizers())}, got {self.optim!r}")
        if self.load_in_4bit and not self.lora_r:
            raise ValueError("--load-in-4bit needs LoRA (the 4-bit base is frozen and only adapters train on it): "
                             f"pass --lora-r R > 0, got {self.lora_r}")

    @property
    def mode(self) -> str:
        """The calibration's key: full, full_ckpt, lora, lora_ckpt (QLoRA's activations are LoRA's)."""
        return ("lora" if self.lora_r else "full") + ("_ckpt" if self.checkpointing else "")

    def describe(self) -> str:
        what = (f"{'QLoRA' if self.load_in_4bit else 'LoRA'} r={self.lora_r} on {', '.join(lora_targets())}"
                + (" over a 4-bit base" if self.load_in_4bit else "")) if self.lora_r else "full fine-tuning"
        what += " + activation checkpointing" if self.checkpointing else ""
        return what + (f", {self.optim}" if self.optim != DEFAULT_OPTIM else "")

    def methods(self) -> list[str]:
        """PPO is modelled (and measured) for full fine-tuning without checkpointing, with the default optimizer,
        only: the baseline."""
        return [m for m in METHODS if not (METHODS[m]["ppo"] and self != Training())]


MODES = ("full", "full_ckpt", "lora", "lora_ckpt")


def trained_params(shape: ModelShape, training: Training) -> int:
    return shape.lora_params(training.lora_r, lora_targets()) if training.lora_r else shape.num_params()


def critic_params(shape: ModelShape) -> int:
    """PPO's critic: the decoder (no lm_head) and a scalar value head."""
    untied_head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return shape.num_params() - untied_head + shape.hidden_size


def quantized_linears(shape: ModelShape) -> list[int]:
    """The element counts of the weights a 4-bit base stores in 4 bits: every decoder projection of every layer
    (transformers leaves the embeddings and the lm_head unquantized)."""
    return [i * o for i, o in shape.linear_shapes().values()] * shape.num_hidden_layers


BNB_BLOCK, BNB_NESTED_BLOCK, BNB_CODE = 64, 256, 16  # bitsandbytes' 4-bit blocks, nested blocks, NF4/FP4 code


def bytes_4bit(n: int, double_quant: bool) -> float:
    """One ``n``-element weight in bitsandbytes' 4-bit layout: packed values, the blocks' scales (double
    quantization: uint8 plus a float32 per 256 of them, an offset and the 256-entry code) and the 16-entry code."""
    blocks = math.ceil(n / BNB_BLOCK)
    if double_quant:
        scales = blocks + 4.0 * math.ceil(blocks / BNB_NESTED_BLOCK) + 4.0 * (BNB_NESTED_BLOCK + 1)
    else:
        scales = 4.0 * blocks
    return n / 2 + scales + 4.0 * BNB_CODE


def trained_tensors(shape: ModelShape, training: Training) -> list[tuple[int, bool]]:
    """``(elements, is_embedding)`` of every trained tensor: the LoRA matrices, or every parameter of the model."""
    L, H = shape.num_hidden_layers, shape.hidden_size
    linears = shape.linear_shapes()
    if training.lora_r:
        r = training.lora_r
        return [(n, False) for t in lora_targets() for n in (r * linears[t][0], linears[t][1] * r)] * L
    q_out, kv_out = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = [i * o for i, o in linears.values()] + [H] * shape.norms_per_layer
    layer += [q_out, kv_out, kv_out] if shape.attention_bias else []
    layer += [shape.head_dim] * 2 if shape.qk_norm else []
    head = [] if shape.tie_word_embeddings else [(shape.vocab_size * H, False)]
    return [(shape.vocab_size * H, True), *head, *((n, False) for n in layer * L), (H, False)]


EIGHT_BIT_MIN, EIGHT_BIT_BLOCK = 4096, 256  # bitsandbytes' min_8bit_size and its optimizers' block


def optimizer_state_bytes(shape: ModelShape, training: Training) -> float:
    """The optimizer's states: two float32 moments per trained element, or for 8-bit AdamW one byte each and a
    float32 scale per 256-element block of each moment, and the two 256-entry quantization maps they share (tensors
    under 4096 elements, and the embedding, which transformers' override keeps at 32 bits, stay float32)."""
    tensors = trained_tensors(shape, training)
    if training.optim not in EIGHT_BIT:
        return 8.0 * sum(n for n, _ in tensors)
    eight_bit = [n for n, embedding in tensors if n >= EIGHT_BIT_MIN and not embedding]
    maps = 2 * 4.0 * EIGHT_BIT_BLOCK if eight_bit else 0.0
    return (sum(2.0 * n + 8.0 * math.ceil(n / EIGHT_BIT_BLOCK) for n in eight_bit) + maps
            + 8.0 * sum(n for n, embedding in tensors if n < EIGHT_BIT_MIN or embedding))


def states_bytes(method: str, shape: ModelShape, compute_bytes: int, training: Training = Training()) -> dict:
    """Weights, optimizer states and PPO's critic: what every phase holds."""
    psi, trained = shape.num_params(), trained_params(shape, training)
    if training.load_in_4bit:  # the decoder's projections in 4 bits, the rest in the compute dtype
        quantized = quantized_linears(shape)
        weights = (sum(bytes_4bit(n, training.double_quant) for n in quantized)
                   + compute_bytes * (psi - sum(quantized)) + 4.0 * trained)
    elif training.lora_r:  # the frozen base in the compute dtype, float32 adapters; the reference is the base
        weights = compute_bytes * psi + 4.0 * trained
    else:  # float32 master weights and the frozen reference in the compute dtype
        weights = 4.0 * psi + compute_bytes * psi
    critic = 12.0 * critic_params(shape) if METHODS[method]["ppo"] else 0.0
    return dict(weights=weights, optimizer=optimizer_state_bytes(shape, training), critic=critic)


# --------------------------------------------------------------------------------------------------------------------
# Measured coefficients


@dataclass(frozen=True)
class Bytes:
    """``rows * (token * S + quad * S**2) + const`` bytes for ``rows`` rows of ``S`` tokens (``quad``: eager
    attention's S x S tensors, none under flash attention)."""

    token: float = 0.0
    quad: float = 0.0
    const: float = 0.0

    def __call__(self, rows: int, length: int, flash: bool = False) -> float:
        quad = 0.0 if flash else self.quad * length**2
        return rows * (self.token * length + quad) + self.const


@dataclass(frozen=True)
class DecoderBytes:
    """Measured activation bytes of one architecture's decoder in one compute dtype and training mode.

    ``layer`` and ``outside``: what a training forward leaves alive for the backward, per decoder layer and in the
    rest (embedding, final norm, the output); ``forward_layer`` and ``forward_outside``: the same at the forward's own
    peak (with checkpointing: the layer inputs, autocast's cached weight copies, the running layer); ``backward``:
    the backward's peak through the decoder beyond what the forward left (activation gradients in flight;
    checkpointing: one layer's recomputed activations); ``nograd``: a no-grad forward's bytes per token beyond its
    output at its peak (the reference and value passes)."""

    layer: Bytes
    outside: Bytes
    forward_layer: Bytes
    forward_outside: Bytes
    backward: Bytes
    nograd: float

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderBytes":
        return cls(**{k: Bytes(**v) if isinstance(v, dict) else v for k, v in d.items()})

    def saved(self, rows: int, length: int, layers: int, flash: bool) -> float:
        return layers * self.layer(rows, length, flash) + self.outside(rows, length, flash)

    def forward_peak(self, rows: int, length: int, layers: int, flash: bool) -> float:
        return layers * self.forward_layer(rows, length, flash) + self.forward_outside(rows, length, flash)


@dataclass(frozen=True)
class StepBytes:
    """Measured logits of one method's step, in one compute dtype and training mode: the most ``[*, V]``-sized bytes
    alive at once in the rollout (per row x V), the prepare, forward and backward phases (per N x V, N = completion
    tokens), and those alive when the backward starts (``saved``, per N x V); the KV cache's bytes per element; for
    fused methods the fused op's working memory by phase, in fp32 tiles."""

    rollout: float
    prepare: float
    forward: float
    saved: float
    backward: float
    kv: float  # bytes per cached key or value element (full fine-tuning under autocast: 3 = (4 + 2) / 2)
    tiles: dict


def coefficients(calibration: dict, model: str, method: str, dtype: str,
                 training: Training = Training()) -> tuple[DecoderBytes, StepBytes]:
    mode = training.mode
    try:
        decoder = DecoderBytes.from_dict(calibration["decoder"][dtype][mode][model])
    except KeyError:
        raise KeyError(f"the calibration has no {dtype} {mode} decoder measurement of {model!r}; run grpo-fast fit "
                       f"--calibrate --model {model}") from None
    base = "grpo_fused" if method == "grpo_shared" else method
    try:
        step = StepBytes(**calibration["step"][dtype][mode][base])
    except KeyError:
        raise KeyError(f"the calibration has no {dtype} {mode} step measurement of {base}; run grpo-fast fit "
                       "--calibrate") from None
    return decoder, step


# --------------------------------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class Step:
    """One training step's sizes: B prompts of P tokens, G completions of T tokens each."""

    prompts: int
    group_size: int
    prompt_len: int
    completion_len: int

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size


def adam_temporaries(shape: ModelShape, trained: int, device: str, training: Training = Training()) -> float:
    if training.optim != "adamw_torch":  # fused and 8-bit kernels update in place (CPU: measured; CUDA: analytic)
        return 0.0
    if device == "cuda":
        return 4.0 * trained  # foreach AdamW: one fp32 temporary per trained parameter (analytic)
    if training.lora_r:  # single-tensor AdamW: two temporaries of the largest adapter matrix
        shapes = shape.linear_shapes()
        return 2 * 4.0 * training.lora_r * max(max(shapes[t]) for t in lora_targets())
    largest = max(shape.vocab_size, shape.intermediate_size) * shape.hidden_size  # the embedding or an MLP matrix
    return 2 * 4.0 * largest


def fused_tile_bytes(tokens: int, shape: ModelShape) -> int:
    """One fp32 ``[token_chunk, vocab_chunk]`` tile of the fused log-prob op's torch path (its chunk sizes at the
    default temporaries budget)."""
    from grpo_fast.kernels.logprob_layout import DEFAULT_SCRATCH_BYTES, torch_chunks

    t, c = torch_chunks(tokens, shape.vocab_size, shape.hidden_size, DEFAULT_SCRATCH_BYTES)
    return t * c * 4


def fused_workspace(tiles: dict, phase: str, tokens: int, shape: ModelShape, device: str) -> float:
    """The fused log-prob op's working memory: measured tiles on CPU; on CUDA the 64 MiB bound of docs/design.md §7."""
    if device == "cuda":
        return FUSED_CUDA_WORKSPACE
    return tiles[phase] * fused_tile_bytes(tokens, shape)


def kv_cache_bytes(shape: ModelShape, rows: int, length: int, element_bytes: float) -> float:
    per_position = 2 * shape.num_key_value_heads * shape.head_dim * element_bytes * rows
    if shape.name.startswith("gemma-2-"):  # every other layer is a sliding window
        full, sliding = math.ceil(shape.num_hidden_layers / 2), shape.num_hidden_layers // 2
        return per_position * (full * length + sliding * min(length, GEMMA2_WINDOW))
    return per_position * shape.num_hidden_layers * length


def largest(*moments: dict) -> dict:
    return max(moments, key=lambda d: sum(d.values()))


def project(method: str, shape: ModelShape, step: Step, decoder: DecoderBytes, logits: StepBytes, *,
            compute_bytes: int, device: str, training: Training = Training(),
            calibrated_lora_r: int = 16) -> dict[str, dict[str, float]]:
    """Bytes by phase and component (the tracker's categories) of one step of ``method``; ``decoder`` and
    ``logits`` measured in ``training.mode`` (LoRA at rank ``calibrated_lora_r``)."""
    m = METHODS[method]
    if method not in training.methods():
        raise ValueError(f"{method}: modelled for full fine-tuning without activation checkpointing only")
    H, V, L = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers
    trained, psi_critic = trained_params(shape, training), critic_params(shape)
    R, P, T = step.rows, step.prompt_len, step.completion_len
    S, N = P + T, R * T
    flash, bf16, ckpt, lora = device == "cuda", compute_bytes != 4, training.checkpointing, bool(training.lora_r)
    states = states_bytes(method, shape, compute_bytes, training)

    if m["shared"]:  # one row per group: [prompt | c_1 .. c_G]; linear terms count tokens, the S^2 term per row
        rows, length, tokens = step.prompts, P + step.group_size * T, step.prompts * P + R * T
    else:
        rows, length, tokens = R, S, R * S
    saved = decoder.saved(rows, length, L, flash)  # what the backward will use
    forward_peak = decoder.forward_peak(rows, length, L, flash)
    backward = decoder.backward(rows, length, flash)  # beyond `saved`, while the backward runs through the decoder
    per_layer = 0.0  # what each layer's forward makes beyond the measured decoder, saved unless checkpointed
    if m["shared"]:
        # the SDPA backend's per-completion copies of the prompt's keys and values, of the completions' queries and
        # its output, which SDPA saves in the compute dtype (FlexAttention would need none: an upper bound there)
        q_dim, kv_dim = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
        per_layer += (2 * kv_dim * R * S + 2 * q_dim * N) * compute_bytes
    if lora and training.lora_r != calibrated_lora_r:  # lora_A's [S, r] outputs, saved for lora_B's backward
        per_layer += len(lora_targets()) * (training.lora_r - calibrated_lora_r) * tokens * compute_bytes
    inside = [forward_peak]  # moments inside the decoder's forward
    if ckpt:  # made and dropped inside one layer's attention (not with its MLP's peak); again in the recompute
        inside.append(saved + per_layer)
        backward += per_layer
    else:
        saved += L * per_layer
        inside = [forward_peak + L * per_layer]

    # a 4-bit matmul's dequantized weight, alive inside the decoder while the largest projection runs
    dequant = compute_bytes * max(i * o for i, o in shape.linear_shapes().values()) if training.load_in_4bit else 0.0
    inside = [moment + dequant for moment in inside]
    head_trained = not lora
    head_copy = V * H * compute_bytes if bf16 and head_trained else 0.0  # the loss's lm_head weight, cast
    autocast_copies = compute_bytes * trained if bf16 else 0.0  # generate runs under one autocast region
    ws = {p: fused_workspace(logits.tiles, p, N, shape, device) if m["fused"] else 0.0
          for p in ("prepare", "forward", "backward")}
    hidden = tokens * H * compute_bytes  # a no-grad decoder's output, alive while the loss head runs
    d_hidden = N * H * compute_bytes  # the loss's gradient of the hidden states
    head_grad = V * H * 4.0 if head_trained else 0.0

    prepare = [dict(states, activations=decoder.nograd * tokens + dequant),  # inside the reference's decoder
               dict(states, activations=hidden + ws["prepare"], logits=logits.prepare * N * V)]  # its log-probs
    if m["ppo"]:  # the value pass: the critic's float32 weights are cast for it under autocast
        prepare.append(dict(states, activations=decoder.nograd * tokens + (compute_bytes * psi_critic if bf16 else 0)))
    kv = kv_cache_bytes(shape, R, S - 1, logits.kv)
    phases = {  # the rollout's last step: its logits, or (4-bit) a dequantized weight inside the decoder
        "rollout": largest(dict(states, kv_cache=kv, logits=logits.rollout * R * V, activations=autocast_copies),
                           dict(states, kv_cache=kv, activations=autocast_copies + dequant)),
        "prepare": largest(*prepare),
    }
    # the end of the forward: what the backward will use (PPO: the critic's forward came after the actor's loss, so
    # its activations meet the saved logits only)
    forward_end = dict(states, activations=saved + ws["forward"], logits=logits.saved * N * V)
    if m["ppo"]:
        forward_end["critic"] += saved
    phases["forward"] = largest(
        *(dict(states, activations=a) for a in inside),
        forward_end,
        dict(states, activations=saved + head_copy + ws["forward"], logits=logits.forward * N * V))  # the loss
    # the loss's backward; the fused one also holds the lm_head's gradient and d hidden while it runs. PPO: the
    # critic's backward runs first, its gradients exist when the actor's starts
    fused_grads = head_grad + d_hidden if m["fused"] else 0.0
    loss_backward = dict(states, activations=saved + head_copy + ws["backward"] + fused_grads,
                         logits=logits.backward * N * V)
    # then the decoder's backward, from its last layer (the lm_head's gradient, tied: the embedding's, waiting for
    # the embedding's part) to its first (what the first layer saved, the other layers' gradients made)
    decoder_start = dict(states, activations=saved + backward + d_hidden + dequant, gradients=head_grad)
    first_layer = decoder.layer(rows, length, flash) + decoder.outside(rows, length, flash) + (0 if ckpt else per_layer)
    decoder_end = dict(states, activations=first_layer + backward + dequant, gradients=4.0 * trained)
    if m["ppo"]:
        for moment in (loss_backward, decoder_start, decoder_end):
            moment["critic"] += 4.0 * psi_critic
    phases["backward"] = largest(forward_end, loss_backward, decoder_start, decoder_end)
    phases["optimizer"] = dict(states, gradients=4.0 * trained,
                               optimizer=states["optimizer"] + adam_temporaries(
                                   shape, trained + psi_critic * m["ppo"], device, training))
    if m["ppo"]:
        phases["optimizer"]["critic"] += 4.0 * psi_critic
    return phases


def peak(phases: dict) -> tuple[float, str]:
    totals = {p: sum(c.values()) for p, c in phases.items()}
    top = max(totals, key=totals.get)
    return totals[top], top


def largest_completion(method: str, shape: ModelShape, budget: float, prompts: int, group_size: int,
                       prompt_len: int, decoder: DecoderBytes, logits: StepBytes, *, compute_bytes: int, device: str,
                       training: Training = Training(), calibrated_lora_r: int = 16,
                       limit: int = MAX_COMPLETION) -> int:
    """The largest T (0: none; ``limit``: that or more) whose projected peak fits ``budget`` bytes; memory grows
    with T."""

    def fits(T: int) -> bool:
        phases = project(method, shape, Step(prompts, group_size, prompt_len, T), decoder, logits,
                         compute_bytes=compute_bytes, device=device, training=training,
                         calibrated_lora_r=calibrated_lora_r)
        return peak(phases)[0] <= budget

    if not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
