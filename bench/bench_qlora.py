"""Full fine-tuning, LoRA, QLoRA and QLoRA + 8-bit AdamW: one GRPO training step of the same model, peak memory by
component and step time, with grpo-fast's fused loss and with TRL's ``GRPOTrainer`` under the same options.

Configurations (``--configs``), each run by both trainers (``--trainers``), each in a fresh process:

  full        every parameter trained (float32), a frozen reference copy, ``adamw_torch_fused``
  lora        LoRA r=16 (alpha 16) on q, k, v, o over the frozen base, reference = adapters disabled
  qlora       the same over a 4-bit base (NF4, double quantization, float32 compute; embeddings and the tied lm_head
              float32)
  qlora_8bit  qlora with bitsandbytes' 8-bit AdamW (``adamw_8bit``)

The model: a Qwen2 of 12 layers, H=512, I=1408, 8/2 heads, V=32,000, tied embeddings (50.2M parameters), random
weights saved once to a temporary directory that both trainers load. The batch: ``--prompts`` prompts of
``--prompt-len`` random tokens x ``--group-size`` completions of exactly ``--completion-len`` tokens (grpo-fast: no
EOS; TRL: ``generation_kwargs={"min_new_tokens": T}``). One step: rollout (each trainer's own sampling: grpo-fast's
``generate``, TRL's ``model.generate``), a reward (the fraction of even token ids), group advantages, the
reference pass, one dapo update with beta 0.04, epsilon 0.2, gradient clipping at 1.0, lr 1e-6, betas (0.9, 0.99),
no weight decay, no activation checkpointing, float32 on CPU. grpo-fast's step is ``bench.bench_memory.grpo_step``
on the policy as ``grpo-fast train`` loads it (``grpo_fast.train.model``: ``load_model_and_tokenizer``,
``attach_lora``, ``make_optimizer``); TRL's is ``GRPOTrainer._prepare_inputs`` (generation, rewards, reference
log-probs), ``compute_loss``, the backward, clipping and the optimizer TRL builds from ``optim``, with every option
passed (``trl_config``). TRL stores QLoRA adapters in bfloat16 (its QLoRA recipe); grpo-fast keeps them float32.

Per process: one warm-up step (it creates the optimizer's states), ``--reps`` timed steps, then one step under
``bench.memtrack.StorageTracker``. Components at the step's peak: ``weights`` (frozen weights: the base, its 4-bit
blocks and their scales, the reference copy; full fine-tuning: the trained float32 weights too), ``adapters`` (the
trained LoRA parameters, exact), ``gradients``, ``optimizer`` (states and step temporaries), ``activations``,
``logits`` (tensors whose last dimension is V), ``kv_cache``, ``other``. Step times were measured on a shared,
loaded 2-core machine: the CSV records the 1-minute load average before and after each process (``load_avg_start``,
``load_avg_end``); memory does not depend on the load.

    python -m bench.bench_qlora                                  # 8 processes, about 15 minutes on 2 loaded cores
    python -m bench.bench_qlora --csv bench/results/qlora_cpu.csv  # rewrite the committed CSV and PNG
    python -m bench.bench_qlora --configs qlora qlora_8bit --trainers grpo_fast --completion-len 64
    python -m bench.bench_qlora --replot --csv bench/results/qlora_cpu.csv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_qlora.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import bench_memory, harness
from grpo_fast.benchmarking import PhaseTimer, time_calls

CONFIGS = {
    "full": dict(lora_r=0, load_in_4bit=False, optim="adamw_torch_fused"),
    "lora": dict(lora_r=16, load_in_4bit=False, optim="adamw_torch_fused"),
    "qlora": dict(lora_r=16, load_in_4bit=True, optim="adamw_torch_fused"),
    "qlora_8bit": dict(lora_r=16, load_in_4bit=True, optim="adamw_8bit"),
}
TRAINERS = ("grpo_fast", "trl")
COMPONENTS = ("weights", "adapters", "gradients", "optimizer", "activations", "logits", "kv_cache", "other")
PHASES = {"grpo_fast": ("rollout", "prepare", "forward", "backward", "optimizer"),
          "trl": ("rollout", "forward", "backward", "optimizer")}  # TRL's reference pass is inside its rollout
PHASE_TAGS = {"rollout": "other", "prepare": "other", "forward": "activations", "backward": "activations",
              "optimizer": "optimizer"}
DEFAULT_DIR = "grpo_fast_bench"
LR, BETAS, MAX_GRAD_NORM, BETA, EPSILON, LORA_ALPHA = 1e-6, (0.9, 0.99), 1.0, 0.04, 0.2, 16
MIB = harness.MIB
TIMING_NOTE = ("step times on a shared, loaded machine (1-minute load average before and after each process: "
               "load_avg_start, load_avg_end); the tracked memory does not depend on the load")


@dataclass(frozen=True)
class Shape(bench_memory.Shape):
    """``bench.bench_memory.Shape`` (a Qwen2 decoder with tied embeddings, and the batch) at this bench's size."""

    layers: int = 12
    hidden: int = 512
    intermediate: int = 1408
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 32000
    prompts: int = 2  # B
    group_size: int = 4  # G
    prompt_len: int = 32  # P
    completion_len: int = 32  # T


