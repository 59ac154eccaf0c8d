"""Rollout: sample G completions per prompt with the policy's KV cache, recording the sampling log-probs.

Each unique prompt is prefilled once; its KV cache is then repeated for the group's G rows
(``DynamicCache.batch_repeat_interleave``), so the prompt costs one forward per group instead of G.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import weakref
from dataclasses import dataclass

import torch

from grpo_fast.bnb_layout import inference_layout, packed_generation
from grpo_fast.train import distributed as dist_
from grpo_fast.train.data import render_prompt
from grpo_fast.train.forward import position_ids_from_mask, unwrap
from grpo_fast.train.model import autocast

logger = logging.getLogger("grpo_fast.train")
# model -> whether its generations run in bitsandbytes' repacked layout: decided (and logged) once per run, not at
# every evaluation's engine
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. ``top_k=0`` and ``top_p=1.0`` switch those filters off; ``temperature=0`` is
    greedy decoding (the recorded log-probs are then those of ``softmax(z)``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Rollout:
    """The group's samples. Rows are grouped: row ``i`` belongs to prompt ``i // G``.

    prompt_ids/prompt_mask: ``[B*G, P]`` left-padded; completion_ids/completion_mask: ``[B*G, T]`` right-padded, the
    EOS token included in the mask; sampling_logps: ``[B*G, T]`` float32, ``log softmax(z / temperature)`` of each
    sampled token (the ``hf`` engine: before top-k/top-p filtering, the distribution the loss's ``temperature``
    reproduces; the ``vllm`` engine: vLLM's processed log-probs, renormalised over the tokens a filter keeps), 0 on
    tokens the model did not sample. ``completion_mask`` is what attention sees (every real token); ``loss_mask``
    (multi-turn rollouts: ``grpo_fast.agents``) is 1 on the tokens the model sampled and 0 on tool and environment
    tokens, which are context, never trained; None means ``completion_mask``. Every count and average over tokens
    (the loss's normaliser, KL, entropy, the importance-sampling correction, lengths) uses :attr:`trained_mask`.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_logps: torch.Tensor
    group_size: int
    loss_mask: torch.Tensor | None = None
    trace: object | None = None  # a multi-turn rollout's grpo_fast.train.agentic.AgentTrace (environments, tool metrics)

    @property
    def trained_mask(self) -> torch.Tensor:
        """The tokens the loss trains: ``loss_mask`` when the rollout has one, else ``completion_mask``."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def completion_lengths(self) -> torch.Tensor:
        """Tokens per row that the model sampled (TRL's completion length: tool tokens not counted)."""
        return self.trained_mask.sum(dim=1)


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """One ``Rollout`` from several (prompt chunks generated one after the other): prompts re-padded on the left,
    completions on the right, to the longest of all."""
    if len(parts) == 1:
        return parts[0]
    if len({r.loss_mask is None for r in parts}) > 1:
        raise ValueError("concat_rollouts: some parts have a loss mask and some do not")
    P = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.completion_ids.shape[1] for r in parts)

    def pad(x, width, value, left):
        extra = width - x.shape[1]
        return torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=value)

    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, P, pad_token_id, True) for r in parts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, P, 0, True) for r in parts]),
        completion_ids=torch.cat([pad(r.completion_ids, T, pad_token_id, False) for r in parts]),
        completion_mask=torch.cat([pad(r.completion_mask, T, 0, False) for r in parts]),
        sampling_logps=torch.cat([pad(r.sampling_logps, T, 0.0, False) for r in parts]),
        group_size=parts[0].group_size,
        loss_mask=None if parts[0].loss_mask is None else torch.cat([pad(r.loss_mask, T, 0, False) for r in parts]),
    )


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set whose probability reaches top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """logits ``[R, V]`` float32 -> (token ``[R]``, its log-prob under ``softmax(logits / temperature)``)."""
    scaled = logits / params.temperature if params.temperature > 0 else logits
    logp_all = torch.log_softmax(scaled, dim=-1)
    if params.temperature == 0:
        token = logits.argmax(dim=-1)
    else:
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return token, logp_all.gather(1, token[:, None])[:, 0]


def _cache_keyword(model) -> str:
    """transformers >= 5.2x calls the KV-cache argument ``cache``; earlier releases ``past_key_values``."""
    # the transformers model's own signature: a PEFT wrapper's forward takes **kwargs
    return "cache" if "cache" in inspect.signature(unwrap(model).forward).parameters else "past_key_values"


