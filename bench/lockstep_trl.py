"""Lockstep: grpo-fast's training loop and TRL's ``GRPOTrainer`` fed the same rollouts, compared quantity by quantity.

Part 1 (``lockstep``): both start from the same saved weights with the same options (``bench_peer.trl_args``: every
option passed explicitly). TRL trains ``--steps`` steps, sampling its own completions; every step's prompts, token
ids, masks, position ids, rewards, advantages, per-token log-probs (policy, reference), loss, gradient, learning rate
and parameters are recorded. grpo-fast's ``train_step`` then runs the same steps with TRL's prompts in TRL's order and
TRL's sampled completions injected in place of its own rollout, and every quantity is compared in the order the step
computes them. The report names the first quantity that differs beyond float tolerance.

Part 2 (``sampling``): each side samples with its own procedure from the same weights and the same fixed prompt:
TRL's ``model.generate(generation_config=trainer.generation_config)`` and grpo-fast's ``rollout.generate``, many
first tokens each. Both frequency tables are tested against the exact next-token distribution (chi-square goodness of
fit) and against each other (chi-square homogeneity), and the two trainers' position ids for the prefill are
compared.

    python -m bench.lockstep_trl                          # 4 steps of the default run's options, then the sampling test
    python -m bench.lockstep_trl --set shared_prefix=off  # the same without grpo-fast's shared-prompt forward
    python -m bench.lockstep_trl --set loss.loss_type=grpo --steps 3 --samples 20000

tests/test_lockstep_trl.py runs a reduced lockstep (a few steps, few prompts) so that a change that breaks equality
with TRL's loop fails a test.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):  # run as a script: python bench/lockstep_trl.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import bench_peer

# Float tolerance of a compared quantity: both sides compute in float32 with different reduction orders (TRL's fused
# LM head vs grpo-fast's kernels, TRL's micro-batch order vs grpo-fast's), so values agree to a few ulps of their
# magnitude; atol covers values near zero. Parameters are compared after Adam, which divides by sqrt(v) and so
# amplifies the gradients' rounding where a gradient is near zero: in units of the update's learning rate.
RTOL, ATOL = 1e-4, 1e-5
PARAM_TOL_LR = 1e-2  # a parameter may differ by at most this fraction of the step's learning rate

# the lockstep's default run: the default task and options, fewer prompts per step so that a step is quick
LOCKSTEP_DEFAULTS = {"prompts_per_step": 8, "group_size": 8, "micro_batch_size": 32, "threads": 1, "lr": 5e-4}


# --------------------------------------------------------------------------------------------------------------------
# Recording


@dataclass
class Update:
    """One optimizer update: the loss summed over its micro-batches, the gradient norm before clipping, the
    gradients after it, the learning rate, the parameters after the step, the policy's per-token log-probs."""

    scalars: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    policy_logps: torch.Tensor | None = None


@dataclass
class Step:
    """What one side computed for one generation (rows in TRL's generation order) and its ``mu`` updates."""

    records: list = field(default_factory=list)  # one per prompt, in order
    tensors: dict = field(default_factory=dict)  # name -> tensor
    positions: dict = field(default_factory=dict)  # phase -> position ids on real tokens (absolute, relative)
    updates: list = field(default_factory=list)
    pending: Update = field(default_factory=Update)  # the update being accumulated


