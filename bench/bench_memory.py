"""GRPO vs PPO memory: one training step of each method, peak memory by component and step time.

Configurations (``--configs``), all on the same model, prompts, group size and lengths, each in a fresh process:

  ppo             PPO as TRL's PPOTrainer runs it (grpo_fast/ppo.py): actor, critic (same decoder + value head),
                  frozen reference, GAE; log-probs through materialised logits (``impl="reference"``)
  ppo_fused       the same PPO with grpo-fast's fused log-probs: what the critic costs, logits aside
  grpo_reference  GRPO (dapo, beta 0.04, one update per rollout), loss on materialised logits
  grpo_fused      GRPO with grpo-fast's fused loss (no ``[N, V]`` tensor): what ``grpo-fast train`` does
  grpo_shared     grpo_fused with the prompt run once per group in the reference and policy forwards
                  (``grpo_fast.shared_prefix_forward``)

One step = rollout (``grpo_fast.train.rollout.generate``: each prompt prefilled once, its KV cache repeated for the
group; every completion runs to ``--completion-len`` tokens, no EOS) -> rule-based score -> no-grad passes (reference
log-probs; PPO: critic values) -> advantages (GRPO: group-normalised; PPO: KL-penalised rewards and GAE) -> one
update (forward, backward, gradient clipping, the trainer's default optimizer: torch's fused AdamW) on all rows at
once -> gradients dropped. Parameters and AdamW states are float32 (the trainer's master weights), the reference is
stored in ``--dtype`` and the forward passes run under autocast in ``--dtype`` (float32 on CPU: no autocast).
``--lora-r R`` and ``--gradient-checkpointing`` set the GRPO configurations' policy up as ``grpo-fast train`` does
(``build_policy``): LoRA adapters on the trainer's default target modules over a base stored in ``--dtype``, the
reference = the base with the adapters disabled, AdamW over the adapters; transformers' activation checkpointing of
every decoder layer. PPO runs with full fine-tuning only.

Per configuration the child runs one warm-up step (it creates AdamW's states), ``--reps`` timed steps, then one step
under ``bench.memtrack.StorageTracker``, which counts live tensor storage by phase (rollout, prepare, forward,
backward, optimizer) and component (weights, gradients, optimizer, activations, logits, critic, kv_cache, other); the
module docstring of ``bench/memtrack.py`` says exactly what is counted. Cross-checks next to it: on CPU the process's peak
RSS during the timed steps minus its RSS before them (``rss_step_mib``: it includes allocator slack, kernel scratch
and the step's own growth; compare it to ``peak_mib - start_mib``); on CUDA ``torch.cuda.max_memory_allocated``
during the timed steps (``allocator_peak_mib``, absolute like ``peak_mib``).

Output: a CSV (``grpo_fast_bench/memory_<device>.csv`` in the current directory unless ``--csv`` names one; one row
per configuration and phase, plus a ``step`` row: the highest phase) with the command line
that made it and the machine's load average before and after each configuration (the step times of a shared machine
are only as good as its load; the tracked memory does not depend on it), and a PNG next to it: stacked bars of the
components at each configuration's peak, the peak of each phase, and the step time by phase.

    grpo-fast bench memory                                  # the CPU default: 5 configurations, a few minutes
    grpo-fast bench memory --csv bench/results/memory_cpu.csv   # the same, rewriting the committed CSV and PNG
    grpo-fast bench memory --device cuda --dtype bfloat16 --layers 8 --hidden 1024 --vocab 151936 ...
    grpo-fast bench memory --configs grpo_fused --lora-r 16 --gradient-checkpointing --csv /tmp/lora.csv
    grpo-fast bench memory --replot                         # redraw the PNG from the default CSV (the first run's)
    grpo-fast bench memory --replot --csv bench/results/memory_cpu.csv   # ... or from any CSV, the committed one
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_memory.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from grpo_fast.benchmarking import PhaseTimer, time_calls
from grpo_fast.dtypes import DTYPES  # torch's names: float32, bfloat16, float16
from grpo_fast.helptext import PlainHelpFormatter
from grpo_fast.memory.projection import Training

CONFIGS = {
    "ppo": dict(method="ppo", logits="materialised", shared=False),
    "ppo_fused": dict(method="ppo", logits="fused", shared=False),
    "grpo_reference": dict(method="grpo", logits="materialised", shared=False),
    "grpo_fused": dict(method="grpo", logits="fused", shared=False),
    "grpo_shared": dict(method="grpo", logits="fused", shared=True),
}
PHASES = ("rollout", "prepare", "forward", "backward", "optimizer")
DEFAULT_DIR = "grpo_fast_bench"  # where a run writes without --csv: the committed results only when asked
# what a phase makes outside the watched models: the loss's saved tensors, the backward's activation gradients and
# AdamW's step temporaries
PHASE_TAGS = {"rollout": "other", "prepare": "other", "forward": "activations", "backward": "activations",
              "optimizer": "optimizer"}
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "critic", "kv_cache", "other")
MIB = harness.MIB
NOT_AVAILABLE = "skipped: not available (this grpo_fast has no shared_prefix_forward: a checkout older than it)"
FULL_ONLY = "skipped: PPO runs with full fine-tuning and no activation checkpointing only"


@dataclass(frozen=True)
class Shape:
    """The measured model (a Qwen2 decoder: tied embeddings, q/k/v bias, SwiGLU, RMSNorm) and the batch."""

    layers: int = 8
    hidden: int = 256
    intermediate: int = 768
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 32000
    prompts: int = 2  # B
    group_size: int = 8  # G
    prompt_len: int = 64  # P
    completion_len: int = 128  # T

    def check(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"--hidden ({self.hidden}) must divide by --heads ({self.heads}) and --heads by "
                             f"--kv-heads ({self.kv_heads})")
        if self.vocab in (self.hidden, self.intermediate, self.hidden // self.heads):
            raise ValueError(f"--vocab ({self.vocab}) must differ from the model's other widths: the memory tracker "
                             "recognises logits by a last dimension equal to the vocabulary")

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size

    def model_shape(self):
        """This model as a ``bench.models.ModelShape`` (what ``grpo_fast.memory.projection`` projects)."""
        from bench.models import ModelShape

        return ModelShape(f"qwen2.5-bench-L{self.layers}-H{self.hidden}", "", hidden_size=self.hidden,
                          vocab_size=self.vocab, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                          num_key_value_heads=self.kv_heads, head_dim=self.hidden // self.heads,
                          intermediate_size=self.intermediate, tie_word_embeddings=True, attention_bias=True)

    def config(self):
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=self.prompt_len
                           + self.completion_len, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                           bos_token_id=1, attn_implementation="sdpa")


# --------------------------------------------------------------------------------------------------------------------
# One GRPO step (the trainer's step reduced to one micro-batch and one update, from the same pieces)


def grpo_step(policy, ref, optimizer, prompt_ids, prompt_mask, reward_fn, sampling, *, group_size, forward, impl,
              compute_dtype, phase, generator=None, max_grad_norm=1.0):
    """Rollout, group advantages, reference log-probs, one dapo update with beta 0.04; gradients dropped after.
    ``ref`` None: the policy is a PEFT model and the reference is its base with the adapters disabled (the
    trainer's LoRA reference)."""
    from grpo_fast import GRPOLossConfig, group_advantages, grpo_loss
    from grpo_fast.ppo import completion_logprobs
    from grpo_fast.train.forward import head_of
    from grpo_fast.train.model import autocast
    from grpo_fast.train.rollout import generate

    device = prompt_ids.device
    head = head_of(policy)
    config = GRPOLossConfig(loss_type="dapo", beta=0.04, softcap=head.softcap, temperature=sampling.temperature)
    with phase("rollout"):
        with autocast(device, compute_dtype):
            ro = generate(policy, prompt_ids, prompt_mask, group_size, sampling, eos_token_id=-1, pad_token_id=0,
                          generator=generator)
        advantages = group_advantages(reward_fn(ro), group_size=group_size).advantages
    ref_context = policy.disable_adapter() if ref is None else contextlib.nullcontext()
    with phase("prepare"), torch.no_grad(), ref_context, autocast(device, compute_dtype):
        ref_logps = completion_logprobs(policy if ref is None else ref, ro, temperature=sampling.temperature,
                                        impl=impl, forward=forward)
    with phase("forward"):
        with autocast(device, compute_dtype):
            hidden = forward(policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        hidden = hidden.to(compute_dtype)
        bias = None if head.bias is None else head.bias.to(compute_dtype)
        out = grpo_loss(hidden, head.weight.to(compute_dtype), ro.completion_ids, advantages, ro.completion_mask,
                        ref_logps=ref_logps, bias=bias, config=config, impl=impl)
    with phase("backward"):
        out.loss.backward()
        del out, hidden  # as in the trainer, whose loss and hidden states die with the micro-batch
    with phase("optimizer"):
        torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.grad is not None], max_grad_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def even_token_score(ro) -> torch.Tensor:
    """The bench's rule-based reward: the fraction of even token ids in each completion ([R] float32)."""
    return (ro.completion_ids % 2 == 0).float().mean(dim=1)


# --help of Shape's fields
SHAPE_HELP = {"layers": "decoder layers of the measured Qwen2 model", "hidden": "its hidden size H",
              "intermediate": "its MLP's intermediate size", "heads": "its attention heads",
              "kv_heads": "its key/value heads (grouped-query attention)", "vocab": "its vocabulary size V",
              "prompts": "prompts per step (B)", "group_size": "completions per prompt (G)",
              "prompt_len": "prompt tokens (P)", "completion_len": "completion tokens, every completion that long (T)"}


def shared_forward(group_size: int):
    """``completion_hidden``'s signature on top of ``grpo_fast.shared_prefix_forward`` (rows of a group share their
    prompt: row ``i`` belongs to prompt ``i // G``); None in a checkout older than that function."""
    import grpo_fast

    fn = getattr(grpo_fast, "shared_prefix_forward", None)
    if fn is None:
        return None

    def forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return fn(model, prompt_ids[::group_size], prompt_mask[::group_size], completion_ids, completion_mask,
                  group_size)

    return forward


# --------------------------------------------------------------------------------------------------------------------
# The child: build, warm up, time, track


def _owners(policy, ref, critic, optimizer):
    from bench.memtrack import storage_ids

    models = [policy] if ref is None else [policy, ref]

    def owners() -> dict[int, str]:
        m = dict.fromkeys(storage_ids([t for model in models for t in (*model.parameters(), *model.buffers())]),
                          "weights")
        m.update(dict.fromkeys(storage_ids(p.grad for p in policy.parameters()), "gradients"))
        m.update(dict.fromkeys(storage_ids(v for p in policy.parameters() for v in optimizer.state.get(p, {}).values()),
                               "optimizer"))
        if critic is not None:
            params = list(critic.parameters())
            m.update(dict.fromkeys(storage_ids([*params, *critic.buffers(), *(p.grad for p in params),
                                                *(v for p in params for v in optimizer.state.get(p, {}).values())]),
                                   "critic"))
        return m

    return owners


@dataclass
class Setup:
    """A configuration ready to step: ``step(phase=...)`` runs one training step."""

    step: object
    policy: torch.nn.Module
    ref: torch.nn.Module | None  # None: LoRA's reference, the policy with its adapters disabled
    critic: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    inputs: list


def build_policy(config, device: torch.device, compute_dtype: torch.dtype, training: Training):
    """The policy as the trainer sets it up (``grpo_fast.train.model``): full fine-tuning keeps float32 weights;
    LoRA stores the base in the compute dtype and adds the trainer's adapters; activation checkpointing is switched
    on before the adapters, as ``load_model_and_tokenizer`` does."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.model import attach_lora, disable_dropout, enable_activation_checkpointing

    with torch.device(device):  # initialised where it runs (a CPU init of a large model is slow)
        policy = AutoModelForCausalLM.from_config(config)
    if training.lora_r:
        policy.to(compute_dtype)
    policy.train()
    disable_dropout(policy)
    if training.checkpointing:
        enable_activation_checkpointing(policy)
    if training.lora_r:
        policy = attach_lora(policy, TrainConfig(lora_r=training.lora_r))
    return policy


def setup_config(name: str, spec: Shape, device: torch.device, compute_dtype: torch.dtype, seed: int,
                 model_config=None, training: Training = Training()) -> Setup | None:
    """Model, reference, critic (PPO), AdamW and prompts for configuration ``name``; None when it needs
    ``shared_prefix_forward`` and this checkout predates it. ``model_config``: another transformers config to build
    (default: ``spec.config()``); ``training``: LoRA and activation checkpointing (GRPO configurations only)."""
    from grpo_fast.ppo import Critic, PPOConfig, ppo_step
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.forward import completion_hidden
    from grpo_fast.train.model import frozen_copy, make_optimizer
    from grpo_fast.train.rollout import SamplingParams

    cfg = CONFIGS[name]
    if cfg["method"] == "ppo" and training != Training():
        raise ValueError(f"{name}: {FULL_ONLY.removeprefix('skipped: ')}, got {training}")
    forward = shared_forward(spec.group_size) if cfg["shared"] else completion_hidden
    if forward is None:
        return None
    torch.manual_seed(seed)
    policy = build_policy(model_config or spec.config(), device, compute_dtype, training)
    ref = None if training.lora_r else frozen_copy(policy, compute_dtype)
    critic = Critic.from_policy(policy, seed=seed) if cfg["method"] == "ppo" else None
    models = [policy] if critic is None else [policy, critic]
    params = [p for model in models for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, TrainConfig(optim=training.optim), 1e-6, device, policy)  # the trainer's
    gen = torch.Generator().manual_seed(seed)
    vocab = policy.config.vocab_size
    prompt_ids = torch.randint(2, vocab, (spec.prompts, spec.prompt_len), generator=gen).to(device)
    prompt_mask = torch.ones_like(prompt_ids)
    sampling = SamplingParams(max_new_tokens=spec.completion_len, temperature=1.0)
    impl = "reference" if cfg["logits"] == "materialised" else "auto"
    sample_gen = torch.Generator(device=device).manual_seed(seed)
    if critic is not None:
        step = functools.partial(ppo_step, policy, critic, ref, optimizer, prompt_ids, prompt_mask, even_token_score,
                                 PPOConfig(), sampling, eos_token_id=-1, pad_token_id=0, group_size=spec.group_size,
                                 generator=sample_gen, impl=impl, compute_dtype=compute_dtype)
    else:
        step = functools.partial(grpo_step, policy, ref, optimizer, prompt_ids, prompt_mask, even_token_score,
                                 sampling, group_size=spec.group_size, forward=forward, impl=impl,
                                 compute_dtype=compute_dtype, generator=sample_gen)
    return Setup(step, policy, ref, critic, optimizer, [prompt_ids, prompt_mask])


def tracked_step(setup: Setup) -> dict:
    """One step under the storage tracker; ``{phase: PhasePeak}``."""
    from bench.memtrack import StorageTracker
    from grpo_fast.train.forward import decoder_of

    policy, ref, critic, optimizer = setup.policy, setup.ref, setup.critic, setup.optimizer
    tracker = StorageTracker(policy.config.vocab_size, policy.config.hidden_size,
                             owners=_owners(policy, ref, critic, optimizer))
    for model in (policy, ref, critic):
        if model is not None:
            tracker.register([*model.parameters(), *model.buffers()], "weights")
    tracker.register([v for state in optimizer.state.values() for v in state.values()], "optimizer")
    tracker.register(setup.inputs, "other")
    handles = [h for model in (policy, ref) if model is not None for h in tracker.watch(decoder_of(model),
                                                                                         "activations")]
    if critic is not None:
        handles += tracker.watch(critic, "critic")
    try:
        with tracker, tracker.tag_kv_cache():
            setup.step(phase=lambda p: tracker.phase(p, PHASE_TAGS[p]))
    finally:
        for h in handles:
            h.remove()
    return tracker.peaks


def run_config(name: str, shape: dict, device: str, dtype: str, threads: int, reps: int, seed: int,
               training: dict | None = None) -> dict:
    """One configuration in this (fresh) process; returns timings, tracked peaks and cross-checks."""
    spec = Shape(**shape)
    torch.set_num_threads(threads)
    device = torch.device(device)
    training = Training(**(training or {}))
    if CONFIGS[name]["method"] == "ppo" and training != Training():
        return dict(skipped=FULL_ONLY)
    setup = setup_config(name, spec, device, DTYPES[dtype], seed, training=training)
    if setup is None:
        return dict(skipped=NOT_AVAILABLE)
    setup.step(phase=lambda _: contextlib.nullcontext())  # warm-up: AdamW's states, lazy initialisation
    timer = PhaseTimer(device, PHASES)
    check = _cross_check_start(device)
    # the step by time_calls (CUDA events on CUDA), each phase by PhaseTimer (the device synchronised at both ends,
    # perf_counter): on CUDA the phases' own syncs sit inside the step, so their sum need not equal it exactly
    step_ms = time_calls(lambda: setup.step(phase=timer.phase), device=device, reps=reps)
    result = dict(step_ms=statistics.median(step_ms), phase_ms={p: statistics.median(v) for p, v in timer.ms.items()},
                  **_cross_check_end(device, check))
    peaks = tracked_step(setup)
    result["peaks"] = {p: dict(peak=v.peak_bytes, start=v.start_bytes, breakdown=v.breakdown) for p, v in peaks.items()}
    result["params"] = dict(policy=sum(p.numel() for p in setup.policy.parameters()),
                            critic=sum(p.numel() for p in setup.critic.parameters()) if setup.critic else 0)
    return result


def _cross_check_start(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    harness.trim_heap()
    harness.reset_peak_rss()
    return harness.rss_bytes()


def _cross_check_end(device, start) -> dict:
    if device.type == "cuda":
        return dict(allocator_peak_bytes=torch.cuda.max_memory_allocated(device), allocator_start_bytes=start)
    return dict(rss_step_bytes=harness.peak_rss_bytes() - start)


# --------------------------------------------------------------------------------------------------------------------
# Rows, table, plot


def result_rows(name: str, r: dict, common: dict) -> list[dict]:
    """One row per phase plus ``step`` (the phase with the highest peak), sizes in MiB."""
    cfg = CONFIGS[name]
    base = dict(config=name, method=cfg["method"], logits=cfg["logits"], shared_prompt=cfg["shared"], **common)
    if "skipped" in r or "error" in r:
        return [dict(base, phase="step", error=r.get("error", r.get("skipped")))]
    mib = lambda b: round(b / MIB, 3)  # noqa: E731
    rows = []
    for phase in PHASES:
        p = r["peaks"][phase]
        rows.append(dict(base, phase=phase, peak_mib=mib(p["peak"]), start_mib=mib(p["start"]),
                         **{f"{c}_mib": mib(p["breakdown"][c]) for c in CATEGORIES},
                         median_ms=round(r["phase_ms"][phase], 2)))
    top = max(rows, key=lambda row: row["peak_mib"])
    step = dict(top, phase="step", peak_phase=top["phase"], median_ms=round(r["step_ms"], 2),
                policy_params=r["params"]["policy"], critic_params=r["params"]["critic"])
    if "rss_step_bytes" in r:
        step["rss_step_mib"] = mib(r["rss_step_bytes"])
    if "allocator_peak_bytes" in r:
        step.update(allocator_peak_mib=mib(r["allocator_peak_bytes"]),
                    allocator_start_mib=mib(r["allocator_start_bytes"]))
    return rows + [step]


def results_table(rows: list[dict]) -> str:
    headers = ["config", "peak MiB", "at", *CATEGORIES, "step ms", "error"]
    body = []
    for r in rows:
        if r.get("phase") != "step":
            continue
        if r.get("error"):
            body.append([r["config"], "", "", *[""] * len(CATEGORIES), "", r["error"]])
            continue
        body.append([r["config"], float(r["peak_mib"]), r["peak_phase"],
                     *[float(r[f"{c}_mib"]) for c in CATEGORIES], float(r["median_ms"]), ""])
    return harness.markdown_table(headers, body)


COLORS = {"weights": "#4d4d4d", "gradients": "#878787", "optimizer": "#bababa", "activations": "#4393c3",
          "logits": "#d6604d", "critic": "#b2abd2", "kv_cache": "#5aae61", "other": "#f4a582"}
PHASE_COLORS = {"rollout": "#5aae61", "prepare": "#92c5de", "forward": "#4393c3", "backward": "#2166ac",
                "optimizer": "#bababa"}


def plot(csv_path: Path) -> Path:
    """The PNG next to ``csv_path``, from the CSV alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = harness.read_csv(csv_path)
    step = [r for r in rows if r["phase"] == "step" and not r.get("error")]
    if not step:
        raise ValueError(f"{csv_path}: no measured configuration to plot")
    names = [r["config"] for r in step]
    by = {(r["config"], r["phase"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.5, 1.5, 1]})
    ax = axes[0]
    bottom = [0.0] * len(step)
    for c in CATEGORIES:
        values = [float(r[f"{c}_mib"]) for r in step]
        ax.bar(names, values, bottom=bottom, color=COLORS[c], label=c)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(step):
        ax.text(i, bottom[i], f"{bottom[i]:.0f}\n({r['peak_phase']})", ha="center", va="bottom", fontsize=7)
    ax.set(ylabel="MiB alive at the step's peak", title="peak memory by component")
    ax.legend(fontsize=7, ncol=2)
    ax.margins(y=0.15)
    ax = axes[1]
    width = 0.8 / len(PHASES)
    for j, phase in enumerate(PHASES):
        xs = [i + (j - (len(PHASES) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [float(by[(n, phase)]["peak_mib"]) for n in names], width, color=PHASE_COLORS[phase],
               label=phase)
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="MiB", title="peak of each phase")
    ax.legend(fontsize=7)
    ax = axes[2]
    bottom = [0.0] * len(names)
    for phase in PHASES:
        values = [float(by[(n, phase)]["median_ms"]) / 1e3 for n in names]
        ax.barh(names, values, left=bottom, color=PHASE_COLORS[phase], label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="seconds (median)", title="step time by phase")
    ax.invert_yaxis()
    for a in axes[:2]:
        a.tick_params(axis="x", labelrotation=20, labelsize=8)
    r0 = step[0]
    fig.suptitle(f"one training step: {r0['model']}, B={r0['prompts']} G={r0['group_size']} P={r0['prompt_len']} "
                 f"T={r0['completion_len']}, {r0['dtype']}\n{r0['device']}, torch {r0['torch']}, commit "
                 f"{r0['commit']}", fontsize=9)
    fig.tight_layout()
    png = Path(csv_path).with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------------------------------------------------
# Driver


def build_parser(prog: str = "python -m bench.bench_memory") -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog=prog, description=doc[0], epilog="\n\n".join(doc[1:]), allow_abbrev=False,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="NAME",
                   help=f"configurations to run, in order (default: all: {', '.join(CONFIGS)})")
    d = Shape()
    for name, value in asdict(d).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                       help=f"{SHAPE_HELP[name]} (default {value})")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="compute dtype of the forward passes and the reference's storage (default float32)")
    p.add_argument("--lora-r", type=int, default=0, metavar="R",
                   help="LoRA rank of the GRPO configurations, as grpo-fast train --lora-r (default 0: full "
                        "fine-tuning; PPO is skipped with LoRA)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="activation checkpointing of the GRPO configurations (PPO is skipped with it)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per configuration (default 1)")
    p.add_argument("--reps", type=int, default=2, help="timed steps per configuration (default 2; median)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model's weights, the prompts and the sampling "
                                                          "(default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration (default 1800)")
    p.add_argument("--csv", type=Path, default=None,
                   help=f"output CSV (default {DEFAULT_DIR}/memory_<device>.csv in the current directory, never the "
                        "committed bench/results/: name that here to rewrite it; the PNG goes next to the CSV)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the PNG from the CSV (--csv, or the default one a run without --csv writes)")
    return p


def main(argv=None, prog: str = "python -m bench.bench_memory", command: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    device = torch.device(args.device)
    csv_path = args.csv or Path(DEFAULT_DIR) / f"memory_{device.type}.csv"
    if args.replot:
        if not csv_path.is_file():
            which = "--csv" if args.csv else "the default: where a run without --csv writes it"
            raise FileNotFoundError(f"--replot: no CSV to redraw at {csv_path} ({which}); run the benchmark first, or "
                                    "name a CSV with --csv (e.g. --csv bench/results/memory_cpu.csv)")
        print(f"plot: {plot(csv_path)}")
        return 0
    shape = Shape(**{k: getattr(args, k) for k in asdict(Shape())})
    shape.check()
    if args.reps < 1:
        raise ValueError(f"--reps: expected an integer >= 1, got {args.reps}")
    training = Training(lora_r=args.lora_r, checkpointing=args.gradient_checkpointing)
    common = dict(model=f"Qwen2 L={shape.layers} H={shape.hidden} I={shape.intermediate} heads={shape.heads}/"
                        f"{shape.kv_heads} V={shape.vocab}", **asdict(shape), dtype=args.dtype,
                  lora_r=training.lora_r, gradient_checkpointing=training.checkpointing)
    print(f"memory bench on {harness.device_name(device)}: {common['model']}, B={shape.prompts} G={shape.group_size} "
          f"P={shape.prompt_len} T={shape.completion_len}, {args.dtype}, {training.describe()}, {args.threads} "
          "thread(s)", flush=True)
    out = harness.CsvRows(csv_path)  # rewritten after each configuration: a timeout keeps the finished ones
    for name in args.configs:
        torch.set_num_threads(args.threads)
        env = harness.env_fields(device)
        if command:
            env["command"] = command
        print(f"  {name:>15} ... ", end="", flush=True)
        t0, load_start = time.perf_counter(), os.getloadavg()[0]
        params = dict(name=name, shape=asdict(shape), device=args.device, dtype=args.dtype, threads=args.threads,
                      reps=args.reps, seed=args.seed, training=asdict(training))
        try:
            r = harness.run_isolated("bench.bench_memory:run_config", params, timeout=args.timeout,
                                     mem_limit_bytes=None if device.type == "cuda" else harness.default_mem_limit(None))
        except harness.IsolatedError as e:
            r = dict(error=str(e))
        load = dict(load_avg_start=round(load_start, 2), load_avg_end=round(os.getloadavg()[0], 2))
        new = [dict(row, **load, **env) for row in result_rows(name, r, common)]
        for row in new:
            out.add(row)
        step = new[-1]
        print(step.get("error") or f"peak {step['peak_mib']:.1f} MiB ({step['peak_phase']}), "
              f"{step['median_ms'] / 1e3:.2f} s/step, load {load['load_avg_start']:.1f}/{load['load_avg_end']:.1f}  "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    rows = out.rows
    try:
        png = plot(csv_path) if any(r.get("peak_mib") for r in rows) else None
    except ImportError as e:  # matplotlib is optional (the GPU machine may lack it): the CSV is the result
        png = f"not drawn ({e})"
    print()
    print(results_table(rows))
    print(f"\nCSV: {csv_path}" + (f"; plot: {png}" if png else ""))
    return 0 if all(not r.get("error") or r["error"] in (NOT_AVAILABLE, FULL_ONLY) for r in rows) else 1


def cli_command(argv: list[str]) -> str:
    return shlex.join(["grpo-fast", "bench", "memory", *argv])


if __name__ == "__main__":
    sys.exit(main())