def new_cache(device: torch.device):
    """An empty KV cache. Under autocast it stores keys and values in the autocast dtype: with float32 master weights
    the residual stream is float32, so transformers' rotary embedding returns float32 keys (a bf16 run's cache would
    be 1.5x its size), while attention under autocast reads them in the autocast dtype anyway: the samples are the
    same (tests/test_rollout.py)."""
    from transformers import DynamicCache

    if not torch.is_autocast_enabled(device.type):
        return DynamicCache()
    dtype = torch.get_autocast_dtype(device.type)

    class AutocastCache(DynamicCache):
        def update(self, key_states, value_states, *args, **kwargs):
            return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

    return AutocastCache()


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    group_size: int,
    params: SamplingParams,
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    turns=None,
) -> Rollout:
    """Sample ``group_size`` completions for each of the ``B`` left-padded prompts ``[B, P]``.

    A row stops at its first EOS (kept, and masked in) or after ``max_new_tokens``; later positions hold
    ``pad_token_id`` and mask 0. The loop ends as soon as every row has stopped.

    ``turns`` (:class:`grpo_fast.agents.turns.ToolTurns`) makes the rollout multi-turn: it decides at each step which
    rows feed tool tokens instead of sampling and which rows are done (a row then stops at its last turn, not its
    first EOS), and the result carries a ``loss_mask`` with 0 on the fed tokens.
    """
    device = prompt_ids.device
    eos = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, device=device)
    was_training = model.training
    model.eval()
    try:
        cache = new_cache(device)  # filled in place by every forward below
        cache_kw = _cache_keyword(model)
        out = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids_from_mask(prompt_mask),
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )
        cache.batch_repeat_interleave(group_size)
        logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)
        attn = prompt_mask.repeat_interleave(group_size, dim=0)
        next_pos = prompt_mask.sum(dim=1).repeat_interleave(group_size)

        rows = attn.shape[0]
        tokens, logps, alive_steps, sampled_steps = [], [], [], []
        alive = torch.ones(rows, dtype=torch.bool, device=device)
        for step in range(params.max_new_tokens):
            token, logp = _next_token(logits, params, generator)
            if turns is not None:
                token, logp, sampled = turns.choose(token, logp)
                sampled_steps.append(sampled & alive)
            token = torch.where(alive, token, pad_token_id)
            tokens.append(token)
            logps.append(torch.where(alive, logp, 0.0))
            alive_steps.append(alive)
            if turns is not None:
                alive = alive & ~turns.after(token, sampled, alive)
            else:
                alive = alive & ~torch.isin(token, eos)
            if not alive.any() or step == params.max_new_tokens - 1:
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            out = model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{cache_kw: cache},
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1].float()
    finally:
        model.train(was_training)

    completion_mask = torch.stack(alive_steps, dim=1).to(prompt_mask.dtype)
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=torch.stack(tokens, dim=1),
        completion_mask=completion_mask,
        sampling_logps=torch.stack(logps, dim=1).float(),
        group_size=group_size,
        loss_mask=None if turns is None else torch.stack(sampled_steps, dim=1).to(prompt_mask.dtype),
    )


# ------------------------------------------------------------------------------------------------ a run's rollout


def rollout(run, records: list[dict], group_size: int, params: SamplingParams, first_chunk: int = 0, *,
            engine) -> tuple[Rollout, list[str]]:
    """Samples ``group_size`` completions per record with ``engine`` (the run's is ``engines.engine_of(run)``),
    ``generation_prompts`` prompts at a time (their KV caches are what bounds generation memory); chunk ``i`` samples
    with seed ``sampling_seed(seed, step, first_chunk + i)``. ``run``: the trainer's ``Run``; returns the rollout and
    the decoded completions. With tools, ``Rollout.trace`` holds the rows' environments and the records as sampled
    (their prompts extended by the environments' ``reset``): what the rewards must score."""
    if dist_.inner_model(run.policy) is not run.model:  # e.g. run.model replaced without its wrapper
        raise RuntimeError("Run.policy wraps another model than Run.model; replace both (distributed.wrap)")
    chunk = run.config.generation_prompts or len(records)
    eos = eos_token_ids(run.model, run.tokenizer)
    agent = run.agent
    if agent is not None:  # tools: each row's environment, and the prompts its reset() extends
        from grpo_fast.train.agentic import AgentTrace, extend_prompt

        environments, observations = agent.start(records, group_size)
        column = run.config.prompt_column
        records = [{**r, column: extend_prompt(r[column], obs)} for r, obs in zip(records, observations)]
        trace, messages = AgentTrace(environments, records, rows=len(records) * group_size), []
    parts = []
    for i, start in enumerate(range(0, len(records), chunk)):
        prompt_ids, prompt_mask = encode_prompts(run, records[start : start + chunk])
        turns = {}
        if agent is not None:
            rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())
                    for _ in range(group_size)]
            turns["turns"] = agent.turns(environments[start * group_size : (start + chunk) * group_size], rows,
                                         max_new_tokens=params.max_new_tokens, context=run.context)
        parts.append(engine.generate(prompt_ids, prompt_mask, group_size, params, eos_token_id=eos,
                                     pad_token_id=run.tokenizer.pad_token_id,
                                     seed=sampling_seed(run.config.seed, run.step, first_chunk + i), **turns))
        if agent is not None:
            trace.stats.append(turns["turns"].stats)
            messages.extend(turns["turns"].messages)
    result = concat_rollouts(parts, run.tokenizer.pad_token_id)
    if agent is None:
        return result, run.tokenizer.batch_decode(result.completion_ids, skip_special_tokens=True)
    from grpo_fast.train.agentic import transcripts

    result.trace = trace
    prompts = [r[run.config.prompt_column] for r in records for _ in range(group_size)]
    return result, transcripts(run.tokenizer, result.completion_ids, result.completion_mask, messages, prompts)