def save_model(shape: Shape, directory: Path, seed: int) -> None:
    """The random Qwen2 of ``shape`` and a word-level tokenizer over its vocabulary, as a model directory."""
    sys.path.insert(0, str(harness.REPO_ROOT / "tests"))
    from trl_fixtures import tiny_qwen2, tiny_tokenizer

    tokenizer = tiny_tokenizer(num_words=shape.vocab - 3)  # <pad> <eos> <unk> w0 .. : exactly V tokens
    model = tiny_qwen2(len(tokenizer), seed=seed, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, tie_word_embeddings=True,
                       max_position_embeddings=shape.prompt_len + shape.completion_len + 8)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def prompt_ids(shape: Shape, seed: int) -> torch.Tensor:
    """``[B, P]`` random word ids (never pad, EOS or unk), the same for both trainers."""
    return torch.randint(3, shape.vocab, (shape.prompts, shape.prompt_len), generator=torch.Generator().manual_seed(seed))


def even_fraction(prompts, completions, completion_ids, **kwargs):
    """TRL's reward function form of ``bench.bench_memory.even_token_score``."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


# --------------------------------------------------------------------------------------------------------------------
# What the tracker counts as weights: parameters, buffers and the 4-bit weights' quantization state


def quant_state_tensors(model) -> list[torch.Tensor]:
    """The tensors of every bitsandbytes 4-bit weight's quantization state (block scales, nested scales, code
    tables): weights, though neither parameters nor buffers."""
    out = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            out += [t for t in (state.absmax, state.code, getattr(state, "offset", None)) if torch.is_tensor(t)]
            state = getattr(state, "state2", None)
    return out


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def owners_of(models, trained_model, optimizer):
    """``owners()`` for the tracker: the models' parameters, buffers and quantization states are weights, the
    trained model's ``.grad`` gradients, the optimizer's state optimizer."""
    from bench.memtrack import storage_ids

    def owners() -> dict[int, str]:
        m = dict.fromkeys(storage_ids([t for model in models for t in (*model.parameters(), *model.buffers(),
                                                                       *quant_state_tensors(model))]), "weights")
        m.update(dict.fromkeys(storage_ids(p.grad for p in trained_model.parameters()), "gradients"))
        m.update(dict.fromkeys(storage_ids(optimizer_tensors(optimizer)), "optimizer"))
        return m

    return owners


def tracked(models, trained_model, optimizer, inputs, vocab: int, hidden: int, step) -> dict:
    """``step(phase)`` once under the storage tracker; ``{phase: PhasePeak}``."""
    from bench.memtrack import StorageTracker
    from grpo_fast.train.forward import decoder_of

    tracker = StorageTracker(vocab, hidden, owners=owners_of(models, trained_model, optimizer))
    for model in models:
        tracker.register([*model.parameters(), *model.buffers(), *quant_state_tensors(model)], "weights")
    tracker.register(optimizer_tensors(optimizer), "optimizer")
    tracker.register(inputs, "other")
    handles = [h for model in models for h in tracker.watch(decoder_of(model), "activations")]
    try:
        with tracker, tracker.tag_kv_cache():
            step(lambda p: tracker.phase(p, PHASE_TAGS[p]))
    finally:
        for h in handles:
            h.remove()
    return tracker.peaks


def adapter_bytes(model, lora: bool) -> int:
    """The trained LoRA parameters' bytes (0 without LoRA: full fine-tuning's trained weights are weights)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if lora else 0


