"""bench/bench_peer.py: grpo-fast and TRL's GRPOTrainer on the same task, weights and settings; a tiny end-to-end run.

The end-to-end test runs ``main`` (both trainers, each in a fresh process) for 2 steps of 2 prompts x 4 completions
with a 16-prompt evaluation, and checks the CSVs and the plot.
"""

import csv
import math

import pytest
import torch

pytest.importorskip("trl")

from bench import bench_peer  # noqa: E402
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer  # noqa: E402

SCHEDULES = {"constant_with_warmup": "constant"}  # TRL's lr_scheduler_type -> our lr_schedule
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
        "steps": (cfg.steps, args.max_steps),
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
    rc = bench_peer.main(["--steps", "2", "--out", str(out), "--set", *(f"{k}={v}" for k, v in TINY.items())])
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
    assert [(r["trainer"], r["step"]) for r in curve] == [(t, s) for t in ("grpo_fast", "trl") for s in ("1", "2")]
    assert all(0.0 <= float(r["reward"]) <= 1.0 and float(r["step_ms"]) > 0 for r in curve)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| grpo_fast | 2 |" in printed and "| trl | 2 |" in printed
