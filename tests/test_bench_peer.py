"""bench/bench_peer.py: grpo-fast and TRL's GRPOTrainer on the same task, weights and settings; a tiny end-to-end run.

The option mapping's coverage is derived from the dataclasses (``TrainConfig``, ``GRPOLossConfig``, ``GRPOConfig``),
so a new field fails here until the bench maps it or says why it has no counterpart. The end-to-end test runs
``main`` (both trainers, each in a fresh process) for 2 steps of 2 prompts x 4 completions with a 16-prompt
evaluation, and checks the CSVs and the plot.
"""

import csv
import dataclasses
import math

import pytest
import torch

trl = pytest.importorskip("trl")

from bench import bench_peer  # noqa: E402
from grpo_fast.config import GRPOLossConfig, LossType  # noqa: E402
from grpo_fast.train.config import TRAINER_OWNED_LOSS_FIELDS, TrainConfig  # noqa: E402
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer  # noqa: E402

SCHEDULES = {"constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}  # TRL's -> ours
GRPO_FIELDS = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}


def _our_options() -> set[str]:
    """Every option of a run: TrainConfig's fields and, as loss.NAME, GRPOLossConfig's."""
    return ({f.name for f in dataclasses.fields(TrainConfig) if f.name != "loss"}
            | {f"loss.{f.name}" for f in dataclasses.fields(GRPOLossConfig)})


def test_every_option_is_mapped_or_explained():
    """A field added to TrainConfig or GRPOLossConfig fails here until bench_peer maps it or says why it cannot."""
    mapped, explained = set(bench_peer.COUNTERPARTS), set(bench_peer.NOT_MAPPED)
    assert not mapped & explained, mapped & explained
    assert mapped | explained == _our_options(), {"unclassified": _our_options() - mapped - explained,
                                                  "unknown": (mapped | explained) - _our_options()}


def test_options_named_like_grpo_config_fields_are_passed():
    """A field with a GRPOConfig namesake is mapped onto it; the only exceptions are the loss fields the trainer sets
    from other options (loss.temperature from temperature, loss.max_completion_length from max_new_tokens)."""
    unmapped = {name for name in _our_options() if name.removeprefix("loss.") in GRPO_FIELDS
                and name.removeprefix("loss.") not in bench_peer.COUNTERPARTS.get(name, ())}
    assert unmapped == {f"loss.{n}" for n in TRAINER_OWNED_LOSS_FIELDS if n in GRPO_FIELDS}, unmapped
    for name in unmapped:
        assert bench_peer.NOT_MAPPED[name].startswith("set by grpo-fast's trainer"), name


def test_trl_args_passes_every_counterpart():
    passed = bench_peer.trl_args(bench_peer.default_config(3, 0, "unused"), "out")
    named = {t for targets in bench_peer.COUNTERPARTS.values() for t in targets} | set(bench_peer.TRL_PINNED)
    assert named <= GRPO_FIELDS.keys(), named - GRPO_FIELDS.keys()
    assert named <= passed.keys(), named - passed.keys()
    assert passed.keys() <= GRPO_FIELDS.keys(), passed.keys() - GRPO_FIELDS.keys()
    # the pins are there because TRL's defaults differ from what grpo-fast does
    for name, value in bench_peer.TRL_PINNED.items():
        assert passed[name] == value, name


# every same-named option away from its default (and from TRL's), so a value that is not passed shows
OFF_DEFAULT = {
    "gradient_checkpointing": "true", "temperature": "0.7", "top_p": "0.9", "top_k": "5", "scale_rewards": "batch",
    "reward_weights": "0.5",
    "weight_decay": "0.01", "max_grad_norm": "0.5", "warmup_steps": "3", "disable_dropout": "true",
    "optim": "adamw_torch",
    "loss.loss_type": "grpo", "loss.beta": "0.1", "loss.epsilon": "0.3",
    "loss.epsilon_high": "0.28", "loss.delta": "1.5", "loss.importance_sampling_level": "sequence",
    "loss.use_bias_correction_kl": "false", "loss.sapo_temperature_pos": "0.9", "loss.sapo_temperature_neg": "1.1",
    "loss.vespo_k_pos": "2.5", "loss.vespo_lambda_pos": "3.5", "loss.vespo_k_neg": "3.5",
    "loss.vespo_lambda_neg": "2.5", "loss.top_entropy_quantile": "0.8", "loss.entropy_coef": "0.01",
    "vllm_gpu_memory_utilization": "0.5", "vllm_max_model_length": "48", "vllm_tensor_parallel_size": "2",
    "vllm_enable_sleep_mode": "true", "vllm_importance_sampling_correction": "false",
    "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": "0.5",
    "vllm_importance_sampling_clip_max": "2.0", "max_tool_calling_iterations": "3",
    "report_to": "tensorboard", "run_name": "peer", "project": "peer-project", "num_completions_to_print": "2",
}