def encode_prompts(run, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The records' prompts as the model sees them (chat template, system prompt), tokenized and left-padded on
    ``run``'s device (``run``: the trainer's ``Run``); a prompt longer than ``max_prompt_length`` is refused."""
    tools = run.agent.schemas if run.agent is not None else None
    texts = [render_prompt(run.tokenizer, r[run.config.prompt_column], system_prompt=run.config.system_prompt,
                           tools=tools) for r in records]
    enc = run.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    if enc.input_ids.shape[1] > run.config.max_prompt_length:
        longest = int(enc.attention_mask.sum(1).argmax())
        raise ValueError(
            f"TrainConfig.max_prompt_length: a prompt has {enc.input_ids.shape[1]} tokens, more than "
            f"{run.config.max_prompt_length}: {texts[longest][:80]!r}..."
        )
    return enc.input_ids.to(run.device), enc.attention_mask.to(run.device)


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (chat models often end turns with another
    token, e.g. Llama-3's <|eot_id|>)."""
    ids = [tokenizer.eos_token_id]
    generation_config = getattr(unwrap(model), "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return sorted({i for i in ids if i is not None})


def sampling_seed(seed: int, step: int, chunk_index: int) -> int:
    """The seed of the sampling RNG of prompt chunk ``chunk_index`` at step ``step`` (counted from 0) of a run
    seeded ``seed``: a hash of the three (BLAKE2b, 63 bits), so the streams of neighbouring steps, chunks and runs
    are unrelated. An affine formula ``(seed * a + step) * b + chunk`` served before; torch's CPU generator keeps only
    the low 32 bits of a seed, and over 8 seeds of the ``median`` task the hashed streams trained to a higher
    reward (0.775 vs 0.717, last 100 steps; a difference of 1.5 standard errors, docs/train.md)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{chunk_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


# ------------------------------------------------------------------------------------------------ engines
# What the trainer asks of a rollout engine: ``generate(prompt_ids, prompt_mask, group_size, params, *, eos_token_id,
# pad_token_id, seed) -> Rollout`` (rows grouped by prompt, the layout of :class:`Rollout`), ``update_weights(model)``
# (take the policy's current weights), ``sleep()`` (free memory during the policy update), ``close()``; ``name``,
# ``startup_s``, ``last_sync_s`` and ``cached_prompt_tokens`` for the log and the metrics, ``needs_weights`` (the
# engine dropped its weights while asleep: push them even without a new update).


class HFEngine:
    """grpo-fast's own sampler (:func:`generate`) on the policy itself: nothing to push, nothing to free."""

    name = "hf"
    startup_s = last_sync_s = 0.0
    cached_prompt_tokens = 0
    needs_weights = False

    def __init__(self, run):
        self.run = run
        # a 4-bit base of a bf16 run on an AVX512-BF16 CPU samples in bitsandbytes' CPU inference layout (faster, bf16
        # like the run) and trains in its own layout (grpo_fast.bnb_layout)
        model = unwrap(run.model)
        if model not in _LAYOUTS:
            _LAYOUTS[model], why = packed_generation(model, run.device, run.dtype)
            if why is not None:
                logger.info("4-bit generation layout: %s (%s)",
                            "repacked for inference" if _LAYOUTS[model] else "the training layout", why)
        self.packed_4bit = _LAYOUTS[model]

    def generate(self, prompt_ids, prompt_mask, group_size: int, params: SamplingParams, *, eos_token_id,
                 pad_token_id: int, seed: int, turns=None) -> Rollout:
        run = self.run
        generator = torch.Generator(device=run.device).manual_seed(seed)
        with (torch.no_grad(), autocast(run.device, run.dtype),  # no_grad outside DDP's forward: no backward follows
              inference_layout(unwrap(run.model), self.packed_4bit)):
            return run.policy(generate, prompt_ids, prompt_mask, group_size, params, eos_token_id=eos_token_id,
                              pad_token_id=pad_token_id, generator=generator, turns=turns)

    def update_weights(self, model) -> None:
        pass

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass
