"""Offline TRL 1.16 harnesses for the parity tests (and the later TRL drop-in trainer tests).

Nothing here downloads anything: the tokenizer is a word-level vocabulary built in memory, the model a randomly
initialised one-layer Qwen2 (hidden size 32) saved to a temporary folder.

- ``trl_compute_loss`` runs TRL's own unbound ``GRPOTrainer._compute_loss`` on a minimal stand-in for ``self`` whose
  ``_get_per_token_logps_and_entropies`` computes log-probs from leaf tensors with ``logprobs_reference``.
- ``tiny_tokenizer`` / ``save_tiny_model`` / ``build_tiny_grpo_trainer`` make a real ``GRPOTrainer`` on CPU.
- ``scripted_reward_funcs`` returns reward functions that hand back fixed, scripted values (None included);
  ``token_sum_reward`` a varied deterministic one that can record the completions it scored.
- ``scripted_rollout``: a TRL ``rollout_func`` with seeded completions that do not depend on the model.
- ``MaterializedLogitsGRPOTrainer``: ``GRPOTrainer`` on the model's full logits (the float64 oracle of the drop-in
  parity tests, and the "materialised" variant of ``bench/bench_trl.py``).

This module imports trl: import it only after ``pytest.importorskip("trl")``.
"""

from __future__ import annotations

import itertools
import types
from collections import defaultdict
from pathlib import Path

import torch
from trl import GRPOConfig, GRPOTrainer

from grpo_fast.config import GRPOLossConfig
from grpo_fast.reference import logprobs_reference

# What TRL's `_compute_loss` logs, and the LossOutput field each key corresponds to.
TRL_METRIC_FIELDS = {
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/low_mean": "clip_ratio_low",
    "clip_ratio/high_mean": "clip_ratio_high",
    "clip_ratio/region_mean": "clip_ratio_region",
    "cispo_clip_ratio": "clip_ratio_high",
}


class SingleProcessAccelerator:
    """What ``_compute_loss`` uses of ``accelerate.Accelerator``, for one process: the collectives are identities."""

    num_processes = 1
    process_index = 0
    is_main_process = True
    sync_gradients = True
    device = torch.device("cpu")

    def reduce(self, tensor, reduction="sum"):
        assert reduction == "sum", reduction
        return tensor

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        return tensor


class _LeafPolicy:
    """Stands in for the model: per-token log-probs and entropies of ``hidden @ weight.T (+ bias)``, TRL-style.

    TRL's fused LM head (``add_fused_lm_head``) scores only positions whose attention mask is 1 and returns zeros
    elsewhere, so padded completion positions get log-prob 0 and entropy 0 here as well.
    """

    def __init__(self, hidden, weight, bias, temperature, softcap):
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.temperature, self.softcap = temperature, softcap
        self.training = True
        self.calls = []

    def __call__(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                 compute_aux_loss=False, **multimodal):
        assert model is self, "TRL passed another model to _get_per_token_logps_and_entropies"
        assert all(v is None for v in multimodal.values()), multimodal
        self.calls.append(dict(logits_to_keep=logits_to_keep, compute_entropy=compute_entropy))
        targets = input_ids[:, -logits_to_keep:]
        scored = attention_mask[:, -logits_to_keep:].bool()
        logps, entropy = logprobs_reference(
            self.hidden, self.weight, targets, self.bias, self.temperature, self.softcap, return_entropy=True
        )
        logps, entropy = logps.masked_fill(~scored, 0.0), entropy.masked_fill(~scored, 0.0)
        self.last_logps = logps.detach()
        return logps, (entropy if compute_entropy else None), None


def make_trl_self(config: GRPOLossConfig, policy: _LeafPolicy, *, max_completion_length: int, use_vllm: bool):
    """A minimal ``self`` for ``GRPOTrainer._compute_loss`` mirroring what ``GRPOTrainer.__init__`` sets from a config.

    Only the attributes ``_compute_loss`` reads exist (a ``SimpleNamespace`` raises on any other), so a TRL change
    that reads something new fails loudly instead of silently using a default. One process, gradient accumulation 1,
    ``steps_per_generation`` 1, train mode, no off-policy mask, no adaptive entropy, no MoE aux loss.
    """
    args = types.SimpleNamespace(
        delta=config.delta,
        use_bias_correction_kl=config.use_bias_correction_kl,
        sapo_temperature_pos=config.sapo_temperature_pos,
        sapo_temperature_neg=config.sapo_temperature_neg,
        vespo_k_pos=config.vespo_k_pos,
        vespo_lambda_pos=config.vespo_lambda_pos,
        vespo_k_neg=config.vespo_k_neg,
        vespo_lambda_neg=config.vespo_lambda_neg,
        steps_per_generation=1,
        entropy_target=GRPOConfig.entropy_target,
    )
    fake = types.SimpleNamespace(
        args=args,
        model=policy,
        accelerator=SingleProcessAccelerator(),
        loss_type=config.loss_type.value,
        beta=config.beta,
        epsilon_low=config.epsilon_low,
        epsilon_high=config.eps_high,
        importance_sampling_level=config.importance_sampling_level,
        top_entropy_quantile=config.top_entropy_quantile,
        off_policy_mask_threshold=None,
        use_vllm=use_vllm,
        vllm_importance_sampling_correction=use_vllm,
        max_completion_length=max_completion_length,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=config.entropy_coef != 0.0,
        entropy_coef=config.entropy_coef,
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=policy,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,  # staticmethods: plain functions on the namespace
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )
    fake.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, fake)
    return fake


def trl_compute_loss(
    config: GRPOLossConfig,
    hidden,
    weight,
    target_ids,
    advantages,
    completion_mask,
    *,
    bias=None,
    old_logps=None,
    ref_logps=None,
    sampling_ratio=None,
    num_items_in_batch=None,
    prompt_len: int = 3,
):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on the same inputs ``grpo_loss`` takes.

    Returns ``(loss, metrics, per_token_logps)``: the differentiable loss (gradients reach hidden/weight/bias),
    ``{metric_name: float}`` as TRL logged it in ``_metrics["train"]``, and the log-probs TRL saw (0 at padding).
    ``sampling_ratio`` becomes TRL's ``inputs["importance_sampling_ratio"]`` with ``use_vllm`` and
    ``vllm_importance_sampling_correction`` on. TRL always carries ``num_items_in_batch`` (the token count of the
    generation batch); grpo-fast's None means this micro-batch's token count, so that is what TRL gets then.
    """
    B, T = target_ids.shape
    policy = _LeafPolicy(hidden, weight, bias, config.temperature, config.softcap)
    fake = make_trl_self(
        config, policy, max_completion_length=config.max_completion_length or T, use_vllm=sampling_ratio is not None
    )
    mask = completion_mask.long()
    if num_items_in_batch is None:
        num_items_in_batch = mask.sum()
    inputs = {
        "prompt_ids": torch.randint(0, weight.shape[0], (B, prompt_len), generator=torch.Generator().manual_seed(0)),
        "prompt_mask": torch.ones(B, prompt_len, dtype=torch.long),
        "completion_ids": target_ids,
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": torch.as_tensor(num_items_in_batch),
    }
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    if sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = sampling_ratio
    loss = GRPOTrainer._compute_loss(fake, policy, inputs)
    assert [c["logits_to_keep"] for c in policy.calls] == [T] and policy.calls[0]["compute_entropy"]
    metrics = {}
    for name, values in fake._metrics["train"].items():
        assert len(values) == 1, (name, values)
        metrics[name] = values[0]
    return loss, metrics, policy.last_logps


def trl_high_entropy_mask(entropies, mask, top_entropy_quantile):
    """TRL's ``GRPOTrainer.get_high_entropy_mask`` on one process, as ``_compute_loss`` calls it."""
    fake = types.SimpleNamespace(accelerator=SingleProcessAccelerator())
    return GRPOTrainer.get_high_entropy_mask(fake, entropies, mask, 1 - top_entropy_quantile)


# ----------------------------------------------------------------------------------------------------------------
# A real GRPOTrainer on CPU, offline


def tiny_tokenizer(num_words: int = 29):
    """Word-level fast tokenizer over ``<pad> <eos> <unk> w0 .. w{n-1}``, whitespace split; no hub access."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(num_words)]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_qwen2(vocab_size: int, seed: int = 0, **config_overrides):
    """A randomly initialised one-layer Qwen2 causal LM (hidden 32, 2 heads, 1 KV head); ``config_overrides`` go to
    ``Qwen2Config`` (e.g. ``tie_word_embeddings=True``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**{
        **dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
               eos_token_id=1, bos_token_id=None),
        **config_overrides,
    })
    return Qwen2ForCausalLM(config)