# --------------------------------------------------------------------------------------------------------------------
# The two trainers (each inside an isolated child process)


def train_config(config: str, model_dir: str):
    """The ``grpo-fast train`` options of ``config``: what the grpo-fast side loads, and what TRL is given."""
    from grpo_fast.train.config import TrainConfig

    return TrainConfig(model=model_dir, device="cpu", dtype="float32", disable_dropout=True, lora_alpha=LORA_ALPHA,
                       lr=LR, adam_betas=list(BETAS), max_grad_norm=MAX_GRAD_NORM, output_dir="unused",
                       **CONFIGS[config])


def trl_config(config: str, shape: Shape, output_dir: str, seed: int) -> dict:
    """``GRPOConfig``'s keyword arguments for ``config``: every option that matters to the step, explicit."""
    from grpo_fast.train.model import checkpointing_arguments

    cfg = train_config(config, "unused")
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, seed=seed, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, use_vllm=False,
        model_init_kwargs={"dtype": torch.float32},
        num_generations=shape.group_size, per_device_train_batch_size=shape.prompts * shape.group_size,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=shape.completion_len, generation_kwargs={"min_new_tokens": shape.completion_len},
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        loss_type="dapo", beta=BETA, epsilon=EPSILON, epsilon_high=EPSILON, scale_rewards="group",
        mask_truncated_completions=False, disable_dropout=True,
        **checkpointing_arguments(False),
        learning_rate=LR, optim=cfg.optim, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="constant", warmup_steps=0,
    )


def trl_peft_kwargs(config: str) -> dict:
    """``GRPOTrainer``'s ``peft_config`` and ``quantization_config`` for ``config``: the trainer's own LoRA and
    bitsandbytes settings (``grpo_fast.train.model.bnb_4bit_config``)."""
    from grpo_fast.train.model import bnb_4bit_config

    cfg = train_config(config, "unused")
    out = {}
    if cfg.lora_r:
        from peft import LoraConfig

        out["peft_config"] = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                        target_modules=cfg.lora_target_modules, lora_dropout=0.0,
                                        task_type="CAUSAL_LM")
    if cfg.load_in_4bit:
        out["quantization_config"] = bnb_4bit_config(cfg, torch.float32)
    return out


def _measure(step, phases, reps: int, models, trained_model, optimizer, inputs, shape: Shape) -> dict:
    """Warm-up, ``reps`` timed steps, one tracked step."""
    step(lambda _: contextlib.nullcontext())  # the optimizer's states and every lazy initialisation
    timer = PhaseTimer("cpu", phases)
    harness.trim_heap()
    harness.reset_peak_rss()
    rss0 = harness.rss_bytes()
    times = time_calls(lambda: step(timer.phase), device="cpu", reps=reps)
    rss_step = harness.peak_rss_bytes() - rss0
    peaks = tracked(models, trained_model, optimizer, inputs, shape.vocab, shape.hidden, step)
    return dict(step_ms=statistics.median(times), phase_ms={p: statistics.median(v) for p, v in timer.ms.items()},
                rss_step_bytes=rss_step,
                peaks={p: dict(peak=v.peak_bytes, start=v.start_bytes, breakdown=v.breakdown) for p, v in peaks.items()})