def _clone(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class DecoderPositions:
    """Records the position ids each forward of ``model``'s decoder runs with (its own default when none is given:
    ``arange`` over the sequence, what transformers' decoders use), tagged with the phase set by :func:`phase`."""

    def __init__(self, model):
        from grpo_fast.train.forward import decoder_of

        self.phase = "other"
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        self._handle = decoder_of(model).register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        if positions is None:
            past = kwargs.get("past_key_values") or kwargs.get("cache")
            start = past.get_seq_length() if past is not None else 0
            positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
        self.calls.append((self.phase, positions.detach().clone(), _clone(kwargs.get("attention_mask"))))

    def take(self, phase: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The recorded (positions, 2-D attention mask) of ``phase``'s calls, removed from the record (a call without
        a 2-D mask, e.g. generation's prefill of prompts without padding, counts every token)."""
        taken = [(p, m if m is not None and m.dim() == 2 else torch.ones_like(p)) for ph, p, m in self.calls
                 if ph == phase]
        self.calls = [c for c in self.calls if c[0] != phase]
        return taken

    def close(self):
        self._handle.remove()


def relative_positions(positions: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's position ids on its real (mask 1) tokens, less the row's first: rotary attention depends only on
    these, so two forwards that agree on them compute the same function."""
    rows = []
    for p, m in zip(positions, mask.bool()):
        real = p[m]
        rows.append(tuple((real - real[0]).tolist()) if real.numel() else ())
    return rows


def absolute_positions(positions: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(p[m].tolist()) for p, m in zip(positions, mask.bool())]


@contextlib.contextmanager
def phase(positions: DecoderPositions, name: str):
    before, positions.phase = positions.phase, name
    try:
        yield
    finally:
        positions.phase = before


def record_trl(trainer, generations: int, keep_order: bool = False) -> list[Step]:
    """Trains ``trainer`` (TRL's GRPOTrainer) for ``generations`` generations (``num_iterations`` optimizer steps
    each) and returns what each computed. Instance methods are wrapped; the generation batch gets a row-index column
    that TRL's shuffle and split carry into each micro-batch. ``keep_order``: TRL's shuffle of the generation before
    it is split into micro-batches is turned off (the only global patch), so its micro-batches hold the rows
    grpo-fast's do, for the losses whose value depends on the split (:func:`split_dependent`)."""
    import trl.trainer.grpo_trainer as grpo_module
    from transformers import TrainerCallback

    out: list[Step] = []
    positions = DecoderPositions(trainer.model)
    original = {name: getattr(trainer, name) for name in ("_generate_and_score_completions", "_calculate_rewards",
                                                           "_get_per_token_logps_and_entropies", "compute_loss",
                                                           "_generate")}

    def generate_and_score(inputs):
        step = Step()
        out.append(step)
        G = trainer.num_generations
        step.records = [dict(r) for r in inputs[::G]]
        result = original["_generate_and_score_completions"](inputs)
        for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                  "ref_per_token_logps", "old_per_token_logps", "tool_mask"):
            if result.get(k) is not None:
                step.tensors[k] = _clone(result[k])
        step.tensors["num_items_in_batch"] = _clone(result["num_items_in_batch"])
        result["_row"] = torch.arange(result["prompt_ids"].shape[0])  # carried through TRL's shuffle and split
        return result

    def generate(prompts):
        with phase(positions, "generate"):
            result = original["_generate"](prompts)
        taken = positions.take("generate")
        if not taken:  # a rollout_func made the completions: TRL ran no prefill
            return result
        prefill, mask = taken[0]
        G = trainer.num_generations
        out[-1].positions["generate"] = (absolute_positions(prefill[::G], mask[::G]),
                                         relative_positions(prefill[::G], mask[::G]))
        return result

    def calculate_rewards(inputs, prompts, completions, completion_ids_list):
        rewards = original["_calculate_rewards"](inputs, prompts, completions, completion_ids_list)
        out[-1].tensors["rewards"] = _clone(rewards)
        return rewards

    def logps_and_entropies(model, input_ids, *args, **kwargs):
        name = "train" if torch.is_grad_enabled() else ("reference" if model is trainer.ref_model else "old")
        with phase(positions, name):
            logps, entropies, aux = original["_get_per_token_logps_and_entropies"](model, input_ids, *args, **kwargs)
        if name == "train":
            current["logps"] = logps.detach().float()
        return logps, entropies, aux

    current: dict = {}

    def compute_loss(model, inputs, *args, **kwargs):
        loss = original["compute_loss"](model, inputs, *args, **kwargs)
        step, rows = out[-1], inputs["_row"]
        (used, mask), = positions.take("train")
        if not step.updates:
            train = step.positions.setdefault("train", {})
            for row, a, r in zip(rows.tolist(), absolute_positions(used, mask), relative_positions(used, mask)):
                train[row] = (a, r)
        update = step.pending
        if update.policy_logps is None:
            update.policy_logps = torch.zeros(step.tensors["completion_ids"].shape)
        update.policy_logps.index_copy_(0, rows, current.pop("logps"))
        update.scalars["loss"] = update.scalars.get("loss", 0.0) + float(loss.detach())
        return loss

    class Updates(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            update = out[-1].pending
            update.scalars["lr"] = trainer.optimizer.param_groups[0]["lr"]
            update.grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                            if p.grad is not None}

        def on_step_end(self, args, state, control, **kwargs):
            step = out[-1]
            step.pending.params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            step.updates.append(step.pending)
            step.pending = Update()

    for name, fn in (("_generate_and_score_completions", generate_and_score), ("_calculate_rewards", calculate_rewards),
                     ("_get_per_token_logps_and_entropies", logps_and_entropies), ("compute_loss", compute_loss),
                     ("_generate", generate)):
        setattr(trainer, name, fn)
    trainer.add_callback(Updates())
    try:
        assert trainer.args.max_steps == generations * trainer.num_iterations, trainer.args.max_steps
        with (mock.patch.object(grpo_module, "shuffle_sequence_dict", lambda batch: batch) if keep_order
              else contextlib.nullcontext()):
            trainer.train()
    finally:
        for name in original:
            delattr(trainer, name)
        positions.close()
    history = [h for h in trainer.state.log_history if "grad_norm" in h]
    for update, h in zip((u for step in out for u in step.updates), history):
        update.scalars["grad_norm"] = float(h["grad_norm"])
    return out


def replay_grpo_fast(run, trl_steps: list[Step], train_tool_tokens: bool = False) -> list[Step]:
    """Runs grpo-fast's ``train_step`` once per TRL generation, with TRL's prompts (in TRL's order) and TRL's sampled
    completions injected in place of its own rollout; returns what each step computed. A TRL rollout with a tool mask
    is replayed as a multi-turn rollout (``Rollout.loss_mask``); ``train_tool_tokens`` plants the bug the comparison
    must catch: the loss mask left out, so the tool tokens are trained."""
    from grpo_fast.train import trainer as T
    from grpo_fast.train.rollout import Rollout, SamplingParams, encode_prompts, generate

    out: list[Step] = []
    positions = DecoderPositions(run.model)
    current: dict = {}

    def injected_rollout(run_, records, group_size, params, first_chunk=0, engine=None):
        t = current["trl"].tensors
        # grpo-fast's own prompt encoding and generation positions, recorded next to TRL's
        ids, mask = encode_prompts(run_, records)
        out[-1].tensors["own_prompt_ids"], out[-1].tensors["own_prompt_mask"] = ids, mask
        with phase(positions, "generate"), torch.no_grad():
            run_.policy(generate, ids, mask, 1, SamplingParams(1, 1.0), eos_token_id=0,
                        pad_token_id=run_.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
        prefill, _ = positions.take("generate")[0]
        out[-1].positions["generate"] = (absolute_positions(prefill, mask), relative_positions(prefill, mask))
        tool_mask = t.get("tool_mask")
        loss_mask = None if tool_mask is None or train_tool_tokens else t["completion_mask"] * tool_mask
        ro = Rollout(prompt_ids=t["prompt_ids"], prompt_mask=t["prompt_mask"], completion_ids=t["completion_ids"],
                     completion_mask=t["completion_mask"], sampling_logps=torch.zeros(t["completion_ids"].shape),
                     group_size=group_size, loss_mask=loss_mask)
        texts = run_.tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)
        return ro, texts

    def score(run_, records, completions, group_size, environments=None):
        rewards = original["score"](run_, records, completions, group_size, environments)
        out[-1].tensors["rewards"] = rewards.clone()
        return rewards

    def advantages(*args, **kwargs):
        result = original["group_advantages"](*args, **kwargs)
        out[-1].tensors["advantages"] = result.advantages.clone()
        return result

    def reference(run_, ro):
        with phase(positions, "reference"):
            logps = original["reference_logprobs"](run_, ro)
        out[-1].tensors["ref_per_token_logps"] = logps.clone()
        return logps

    def old(run_, policy, ro):
        logps = original["logprobs_of"](run_, policy, ro)
        if policy is run_.policy and run_.config.mu > 1 and "old_per_token_logps" not in out[-1].tensors:
            out[-1].tensors["old_per_token_logps"] = logps.clone()
        return logps

    def micro_batch_loss(model, run_, ro, rows, pcols, tcols, *args):
        with phase(positions, "train"):
            loss, result, share = original["_micro_batch_loss"](model, run_, ro, rows, pcols, tcols, *args)
        step = out[-1]
        (used, _), = positions.take("train")
        if not step.updates:
            mask = torch.cat([ro.prompt_mask[rows, pcols], ro.completion_mask[rows, tcols]], dim=1)
            if run_.shared_prefix_active:  # [groups, P + G*T]: one prompt, then the group's G completions
                G, P, Tn = ro.group_size, ro.prompt_ids[rows, pcols].shape[1], ro.completion_ids[rows, tcols].shape[1]
                used = torch.cat([used[:, :P].repeat_interleave(G, 0), used[:, P:].reshape(-1, Tn)], dim=1)
            train = step.positions.setdefault("train", {})
            first = range(ro.completion_ids.shape[0])[rows].start
            for i, (a, r) in enumerate(zip(absolute_positions(used, mask), relative_positions(used, mask))):
                train[first + i] = (a, r)
        update = step.pending
        if update.policy_logps is None:
            update.policy_logps = torch.zeros(ro.completion_ids.shape)
        update.policy_logps[rows, tcols] = result.per_token_logps.detach().float()
        update.scalars["loss"] = update.scalars.get("loss", 0.0) + float(loss.detach())
        return loss, result, share

    def policy_update(run_, *args):
        sums = original["policy_update"](run_, *args)
        step = out[-1]
        step.pending.scalars["grad_norm"] = sums["grad_norm"]
        step.pending.params = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        step.updates.append(step.pending)
        step.pending = Update()
        return sums

    def before_update(optimizer, args, kwargs):
        update = out[-1].pending
        update.scalars["lr"] = optimizer.param_groups[0]["lr"]
        update.grads = {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}

    wrappers = {"rollout": injected_rollout, "score": score, "group_advantages": advantages,
                "reference_logprobs": reference, "logprobs_of": old, "_micro_batch_loss": micro_batch_loss,
                "policy_update": policy_update}
    original = {name: getattr(T, name) for name in wrappers}
    handle = run.optimizer.register_step_pre_hook(before_update)
    try:
        with contextlib.ExitStack() as stack:
            for name, fn in wrappers.items():
                stack.enter_context(mock.patch.object(T, name, fn))
            for trl_step in trl_steps:
                current["trl"] = trl_step
                out.append(Step(records=trl_step.records))
                with mock.patch.object(run.sampler, "next_batch", lambda: list(trl_step.records)):
                    T.train_step(run)
    finally:
        handle.remove()
        positions.close()
    return out


# --------------------------------------------------------------------------------------------------------------------
# Comparison


@dataclass
class Row:
    step: int
    quantity: str
    diff: float  # max |grpo-fast - TRL| (or 0/1 for exact comparisons)
    tolerance: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.diff <= self.tolerance


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    d = (a - b).abs()
    if mask is not None:
        d = d * mask
    return float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0


def _tol(x: torch.Tensor | float) -> float:
    scale = float(x.detach().abs().max()) if isinstance(x, torch.Tensor) and x.numel() else abs(float(x))
    return ATOL + RTOL * scale


def compare(trl_steps: list[Step], ours: list[Step], tokenizer) -> list[Row]:
    rows: list[Row] = []
    for k, (t, o) in enumerate(zip(trl_steps, ours), start=1):
        G = t.tensors["prompt_ids"].shape[0] // len(t.records)
        # prompts: grpo-fast's own encoding of the same records against TRL's
        tp, tm = t.tensors["prompt_ids"][::G], t.tensors["prompt_mask"][::G]
        op, om = o.tensors["own_prompt_ids"], o.tensors["own_prompt_mask"]
        same = op.shape == tp.shape and torch.equal(op, tp) and torch.equal(om.long(), tm.long())
        rows.append(Row(k, "prompt token ids and attention mask", 0.0 if same else 1.0, 0.0,
                        f"[{tp.shape[0]} x {tp.shape[1]}] left-padded"))
        for name, what in (("generate", "position ids in generation (prompt prefill)"),
                           ("train", "position ids in the training forward")):
            tpos, opos = t.positions.get(name), o.positions.get(name)
            if tpos is None:  # TRL's completions came from a rollout_func: no prefill of its own to compare
                continue
            if name == "train":  # row -> (absolute, relative): in row order
                tpos, opos = ([list(zip(*(d[i] for i in sorted(d)))) for d in (tpos, opos)])
            relative_same = tpos[1] == opos[1]
            absolute_same = tpos[0] == opos[0]
            note = ("identical" if absolute_same else "the same relative to each row's first real token (what rotary "
                    "attention depends on); absolute positions differ: TRL's count the left padding")
            rows.append(Row(k, what, 0.0 if relative_same else 1.0, 0.0, note if relative_same else
                            "relative positions differ"))
        # completions: TRL's, injected; grpo-fast's stop rule on TRL's tokens must give TRL's mask
        cm = t.tensors["completion_mask"]
        ids = t.tensors["completion_ids"]
        eos = torch.isin(ids, torch.tensor([tokenizer.eos_token_id]))
        our_mask = (torch.cumsum(eos.long(), 1) - eos.long() == 0).long()  # up to and including the first EOS
        if t.positions.get("generate") is not None:  # scripted completions (rollout_func) were cut, not stopped
            rows.append(Row(k, "completion mask (grpo-fast's stop rule on TRL's tokens)",
                            float((our_mask != cm.long()).sum()), 0.0, "EOS kept in the mask, nothing after it"))
        if "tool_mask" in t.tensors:
            trained = cm.long() * t.tensors["tool_mask"].long()
            rows.append(Row(k, "trained tokens (TRL's completion_mask x tool_mask)", float(trained.sum()), math.inf,
                            f"{int(cm.sum()) - int(trained.sum())} tool tokens of {int(cm.sum())} masked out"))
        rows.append(Row(k, "rewards", _diff(o.tensors["rewards"], t.tensors["rewards"]), 0.0))
        rows.append(Row(k, "advantages", _diff(o.tensors["advantages"], t.tensors["advantages"]),
                        _tol(t.tensors["advantages"])))
        mask = cm.double()
        if "ref_per_token_logps" in t.tensors:
            rows.append(Row(k, "reference per-token log-probs",
                            _diff(o.tensors["ref_per_token_logps"], t.tensors["ref_per_token_logps"], mask),
                            _tol(t.tensors["ref_per_token_logps"] * mask)))
        if "old_per_token_logps" in t.tensors or "old_per_token_logps" in o.tensors:
            told, oold = t.tensors.get("old_per_token_logps"), o.tensors.get("old_per_token_logps")
            rows.append(Row(k, "old per-token log-probs", math.inf if told is None or oold is None else
                            _diff(oold, told, mask), 0.0 if told is None else _tol(told * mask)))
        if len(o.updates) != len(t.updates):
            rows.append(Row(k, "optimizer updates per generation", abs(len(o.updates) - len(t.updates)), 0))
        for u, (tu, ou) in enumerate(zip(t.updates, o.updates), start=1):
            at = f" (update {u})" if len(t.updates) > 1 else ""
            rows.append(Row(k, "policy per-token log-probs (training forward)" + at,
                            _diff(ou.policy_logps, tu.policy_logps, mask), _tol(tu.policy_logps * mask)))
            rows.append(Row(k, "loss (sum over micro-batches)" + at, abs(ou.scalars["loss"] - tu.scalars["loss"]),
                            _tol(tu.scalars["loss"])))
            rows.append(Row(k, "gradient norm (before clipping)" + at,
                            abs(ou.scalars["grad_norm"] - tu.scalars["grad_norm"]), _tol(tu.scalars["grad_norm"])))
            missing = set(tu.grads) ^ set(ou.grads)
            worst = max(tu.grads, key=lambda n: _diff(ou.grads[n], tu.grads[n]) / _tol(tu.grads[n])
                        if n in ou.grads else math.inf)
            rows.append(Row(k, "gradients (after clipping), worst parameter" + at,
                            math.inf if missing else _diff(ou.grads[worst], tu.grads[worst]), _tol(tu.grads[worst]),
                            f"{worst}" + (f"; only one side has {sorted(missing)}" if missing else "")))
            rows.append(Row(k, "learning rate of the update" + at, abs(ou.scalars["lr"] - tu.scalars["lr"]), 1e-12))
            lr = max(tu.scalars["lr"], 1e-12)
            worst = max(tu.params, key=lambda n: _diff(ou.params[n], tu.params[n]))
            rows.append(Row(k, "parameters after the update, worst (in units of the step's lr)" + at,
                            _diff(ou.params[worst], tu.params[worst]) / lr, PARAM_TOL_LR, worst))
    return rows


def first_difference(rows: list[Row]) -> Row | None:
    return next((r for r in rows if not r.ok), None)


# --------------------------------------------------------------------------------------------------------------------
# Part 1 driver


def split_dependent(cfg) -> bool:
    """Whether the loss depends on which rows share a micro-batch: bnpo's and the entropy bonus's per-micro-batch
    token means (``token_mean="micro_batch"``, TRL's). TRL shuffles the generation before splitting it, grpo-fast
    keeps each group's rows together (its shared-prompt forward needs whole groups): the lockstep then turns TRL's
    shuffle off, so that both apply their formula to the same micro-batches."""
    return cfg.token_mean == "micro_batch" and (cfg.loss.loss_type.value == "bnpo" or cfg.loss.entropy_coef != 0.0)


def lockstep(steps: int = 4, seed: int = 0, overrides: dict | None = None, tool_turns: bool = False,
             train_tool_tokens: bool = False) -> list[Row]:
    """Both trainers from the same saved weights and options; TRL's rollouts replayed through grpo-fast's loop.

    ``tool_turns``: TRL's rollouts are multi-turn ones, from a ``rollout_func`` (:func:`tool_rollout`) whose
    completions hold tool spans that TRL's ``env_mask`` (its ``tool_mask``) hides from the loss, scored by
    :func:`varied_reward`; grpo-fast replays them with the same loss mask (``train_tool_tokens``: without it, the bug
    the comparison must catch)."""
    from grpo_fast.train.trainer import setup

    values = {**LOCKSTEP_DEFAULTS, **(overrides or {})}
    if tool_turns:
        values.setdefault("rewards", "bench.lockstep_trl:varied_reward")
    torch.set_num_threads(int(values["threads"]))
    with tempfile.TemporaryDirectory(prefix="lockstep_") as tmp:
        model_dir = bench_peer.save_initial_model(Path(tmp) / "model", seed)
        cfg = bench_peer.default_config(steps, seed, str(Path(tmp) / "grpo_fast"), **values)
        extra = {"rollout_func": tool_rollout(cfg.max_new_tokens, seed)} if tool_turns else {}
        trainer = bench_peer.build_trl_trainer(cfg, model_dir, str(Path(tmp) / "trl"), **extra)
        trl_steps = record_trl(trainer, steps, keep_order=split_dependent(cfg))
        run = setup(bench_peer.default_config(steps, seed, str(Path(tmp) / "grpo_fast"), **values, model=model_dir))
        ours = replay_grpo_fast(run, trl_steps, train_tool_tokens)
        return compare(trl_steps, ours, run.tokenizer)


def varied_reward(prompts, completions, **kwargs):
    """A reward that varies within a group whatever the tokens (distinct characters, mod 3), so that scripted
    completions give non-zero advantages."""
    return [float(len(set(c)) % 3) for c in completions]


def tool_rollout(max_completion_length: int, seed: int = 0):
    """A TRL ``rollout_func`` of scripted multi-turn completions: per prompt, a length in [2, max], random word ids,
    about half ending in EOS (id 1) when shorter than the maximum, and one or two contiguous tool spans (``env_mask``
    0) after the first token, as tool results sit between the model's turns. Build one per trainer: the call counter
    is part of the seed."""
    calls = iter(range(1 << 62))

    def rollout(prompts, trainer):
        gen = torch.Generator().manual_seed(seed * 100_003 + next(calls))
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completion_ids, masks = [], []
        for _ in prompts:
            n = int(torch.randint(2, max_completion_length + 1, (1,), generator=gen))
            ids = torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()
            if n < max_completion_length and bool(torch.rand((), generator=gen) < 0.5):
                ids[-1] = tokenizer.eos_token_id
            mask = [1] * n
            for _ in range(int(torch.randint(1, 3, (1,), generator=gen))):
                start = int(torch.randint(1, n, (1,), generator=gen))
                length = int(torch.randint(1, max(2, n // 3), (1,), generator=gen))
                mask[start : start + length] = [0] * len(mask[start : start + length])
            completion_ids.append(ids)
            masks.append(mask)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": masks}

    return rollout


# --------------------------------------------------------------------------------------------------------------------
# Part 2: each side's own sampling


def _pearson(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square of count rows ``observed [k, n]`` against ``expected [n]``, bins with an expected count
    below 5 merged into one; returns (statistic, degrees of freedom, p-value)."""
    observed, expected = observed.double(), expected.double()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[:, ~small], observed[:, small].sum(1, keepdim=True)], dim=1)
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    observed, expected = observed[:, keep], expected[keep]
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0)))
    return stat, dof, p


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int, float]:
    """Goodness of fit of counts ``observed`` to ``expected`` (same total): :func:`_pearson`."""
    return _pearson(observed[None], expected)


def homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, float]:
    """Chi-square test that two count vectors come from one distribution (equal totals): each against the pooled
    frequencies (:func:`_pearson`)."""
    return _pearson(torch.stack([a, b]), (a + b).double() / 2)


def sampling(samples: int = 20000, seed: int = 0, overrides: dict | None = None, prompt_index: int = 0,
             model: str | None = None) -> dict:
    """Each trainer's own sampling of one fixed prompt from the same weights (the seed's initial tiny model, or the
    ``save_pretrained`` directory ``model``, e.g. a trained run's ``model/`` whose distributions are peaked): TRL's
    ``model.generate`` with ``trainer.generation_config``, grpo-fast's ``rollout.generate``.

    - from the same torch RNG state (TRL's global generator and grpo-fast's ``generator`` seeded alike), whole
      completions of ``max_new_tokens``: the fraction of rows that are identical;
    - from independent streams, ``samples`` first tokens each: chi-square goodness of fit of each against the exact
      next-token distribution (``softmax`` of the temperature-scaled, top-k/top-p filtered logits), and homogeneity
      of the two frequency tables.
    """
    from grpo_fast.train.rollout import SamplingParams, encode_prompts, eos_token_ids, filter_logits, generate
    from grpo_fast.train.trainer import setup

    values = {**LOCKSTEP_DEFAULTS, **(overrides or {})}
    torch.set_num_threads(int(values["threads"]))
    batch = 2000
    with tempfile.TemporaryDirectory(prefix="lockstep_") as tmp:
        model_dir = model or bench_peer.save_initial_model(Path(tmp) / "model", seed)
        cfg = bench_peer.default_config(1, seed, str(Path(tmp) / "grpo_fast"), **values)
        trainer = bench_peer.build_trl_trainer(cfg, model_dir, str(Path(tmp) / "trl"))
        run = setup(bench_peer.default_config(1, seed, str(Path(tmp) / "grpo_fast"), **values, model=model_dir))
        record = run.sampler.records[prompt_index]
        ids, mask = encode_prompts(run, [record])
        V, P = len(run.tokenizer), ids.shape[1]
        with torch.no_grad():
            logits = run.model(input_ids=ids, attention_mask=mask).logits[0, -1].double()
        scaled = logits / cfg.temperature if cfg.temperature > 0 else logits
        exact = filter_logits(scaled[None], cfg.top_k, cfg.top_p)[0].softmax(-1)
        eos = eos_token_ids(run.model, run.tokenizer)

        def trl_sample(rows: int, max_new_tokens: int) -> torch.Tensor:
            config = type(trainer.generation_config).from_dict(
                {**trainer.generation_config.to_dict(), "max_new_tokens": max_new_tokens})
            with torch.no_grad():
                out = trainer.model.generate(input_ids=ids.expand(rows, -1), attention_mask=mask.expand(rows, -1),
                                             generation_config=config)[:, P:]
            return torch.nn.functional.pad(out, (0, max_new_tokens - out.shape[1]), value=run.tokenizer.pad_token_id)

        def ours_sample(rows: int, max_new_tokens: int, generator) -> torch.Tensor:
            params = SamplingParams(max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
            ro = generate(run.model, ids, mask, rows, params, eos_token_id=eos, pad_token_id=run.tokenizer.pad_token_id,
                          generator=generator)
            return torch.nn.functional.pad(ro.completion_ids, (0, max_new_tokens - ro.completion_ids.shape[1]),
                                           value=run.tokenizer.pad_token_id)

        result = {"prompt": record[run.config.prompt_column], "vocab": V, "rows_same_state": batch}
        torch.manual_seed(seed)
        theirs = trl_sample(batch, cfg.max_new_tokens)
        mine = ours_sample(batch, cfg.max_new_tokens, torch.Generator().manual_seed(seed))
        result["identical_same_state"] = float((theirs == mine).all(dim=1).float().mean())
        counts = {"trl": torch.zeros(V, dtype=torch.float64), "grpo_fast": torch.zeros(V, dtype=torch.float64)}
        torch.manual_seed(seed + 1)
        generator = torch.Generator().manual_seed(seed + 2)
        for _ in range(max(1, samples // batch)):
            counts["trl"] += torch.bincount(trl_sample(batch, 1)[:, 0], minlength=V).double()[:V]
            counts["grpo_fast"] += torch.bincount(ours_sample(batch, 1, generator)[:, 0], minlength=V).double()[:V]
        n = float(counts["trl"].sum())
        result["samples"] = int(n)
        for name, c in counts.items():
            result[f"{name}_vs_exact"] = chi_square_p(c, exact * n)
        result["trl_vs_grpo_fast"] = homogeneity_p(counts["trl"], counts["grpo_fast"])
        result["max_freq_gap"] = float((counts["trl"] - counts["grpo_fast"]).abs().max() / n)
        return result


# --------------------------------------------------------------------------------------------------------------------
# CLI


def report(rows: list[Row]) -> str:
    from bench import harness

    body = [[r.step, r.quantity, f"{r.diff:.3g}", f"{r.tolerance:.3g}", "ok" if r.ok else "DIFFERS", r.note]
            for r in rows]
    table = harness.markdown_table(["step", "quantity", "max |grpo-fast - TRL|", "tolerance", "", "note"], body)
    first = first_difference(rows)
    verdict = ("every quantity agrees within float tolerance at every step" if first is None else
               f"first difference: step {first.step}, {first.quantity} ({first.diff:.3g} > {first.tolerance:.3g})")
    return f"{table}\n\n{verdict}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps in lockstep (default 4)")
    p.add_argument("--seed", type=int, default=0, help="model init, prompt order and sampling seed (default 0)")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                   help="change a TrainConfig field for both trainers (default: the default run with "
                        + ", ".join(f"{k}={v}" for k, v in LOCKSTEP_DEFAULTS.items()) + ")")
    p.add_argument("--samples", type=int, default=20000, help="first tokens each trainer samples in part 2 "
                                                              "(0: skip part 2; default 20000)")
    p.add_argument("--sampling-model", default=None, metavar="DIR",
                   help="part 2 samples from this save_pretrained directory (e.g. a trained run's model/, whose "
                        "distributions are peaked) instead of the seed's initial tiny model")
    p.add_argument("--prompt-index", type=int, default=0, help="part 2's prompt: this training record (default 0)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write every compared quantity (and the sampling tests) to this CSV, with the command "
                        "and commit (e.g. bench/results/lockstep_trl.csv)")
    args = p.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    import warnings

    warnings.filterwarnings("ignore")
    rows = lockstep(args.steps, args.seed, overrides)
    print(report(rows))
    options = " ".join(args.set)
    csv_rows = [dict(part="lockstep", options=options, seed=args.seed, step=r.step, quantity=r.quantity, diff=r.diff,
                     tolerance=r.tolerance, ok=r.ok, note=r.note) for r in rows]
    if args.samples:
        s = sampling(args.samples, args.seed, overrides, args.prompt_index, args.sampling_model)
        print(f"\nsampling, prompt {s['prompt']!r}, {args.sampling_model or 'the initial model'}:")
        print(f"  from the same RNG state: {100 * s['identical_same_state']:.1f}% of {s['rows_same_state']} whole "
              "completions identical")
        print(f"  independent streams, {s['samples']} first tokens each over {s['vocab']} tokens:")
        for key, what in (("trl_vs_exact", "TRL vs the exact distribution"),
                          ("grpo_fast_vs_exact", "grpo-fast vs the exact distribution"),
                          ("trl_vs_grpo_fast", "TRL vs grpo-fast (homogeneity)")):
            stat, dof, pval = s[key]
            print(f"    {what:>36}: chi-square {stat:.1f}, {dof} dof, p = {pval:.3f}")
        print(f"    largest frequency gap between the two: {s['max_freq_gap']:.4f}")
        csv_rows.append(dict(part="sampling", options=options, seed=args.seed, quantity="identical whole completions "
                             f"from the same RNG state ({s['rows_same_state']} rows)", diff=s["identical_same_state"]))
        for key in ("trl_vs_exact", "grpo_fast_vs_exact", "trl_vs_grpo_fast"):
            stat, dof, pval = s[key]
            csv_rows.append(dict(part="sampling", options=options, seed=args.seed,
                                 quantity=f"first token, {s['samples']} samples, chi-square {key}", diff=stat,
                                 tolerance=dof, note=f"p = {pval:.4f}"))
    if args.out:
        from bench import harness

        env = harness.env_fields("cpu")
        harness.write_csv(args.out, [{**r, **env} for r in csv_rows])
        print(f"\nCSV: {args.out}")
    return 0 if first_difference(rows) is None else 1


if __name__ == "__main__":
    sys.exit(main())