def save_tiny_model(directory, model_factory=None, **config_overrides) -> str:
    """Save a tiny causal LM and ``tiny_tokenizer`` to ``directory``; return it. The model is
    ``model_factory(vocab_size, **config_overrides)`` (default ``tiny_qwen2``). Load the tokenizer back with
    ``load_tiny_tokenizer``, not ``AutoTokenizer``."""
    directory = Path(directory)
    tokenizer = tiny_tokenizer()
    (model_factory or tiny_qwen2)(len(tokenizer), **config_overrides).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def load_tiny_tokenizer(model_dir):
    """The word-level tokenizer saved by ``save_tiny_model``.

    Not ``AutoTokenizer``: transformers 5 picks the class from the model type (Qwen2Tokenizer) and rebuilds a
    byte-level BPE that drops this vocabulary (every prompt encodes to nothing). For the same reason a
    ``GRPOTrainer`` on this folder needs ``processing_class`` passed explicitly.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def scripted_reward_funcs(scripts: dict[str, list]):
    """One reward function per entry of ``scripts``, named after its key, returning that list (None = no score)."""

    def make(name, values):
        def reward(prompts, completions, **kwargs):
            assert len(completions) == len(values), (len(completions), len(values))
            return list(values)

        reward.__name__ = name
        return reward

    return [make(name, values) for name, values in scripts.items()]


def build_tiny_grpo_trainer(model_dir, output_dir, reward_funcs, prompts, *, trainer_cls=None, model=None,
                            trainer_kwargs=None, **config_overrides):
    """A ``GRPOTrainer`` (or ``trainer_cls``) on CPU over the model/tokenizer in ``model_dir``; logging, saving and
    reporting off. ``model``: an instantiated model to train instead of loading ``model_dir``; ``trainer_kwargs``:
    more constructor arguments (``peft_config``, ``rollout_func``, ...)."""
    from datasets import Dataset

    settings = dict(
        output_dir=str(output_dir), num_generations=4, per_device_train_batch_size=4 * len(prompts),
        max_completion_length=4, report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no",
        seed=0, disable_tqdm=True,
    )
    settings.update(config_overrides)
    return (trainer_cls or GRPOTrainer)(
        model=model_dir if model is None else model,
        reward_funcs=reward_funcs,
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
        processing_class=load_tiny_tokenizer(model_dir),
        **(trainer_kwargs or {}),
    )


class MaterializedLogitsGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose log-probs come from the model's full logits (what TRL did before its fused head): the
    model's own forward (logit scale and softcap included), ``/ temperature``, ``log_softmax``, gather; entropy from
    the same logits. In a float64 model every step is float64, so TRL's own ``_compute_loss`` on top of it is the
    float64 oracle of the drop-in parity tests. Padding positions get 0, as TRL's fused head returns them."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        assert not compute_aux_loss and all(v is None for v in multimodal.values())
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logits = logits[:, -logits_to_keep - 1 : -1] / self.temperature
        log_probs = logits.log_softmax(-1)
        logps = log_probs.gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        scored = attention_mask[:, -logits_to_keep:].bool()
        return logps.masked_fill(~scored, 0.0), entropy.masked_fill(~scored, 0.0) if compute_entropy else None, None


def token_sum_reward(record: list | None = None):
    """A reward function ``sum(completion_ids) % 7`` (varied, deterministic); appends each batch's completion ids to
    ``record`` when given, so tests can check that two runs sampled the same completions."""

    def token_sum(prompts, completions, completion_ids, **kwargs):
        if record is not None:
            record.append([list(ids) for ids in completion_ids])
        return [float(sum(ids) % 7) for ids in completion_ids]

    return token_sum



def scripted_rollout(max_completion_length: int, seed: int = 0, env_mask: bool = False, full_length: bool = False):
    """A TRL ``rollout_func`` whose completions come from a seeded generator, not from the model.

    TRL's own sampling makes the completions of step 2 depend on the weights after step 1, which differ between a
    float32 and a float64 run by rounding; one token drawn near a boundary of the cumulative distribution then splits
    the runs apart (it happens). Scripted completions are identical in every run by construction, so a parity test
    compares training on the same data. Each call draws, per prompt, a length in [1, max_completion_length] and
    tokens from the word ids; about half of the completions shorter than the maximum end in EOS (id 1), the rest
    are cut. ``env_mask``: also return TRL's ``env_mask`` (its tool mask), hiding a random third of the tokens.
    ``full_length``: every completion has ``max_completion_length`` tokens and no EOS (benchmarks). Build one per
    trainer: the call counter is part of the seed.
    """
    calls = itertools.count()

    def rollout(prompts, trainer):
        gen = torch.Generator().manual_seed(seed * 100_003 + next(calls))
        tokenizer = trainer.processing_class
        vocab = len(tokenizer)
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completion_ids, masks = [], []
        for _ in prompts:
            n = max_completion_length
            if not full_length:
                n = int(torch.randint(1, max_completion_length + 1, (1,), generator=gen))
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            if not full_length and n < max_completion_length and bool(torch.rand((), generator=gen) < 0.5):
                ids[-1] = tokenizer.eos_token_id
            completion_ids.append(ids)
            masks.append((torch.rand(n, generator=gen) > 0.33).long().tolist())
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        if env_mask:
            out["env_mask"] = masks
        return out

    return rollout