def run_grpo_fast(config: str, shape: dict, model_dir: str, reps: int, seed: int, threads: int) -> dict:
    """grpo-fast's step (``bench.bench_memory.grpo_step``) on the policy as ``grpo-fast train`` sets it up."""
    import warnings

    warnings.filterwarnings("ignore")
    from bench.bench_memory import even_token_score, grpo_step
    from grpo_fast.train.forward import completion_hidden
    from grpo_fast.train.model import attach_lora, frozen_copy, load_model_and_tokenizer, make_optimizer
    from grpo_fast.train.rollout import SamplingParams

    torch.set_num_threads(threads)
    spec = Shape(**shape)
    cfg = train_config(config, model_dir)
    device = torch.device("cpu")
    torch.manual_seed(seed)
    policy, _ = load_model_and_tokenizer(cfg, device, torch.float32)
    ref = None
    if cfg.lora_r:
        policy = attach_lora(policy, cfg)
    else:
        ref = frozen_copy(policy, torch.float32)
    optimizer = make_optimizer([p for p in policy.parameters() if p.requires_grad], cfg, LR, device, policy)
    ids = prompt_ids(spec, seed)
    mask = torch.ones_like(ids)
    sampling = SamplingParams(max_new_tokens=spec.completion_len, temperature=1.0)
    step_fn = functools.partial(grpo_step, policy, ref, optimizer, ids, mask, even_token_score, sampling,
                                group_size=spec.group_size, forward=completion_hidden, impl="auto",
                                compute_dtype=torch.float32, generator=torch.Generator().manual_seed(seed),
                                max_grad_norm=MAX_GRAD_NORM)
    models = [policy] if ref is None else [policy, ref]
    result = _measure(lambda phase: step_fn(phase=phase), PHASES["grpo_fast"], reps, models, policy, optimizer,
                      [ids, mask], spec)
    return dict(result, adapters_bytes=adapter_bytes(policy, bool(cfg.lora_r)), **_counts(policy))


def run_trl(config: str, shape: dict, model_dir: str, reps: int, seed: int, threads: int) -> dict:
    """TRL's step: ``_prepare_inputs`` (generation, rewards, reference log-probs), ``compute_loss``, the backward,
    clipping and TRL's optimizer."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    spec = Shape(**shape)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left")
    ids = prompt_ids(spec, seed)
    prompts = [" ".join(tokenizer.convert_ids_to_tokens(row.tolist())) for row in ids]
    with tempfile.TemporaryDirectory(prefix="bench_qlora_trl_") as tmp:
        trainer = GRPOTrainer(model=model_dir, reward_funcs=[even_fraction],
                              args=GRPOConfig(**trl_config(config, spec, tmp, seed)),
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                              **trl_peft_kwargs(config))
        model = trainer.model
        optimizer = trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1
        batch = [{"prompt": p} for p in prompts for _ in range(spec.group_size)]
        params = [p for p in model.parameters() if p.requires_grad]
        assert trainer.processing_class(prompts[0], add_special_tokens=False)["input_ids"] == ids[0].tolist()

        def step(phase):
            model.train()
            with phase("rollout"):
                inputs = trainer._prepare_inputs(batch)
            with phase("forward"):
                loss = trainer.compute_loss(model, inputs)
            with phase("backward"):
                trainer.accelerator.backward(loss)
                del loss
            with phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lengths = inputs["completion_mask"].sum(1)
            assert bool((lengths == spec.completion_len).all()), f"completions of {lengths.tolist()} tokens"

        ref = getattr(trainer, "ref_model", None)
        models = [model] if ref is None else [model, ref]
        result = _measure(step, PHASES["trl"], reps, models, model, optimizer, [], spec)
        lora = bool(CONFIGS[config]["lora_r"])
        return dict(result, adapters_bytes=adapter_bytes(model, lora), trl=importlib.metadata.version("trl"),
                    adapter_dtype=str(next(p.dtype for p in params)).removeprefix("torch."), **_counts(model))


def _counts(model) -> dict:
    """Parameters (a 4-bit weight by its unpacked shape) and trained parameters."""
    total = sum(getattr(getattr(p, "quant_state", None), "shape", p.shape).numel() for p in model.parameters())
    return dict(params=total, trained_params=sum(p.numel() for p in model.parameters() if p.requires_grad))


# --------------------------------------------------------------------------------------------------------------------
# Rows, table, plot


def result_rows(config: str, trainer: str, r: dict, common: dict) -> list[dict]:
    """One row per phase plus ``step`` (the phase with the highest peak), sizes in MiB; the tracker's weights split
    into frozen weights and the adapters."""
    base = dict(config=config, trainer=trainer, **CONFIGS[config], **common, timing_note=TIMING_NOTE)
    if "error" in r:
        return [dict(base, phase="step", error=r["error"])]
    mib = lambda b: round(b / MIB, 3)  # noqa: E731
    rows = []
    for phase in PHASES[trainer]:
        p = r["peaks"][phase]
        parts = dict(p["breakdown"], adapters=r["adapters_bytes"])
        parts["weights"] -= r["adapters_bytes"]
        rows.append(dict(base, phase=phase, peak_mib=mib(p["peak"]), start_mib=mib(p["start"]),
                         **{f"{c}_mib": mib(parts.get(c, 0)) for c in COMPONENTS},
                         median_ms=round(r["phase_ms"][phase], 1)))
    top = max(rows, key=lambda row: row["peak_mib"])
    step = dict(top, phase="step", peak_phase=top["phase"], median_ms=round(r["step_ms"], 1),
                rss_step_mib=mib(r["rss_step_bytes"]), params=r["params"], trained_params=r["trained_params"],
                adapter_dtype=r.get("adapter_dtype", "float32"), trl=r.get("trl", ""))
    return rows + [step]


def results_table(rows: list[dict]) -> str:
    headers = ["config", "trainer", "peak MiB", "at", *COMPONENTS, "step s", "error"]
    body = []
    for r in (r for r in rows if r["phase"] == "step"):
        if r.get("error"):
            body.append([r["config"], r["trainer"], "", "", *[""] * len(COMPONENTS), "", r["error"][:60]])
            continue
        body.append([r["config"], r["trainer"], float(r["peak_mib"]), r["peak_phase"],
                     *[float(r[f"{c}_mib"]) for c in COMPONENTS], round(float(r["median_ms"]) / 1e3, 1), ""])
    return harness.markdown_table(headers, body)


COLORS = {"weights": "#4d4d4d", "adapters": "#8c510a", "gradients": "#878787", "optimizer": "#bababa",
          "activations": "#4393c3", "logits": "#d6604d", "kv_cache": "#5aae61", "other": "#f4a582"}


def plot(csv_path: Path) -> Path:
    """The PNG next to ``csv_path``, from the CSV alone: components at each step's peak, and the step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = [r for r in harness.read_csv(csv_path) if r["phase"] == "step" and not r.get("error")]
    if not step:
        raise ValueError(f"{csv_path}: no measured configuration to plot")
    names = [f"{r['config']}\n{r['trainer']}" for r in step]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [2, 1]})
    ax, bottom = axes[0], [0.0] * len(step)
    for c in COMPONENTS:
        values = [float(r[f"{c}_mib"]) for r in step]
        ax.bar(names, values, bottom=bottom, color=COLORS[c], label=c)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(step):
        ax.text(i, bottom[i], f"{bottom[i]:.0f}\n({r['peak_phase']})", ha="center", va="bottom", fontsize=7)
    ax.set(ylabel="MiB alive at the step's peak", title="peak memory by component (tracked tensor storage)")
    ax.legend(fontsize=7, ncol=2)
    ax.margins(y=0.15)
    ax.tick_params(axis="x", labelsize=7)
    axes[1].barh(names, [float(r["median_ms"]) / 1e3 for r in step],
                 color=["#1b7837" if r["trainer"] == "grpo_fast" else "#2166ac" for r in step])
    axes[1].set(xlabel="seconds per step (median)", title="step time (a shared, loaded 2-core CPU)")
    axes[1].invert_yaxis()
    axes[1].tick_params(axis="y", labelsize=7)
    r0 = step[0]
    trl = next((r["trl"] for r in step if r.get("trl")), "not run")
    fig.suptitle(f"one GRPO step: {r0['model']}, B={r0['prompts']} G={r0['group_size']} P={r0['prompt_len']} "
                 f"T={r0['completion_len']}, float32\n{r0['device']}, torch {r0['torch']}, trl {trl}, "
                 f"bitsandbytes {r0['bitsandbytes']}, commit {r0['commit']}", fontsize=9)
    fig.tight_layout()
    png = Path(csv_path).with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------------------------------------------------
# Driver


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.bench_qlora", description=doc[0], epilog="\n\n".join(doc[1:]),
                                allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="NAME",
                   help=f"configurations, in order (default: all: {', '.join(CONFIGS)})")
    p.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS), metavar="NAME",
                   help="grpo_fast, trl (default: both)")
    for name, value in asdict(Shape()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help=f"(default {value})")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default 1)")
    p.add_argument("--reps", type=int, default=2, help="timed steps per process (default 2; median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per process (default 1800)")
    p.add_argument("--csv", type=Path, default=None,
                   help=f"output CSV (default {DEFAULT_DIR}/qlora_cpu.csv; the PNG goes next to it)")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from --csv")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    csv_path = args.csv or Path(DEFAULT_DIR) / "qlora_cpu.csv"
    if args.replot:
        print(f"plot: {plot(csv_path)}")
        return 0
    shape = Shape(**{k: getattr(args, k) for k in asdict(Shape())})
    shape.check()
    if args.reps < 1:
        raise ValueError(f"--reps: expected an integer >= 1, got {args.reps}")
    common = dict(model=f"Qwen2 L={shape.layers} H={shape.hidden} I={shape.intermediate} heads={shape.heads}/"
                        f"{shape.kv_heads} V={shape.vocab} tied", **asdict(shape), dtype="float32",
                  lora_alpha=LORA_ALPHA, bitsandbytes=harness.version("bitsandbytes"), peft=harness.version("peft"))
    print(f"QLoRA bench on {harness.device_name('cpu')}: {common['model']}, B={shape.prompts} G={shape.group_size} "
          f"P={shape.prompt_len} T={shape.completion_len}, {args.threads} thread(s)", flush=True)
    out = harness.CsvRows(csv_path)
    with tempfile.TemporaryDirectory(prefix="bench_qlora_") as tmp:
        model_dir = str(Path(tmp) / "model")
        save_model(shape, Path(model_dir), args.seed)
        for config in args.configs:
            for trainer in args.trainers:
                env = harness.env_fields("cpu")
                print(f"  {config:>10} {trainer:>9} ... ", end="", flush=True)
                t0, load_start = time.perf_counter(), os.getloadavg()[0]
                params = dict(config=config, shape=asdict(shape), model_dir=model_dir, reps=args.reps,
                              seed=args.seed, threads=args.threads)
                try:
                    r = harness.run_isolated(f"bench.bench_qlora:run_{trainer}", params, timeout=args.timeout,
                                             env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                except harness.IsolatedError as e:
                    r = dict(error=str(e))
                load = dict(load_avg_start=round(load_start, 2), load_avg_end=round(os.getloadavg()[0], 2))
                new = [dict(row, **load, **env) for row in result_rows(config, trainer, r, common)]
                for row in new:
                    out.add(row)
                last = new[-1]
                print(last.get("error") or f"peak {last['peak_mib']:.1f} MiB ({last['peak_phase']}), "
                      f"{last['median_ms'] / 1e3:.1f} s/step, load {load['load_avg_start']:.1f}/"
                      f"{load['load_avg_end']:.1f}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    rows = out.rows
    try:
        png = plot(csv_path) if any(r.get("peak_mib") for r in rows) else None
    except ImportError as e:
        png = f"not drawn ({e})"
    print()
    print(results_table(rows))
    print(f"\nCSV: {csv_path}" + (f"; plot: {png}" if png else ""))
    return 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