def test_same_named_options_reach_grpo_config_with_their_values(tmp_path):
    """On the default config and on one with every same-named option changed: GRPOConfig holds our value, and in at
    least one of the two that value is not TRL's default (so a field left out would show)."""
    same = [n for n in bench_peer.COUNTERPARTS if n != "output_dir"  # TRL writes to its own directory
            and n.removeprefix("loss.") in bench_peer.COUNTERPARTS[n]]
    shown = set()
    for steps, seed, overrides in ((800, 0, {}), (7, 5, OFF_DEFAULT)):
        cfg = bench_peer.default_config(steps, seed, str(tmp_path), **overrides)
        args = trl.GRPOConfig(**bench_peer.trl_args(cfg, str(tmp_path / "trl")))
        for name in same:
            key = name.removeprefix("loss.")
            ours = getattr(cfg.loss, key) if name.startswith("loss.") else getattr(cfg, key)
            ours, theirs = getattr(ours, "value", ours), getattr(getattr(args, key), "value", getattr(args, key))
            if name == "reward_weights":  # ours: [] means all 1
                ours = ours or [1.0] * len(cfg.rewards)
            if name == "report_to":  # TRL holds report_to="none" as []
                ours = [] if ours == ["none"] else ours
            assert ours == theirs, (name, ours, theirs)
            if theirs != GRPO_FIELDS[key].default:
                shown.add(name)
    assert shown == set(same), set(same) - shown


@pytest.mark.parametrize("option", ["lora_r=4", "system_prompt=hi", "prompt_column=question", "device=auto",
                                    "token_mean=generation"])
def test_options_trl_cannot_reproduce_are_refused(option):
    name, value = option.split("=")
    with pytest.raises(ValueError, match=name):
        bench_peer.trl_args(bench_peer.default_config(3, 0, "unused", **{name: value}), "out")


@pytest.mark.parametrize("loss_type", [t.value for t in LossType if not t.in_trl])
def test_loss_types_trl_lacks_are_refused(loss_type):
    extra = {"loss.dro_beta": 0.1} if loss_type == "dro" else {}
    cfg = bench_peer.default_config(3, 0, "unused", **{"loss.loss_type": loss_type}, **extra)
    with pytest.raises(ValueError, match=f"loss_type={loss_type!r} is not one of TRL"):
        bench_peer.trl_args(cfg, "out")


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_learning_rate_schedule_is_transformers(schedule):
    """grpo-fast's warm-up and schedule are the ones TRL's Trainer builds (``transformers.get_scheduler``): update
    k < warmup uses k / warmup of the learning rate, the first update lr 0."""
    from transformers import get_scheduler

    from grpo_fast.train.model import lr_scheduler

    cfg = bench_peer.default_config(20, 0, "unused", warmup_steps=4, lr_schedule=schedule)

    def rates(make) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler, out = make(optimizer), []
        for _ in range(20):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    ours = rates(lambda optimizer: lr_scheduler(optimizer, cfg, cfg.steps))
    theirs = rates(lambda optimizer: get_scheduler(bench_peer.SCHEDULES[schedule], optimizer, num_warmup_steps=4,
                                                   num_training_steps=20))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0)
    assert ours[0] == 0.0 and ours[3] == 0.75 and ours[4] == 1.0
TINY = {"prompts_per_step": "2", "group_size": "4", "micro_batch_size": "4", "eval_size": "16"}


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peer")
    cfg = bench_peer.default_config(3, 0, str(tmp / "gf"))
    model_dir = bench_peer.save_initial_model(tmp / "model", cfg.seed)
    return cfg, bench_peer.build_trl_trainer(cfg, model_dir, str(tmp / "trl"))


def test_both_trainers_start_from_identical_weights(trl_trainer, tmp_path):
    from grpo_fast.train.trainer import setup

    cfg, trainer = trl_trainer
    ours = setup(bench_peer.default_config(3, 0, str(tmp_path))).model.state_dict()
    reference = tiny_model(tiny_tokenizer(), 0).state_dict()
    theirs = trainer.model.state_dict()
    assert ours.keys() == theirs.keys() == reference.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
        assert torch.equal(ours[name], reference[name]), name


def test_trl_config_matches_ours(trl_trainer):
    cfg, trainer = trl_trainer
    args, gen = trainer.args, trainer.generation_config
    rows = cfg.prompts_per_step * cfg.group_size
    compared = {
        "group size": (cfg.group_size, args.num_generations),
        "completions per generation": (rows, args.generation_batch_size),
        "micro-batch": (cfg.micro_batch_size, args.per_device_train_batch_size),
        "one generation per optimizer step": (args.gradient_accumulation_steps, args.steps_per_generation),
        "mu / num_iterations": (cfg.mu, args.num_iterations),
        "max completion length": (cfg.max_new_tokens, args.max_completion_length),
        "sampling temperature": (cfg.temperature, gen.temperature),
        "top_p": (cfg.top_p, gen.top_p),
        "top_k": (cfg.top_k, gen.top_k),
        "do_sample": (True, gen.do_sample),
        "loss type": (cfg.loss.loss_type.value, trainer.loss_type),
        "beta": (cfg.loss.beta, trainer.beta),
        "epsilon low": (cfg.loss.epsilon, trainer.epsilon_low),
        "epsilon high": (cfg.loss.eps_high, trainer.epsilon_high),
        "loss temperature": (cfg.temperature, trainer.temperature),
        "scale rewards": (cfg.scale_rewards, args.scale_rewards),
        "learning rate": (5e-4, args.learning_rate),
        "adam betas": (tuple(cfg.adam_betas), (args.adam_beta1, args.adam_beta2)),
        "weight decay": (cfg.weight_decay, args.weight_decay),
        "max grad norm": (cfg.max_grad_norm, args.max_grad_norm),
        "warm-up steps": (cfg.warmup_steps, args.warmup_steps),
        "schedule after warm-up": (cfg.lr_schedule, SCHEDULES.get(getattr(args.lr_scheduler_type, "value", None))),
        "bias-corrected KL": (cfg.loss.use_bias_correction_kl, args.use_bias_correction_kl),
        "gradient checkpointing": (cfg.gradient_checkpointing,
                                   getattr(args, "activation_checkpointing", args.gradient_checkpointing)),
        "dropout off": (cfg.disable_dropout, args.disable_dropout),
        "optimizer updates": (cfg.steps * cfg.mu, args.max_steps),
        "seed": (cfg.seed, args.seed),
        "fp32": (False, args.bf16 or args.fp16),
        "no vLLM": (False, trainer.use_vllm),
    }
    mismatched = {k: v for k, v in compared.items() if v[0] != v[1]}
    assert not mismatched, mismatched
    assert args.gradient_accumulation_steps * args.per_device_train_batch_size == rows
    assert trainer.model.dtype == torch.float32 and trainer.model.device.type == "cpu"


def test_end_to_end_tiny_run(tmp_path, capsys):
    out = tmp_path / "peer.csv"
    rc = bench_peer.main(["--steps", "2", "--seeds", "0", "--out", str(out), "--set",
                          *(f"{k}={v}" for k, v in TINY.items())])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    with open(out, newline="") as f:
        rows = {r["trainer"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"grpo_fast", "trl"}
    for name, row in rows.items():
        assert row["error"] == "" and row["steps"] == "2", row
        for key in ("median_step_ms", "total_train_s", "peak_rss_mib", "eval_before", "eval_after",
                    "final_reward_avg", "load_avg_start", "load_avg_end"):
            assert math.isfinite(float(row[key])), (name, key, row[key])
        assert float(row["median_step_ms"]) > 0 and float(row["peak_rss_mib"]) > 100
    # same initial weights, same greedy evaluation: the same held-out reward before training
    assert rows["grpo_fast"]["eval_before"] == rows["trl"]["eval_before"]
    with open(bench_peer.curve_path(out), newline="") as f:
        curve = list(csv.DictReader(f))
    assert [(r["seed"], r["trainer"], r["step"]) for r in curve] == [("0", t, s) for t in ("grpo_fast", "trl")
                                                                     for s in ("1", "2")]
    assert all(0.0 <= float(r["reward"]) <= 1.0 and float(r["step_ms"]) > 0 for r in curve)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| 0 | grpo_fast | 2 |" in printed and "| 0 | trl | 2 |" in printed
    assert "n=1)" in printed  # the seeds' table
    # --keep: the finished runs stay, only the missing pair runs
    before = out.read_text()
    rc = bench_peer.main(["--steps", "2", "--seeds", "0", "--trainers", "trl", "--keep", "--out", str(out), "--set",
                          *(f"{k}={v}" for k, v in TINY.items())])
    assert rc == 0 and out.read_text() == before and "kept from" in capsys.readouterr().out


@pytest.mark.slow
def test_paired_runs_share_their_random_stream(tmp_path, capsys):
    """--paired: TRL gets grpo-fast's prompt order and per-step sampling seeds, and the two trainers, which compute
    the same updates (tests/test_lockstep_trl.py), then sample the same completions and log the same reward at every
    step of a run whose rewards are not all 0 (a task and a seed where some groups score)."""
    out = tmp_path / "paired.csv"
    options = {**TINY, "dataset": "builtin:median", "rewards": "exact", "prompts_per_step": "8", "group_size": "8"}
    rc = bench_peer.main(["--steps", "6", "--seeds", "0", "--paired", "--out", str(out), "--set",
                          *(f"{k}={v}" for k, v in options.items())])
    assert rc == 0, capsys.readouterr().out
    with open(bench_peer.curve_path(out), newline="") as f:
        curve = list(csv.DictReader(f))
    rewards = {t: [float(r["reward"]) for r in curve if r["trainer"] == t] for t in ("grpo_fast", "trl")}
    assert len(rewards["trl"]) == 6 and rewards["grpo_fast"] == rewards["trl"], rewards
    assert any(r > 0 for r in rewards["trl"])  # the comparison sees scored samples, not only zeros
    with open(out, newline="") as f:
        assert {r["paired"] for r in csv.DictReader(f)} == {"True"}
