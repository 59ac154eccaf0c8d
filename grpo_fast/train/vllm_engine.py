"""The ``vllm`` rollout engine: ``vllm.LLM`` in the trainer's own process (TRL's ``vllm_mode="colocate"``).

One request per prompt with ``n=G``: vLLM fans it out into G children that share the prompt's KV blocks through
prefix caching (only full blocks are shared; ``Rollout.cached_prompt_tokens`` says how many tokens were served from
the cache). ``logprobs=0`` with ``logprobs_mode="processed_logprobs"`` returns each sampled token's log-prob after
temperature (and after top-k / top-p, renormalised over the kept tokens: see ``sampling_correction``).

Sampling seeds. vLLM's per-request ``SamplingParams(seed=...)`` is refused by the CPU backend ("CPU Generator does
not use offset"); without it vLLM's sampler draws from torch's default generator of this process. ``generate``
therefore seeds that generator with the trainer's per-step seed inside ``torch.random.fork_rng`` (the trainer's own
random state is untouched), so a run resumed at step k samples what the uninterrupted run sampled at step k.

Weight sync (``update_weights``, once per optimizer update): the policy's tensors under their Hugging Face names go
through the worker's ``model_runner.reload_weights`` (vLLM's in-place reload: it re-runs each layer's loading and
post-processing, so fused q/k/v and gate/up projections and the CPU backend's repacked GEMM weights are rebuilt),
then the prefix cache is reset (its blocks hold keys and values of the old weights). A tied output head is the
embedding's parameter in vLLM, but the CPU backend packs a private copy of it for its GEMM that the reload does not
touch (measured: 1.17 nats off after one perturbation); the head's post-processing is re-run so it is rebuilt from
the new embedding. LoRA: each adapted weight is pushed as ``W + delta`` (``LoraLayer.get_delta_weight``) computed on
the fly; the policy is never merged and unmerged, so the trained base does not drift by rounding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from grpo_fast.dtypes import NAMES as DTYPE_NAMES  # torch.bfloat16 -> "bfloat16", vLLM's dtype argument
from grpo_fast.train.forward import unwrap
from grpo_fast.train.rollout import Rollout, SamplingParams

BLOCK_SIZE = 32  # tokens per KV block: a multiple of 32 on the CPU backend; the unit prefix caching shares


def available() -> bool:
    """Whether vLLM can be imported (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one token over all layers."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


def named_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the names of its ``save_pretrained`` checkpoint, as vLLM loads them: LoRA adapters
    folded in (``W + delta`` for each adapted weight, the adapter tensors themselves left out), FSDP2 shards gathered
    (``DTensor.full_tensor``, a collective every rank must join), a tied head yielded once (as the embedding)."""
    base = unwrap(model)  # a PEFT model's base, its LoRA layers in place
    deltas: dict[str, torch.Tensor] = {}
    peft = any(".base_layer." in name for name, _ in base.named_parameters())
    if peft:
        from peft.tuners.lora import LoraLayer

        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                if adapters and not module.disable_adapters:
                    with torch.no_grad():
                        deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in adapters)
    for name, param in base.named_parameters():
        if peft and ("lora_" in name or ".modules_to_save." in name):
            continue
        name = name.replace(".base_layer.", ".")
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor
            tensor = tensor.full_tensor()
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        yield name, tensor


def _save_for_engine(model, directory: Path) -> None:
    """The policy's current weights as a checkpoint vLLM can start from (config and safetensors; no tokenizer:
    prompts go in as token ids)."""
    state = {name: t.contiguous() for name, t in named_weights(model)}
    unwrap(model).config.save_pretrained(directory)
    from safetensors.torch import save_file

    save_file(state, str(directory / "model.safetensors"))


# vLLM warnings that this way of running it always triggers, and why each is harmless
EXPECTED_WARNINGS = {
    "vllm.renderers.base": ("Chat template warmup failed",  # no tokenizer in the engine: prompts go in as ids
                            "Using None for EOS token id"),  # the stop tokens are passed with every request
    # with VLLM_CPU_OMP_THREADS_BIND=nobind the worker keeps the process's thread count (torch.set_num_threads is
    # restored once the engine is up)
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
    # a reload pushes no rotary buffers, and no head weight when the head is tied (update_weights rebuilds it)
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",
                                                          "ParallelLMHead: Failed to load weights"),
}


def _drop_expected(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(EXPECTED_WARNINGS.get(record.name, ()))


def _quiet_expected_warnings() -> None:
    for name in EXPECTED_WARNINGS:
        logger = logging.getLogger(name)
        if _drop_expected not in logger.filters:
            logger.addFilter(_drop_expected)


def _start(LLM, **kwargs):
    """``LLM(**kwargs)``; a failure names the options that size and shape the engine."""
    try:
        return LLM(**kwargs)
    except Exception as e:
        raise RuntimeError(
            f"--rollout vllm: vLLM did not start: {e}. The engine was asked for max_model_len="
            f"{kwargs['max_model_len']} (--vllm-max-model-length), "
            + (f"a KV cache of {kwargs['kv_cache_memory_bytes'] / 2**20:.0f} MiB (--vllm-kv-cache-mib)"
               if "kv_cache_memory_bytes" in kwargs else
               f"{kwargs['gpu_memory_utilization']} of the GPU (--vllm-gpu-memory-utilization)")
            + f", dtype {kwargs['dtype']}; --rollout hf samples without vLLM") from e


class VLLMEngine:
    """Samples with ``vllm.LLM`` in this process; see the module docstring."""

    name = "vllm"

    def __init__(self, model, *, dtype: torch.dtype, seed: int, max_model_len: int | None = None,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = False, enforce_eager: bool | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core runs in this process
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ValueError("TrainConfig.rollout: the vllm engine runs vLLM in the trainer's process, so it needs "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=0 (or unset), got "
                             f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}")
        cpu = not torch.cuda.is_available()
        if cpu:
            # vLLM's CPU worker binds OpenMP threads and then turns torch.set_num_threads into a no-op for the whole
            # process; the trainer sets its own thread count
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if enable_sleep_mode:
                raise ValueError("TrainConfig.vllm_enable_sleep_mode needs a CUDA device (vLLM's CPU backend "
                                 "refuses sleep mode), got vllm_enable_sleep_mode=True on the CPU")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up narrative; grpo-fast logs the engine
        from vllm import LLM

        _quiet_expected_warnings()

        self.model_config = unwrap(model).config
        self._tmp = tempfile.TemporaryDirectory(prefix="grpo-fast-vllm-")
        t0 = time.perf_counter()
        _save_for_engine(model, Path(self._tmp.name))
        memory = ({"kv_cache_memory_bytes": int(kv_cache_memory_bytes)} if kv_cache_memory_bytes is not None
                  else {"gpu_memory_utilization": gpu_memory_utilization})
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it by a no-op for the whole process
        try:
            self.llm = _start(LLM,
                model=self._tmp.name, skip_tokenizer_init=True, dtype=DTYPE_NAMES[dtype], seed=seed,
                enforce_eager=cpu if enforce_eager is None else enforce_eager,  # CPU: no 60 s inductor compile
                block_size=BLOCK_SIZE, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=enable_sleep_mode, generation_config="vllm", **memory,
            )
        finally:
            torch.set_num_threads = set_num_threads  # the trainer's --threads stays the trainer's to set
        self.startup_s = time.perf_counter() - t0
        import vllm

        self.version, self.dtype_name = vllm.__version__, DTYPE_NAMES[dtype]
        self.cached_prompt_tokens = 0
        self.sleep_mode = enable_sleep_mode
        self.asleep = self.weights_awake = False
        self.tied = bool(getattr(self.model_config, "tie_word_embeddings", False))
        self.last_sync_s = 0.0

    # ---------------------------------------------------------------------------------------------- sampling

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                 params: SamplingParams, *, eos_token_id: int | list[int], pad_token_id: int,
                 seed: int, turns=None) -> Rollout:
        """``group_size`` completions for each left-padded prompt of ``[B, P]``, laid out as the ``hf`` engine's
        ``Rollout``: rows grouped by prompt, completions right-padded with ``pad_token_id``, EOS kept and masked in,
        ``sampling_logps`` vLLM's processed log-probs (0 at padding). ``turns``
        (:class:`grpo_fast.agents.turns.ToolTurns`): multi-turn rows (:meth:`_generate_turns`)."""
        from vllm import SamplingParams as VLLMSamplingParams

        self.wake_up()
        if turns is not None:
            return self._generate_turns(prompt_ids, prompt_mask, group_size, params, eos_token_id=eos_token_id,
                                        pad_token_id=pad_token_id, seed=seed, turns=turns)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids.cpu(),
                                                                                          prompt_mask.cpu())]
        greedy = params.temperature == 0
        # vLLM refuses n > 1 for greedy decoding: G copies of the prompt with n=1 (identical completions)
        requests = [p for p in prompts for _ in range(group_size)] if greedy else prompts
        sampling = VLLMSamplingParams(
            n=1 if greedy else group_size, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0, max_tokens=params.max_new_tokens, logprobs=0,
            stop_token_ids=eos, detokenize=False,
        )
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # vLLM's sampler draws from the default generator (module docstring)
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        completions = [c for out in outputs for c in out.outputs]
        self.cached_prompt_tokens = sum(out.num_cached_tokens or 0 for out in outputs)
        rows, T = len(completions), max(len(c.token_ids) for c in completions)
        completion_ids = torch.full((rows, T), pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros((rows, T), dtype=prompt_mask.dtype)
        sampling_logps = torch.zeros((rows, T), dtype=torch.float32)
        for i, c in enumerate(completions):
            n = len(c.token_ids)
            completion_ids[i, :n] = torch.tensor(c.token_ids)
            completion_mask[i, :n] = 1
            sampling_logps[i, :n] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        device = prompt_ids.device
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
            completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            sampling_logps=sampling_logps.to(device),
            group_size=group_size,
        )

    def _generate_turns(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                        params: SamplingParams, *, eos_token_id, pad_token_id: int, seed: int, turns) -> Rollout:
        """Multi-turn rows, token in and token out, as TRL's colocated tool loop runs vLLM: the first turn of each
        prompt with ``n=G`` (greedy: G copies), stopping at EOS or the format's call token; then, round after round,
        each row whose turn asked for tools gets their results appended (no re-tokenising) and one more turn with
        ``n=1`` over its whole transcript, which prefix caching serves from the blocks of its earlier turns. The
        result's ``loss_mask`` is 0 on the tool tokens."""
        from vllm import SamplingParams as VLLMSamplingParams

        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        stop = sorted(set(eos) | set(turns.stop_ids))
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        rows = len(prompts) * group_size
        sampled: list[list[tuple[int, float, bool]]] = [[] for _ in range(rows)]  # (token, logp, from the model)
        greedy = params.temperature == 0

        def sampling(n: int, budget: int):
            return VLLMSamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                                      top_k=params.top_k if params.top_k > 0 else 0, max_tokens=budget, logprobs=0,
                                      stop_token_ids=stop, detokenize=False)

        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        cached = 0
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # vLLM's sampler draws from the default generator (module docstring)
            requests = [{"prompt_token_ids": p} for p in prompts for _ in range(group_size if greedy else 1)]
            outputs = self.llm.generate(requests, sampling(1 if greedy else group_size, params.max_new_tokens),
                                        use_tqdm=False)
            cached += sum(out.num_cached_tokens or 0 for out in outputs)
            results = [c for out in outputs for c in out.outputs]
            active = list(range(rows))
            while active:
                ended = []
                for r, c in zip(active, results):
                    tokens = list(c.token_ids)
                    turns.record_turn(r, tokens)
                    sampled[r].extend((t, lp[t].logprob, True) for t, lp in zip(tokens, c.logprobs))
                    if tokens and tokens[-1] in turns.stop_ids:  # else the length budget ended the row
                        ended.append(r)
                done = turns.end_turns(ended)
                active = []
                for r in ended:
                    if r not in done:
                        sampled[r].extend((t, 0.0, False) for t in turns.take_queued(r))
                        if len(turns.completions[r]) < params.max_new_tokens:  # results that fill it end the row
                            active.append(r)
                if not active:
                    break
                outputs = self.llm.generate(
                    [{"prompt_token_ids": prompts[r // group_size] + turns.completions[r]} for r in active],
                    [sampling(1, params.max_new_tokens - len(turns.completions[r])) for r in active], use_tqdm=False)
                cached += sum(out.num_cached_tokens or 0 for out in outputs)
                results = [out.outputs[0] for out in outputs]
        self.cached_prompt_tokens = cached
        T = max(1, max(len(row) for row in sampled))
        completion_ids = torch.full((rows, T), pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros((rows, T), dtype=prompt_mask.dtype)
        loss_mask = torch.zeros((rows, T), dtype=prompt_mask.dtype)
        sampling_logps = torch.zeros((rows, T), dtype=torch.float32)
        for i, row in enumerate(sampled):
            n = len(row)
            if n:
                completion_ids[i, :n] = torch.tensor([t for t, _, _ in row])
                completion_mask[i, :n] = 1
                loss_mask[i, :n] = torch.tensor([int(m) for _, _, m in row])
                sampling_logps[i, :n] = torch.tensor([lp for _, lp, _ in row])
        device = prompt_ids.device
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
            completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            sampling_logps=sampling_logps.to(device),
            group_size=group_size,
            loss_mask=loss_mask.to(device),
        )

    # ---------------------------------------------------------------------------------------------- weights

    def _runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.model_runner

    def update_weights(self, model) -> None:
        """Push the policy's current weights (see the module docstring); every rank of an FSDP2 run must call it."""
        t0 = time.perf_counter()
        if self.sleep_mode and self.asleep and not self.weights_awake:
            self.llm.wake_up(tags=["weights"])  # weights may only be written once their memory is back
            self.weights_awake = True
        runner = self._runner()
        runner.reload_weights(weights_iterator=list(named_weights(model)))
        if self.tied:
            head = runner.model.lm_head
            head.quant_method.process_weights_after_loading(head)  # rebuild the head from the new embedding
        self.llm.reset_prefix_cache()
        self.last_sync_s = time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------------- memory

    @property
    def needs_weights(self) -> bool:
        """Asleep at level 2: the weights were dropped and must be pushed again, update or not."""
        return self.asleep and not self.weights_awake

    def sleep(self, level: int = 2) -> None:
        """Free the engine's GPU memory during the policy update (sleep mode only; level 2 drops the weights,
        which the next ``update_weights`` rewrites)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep, self.weights_awake = True, False

    def wake_up(self) -> None:
        """Take the memory back before generating: the KV cache (the weights woke for their push already)."""
        if self.sleep_mode and self.asleep:
            self.llm.wake_up(tags=["kv_cache"] if self.weights_awake else None)
            self.asleep = self.weights_awake = False

    def close(self) -> None:
        """Shut the engine down. Under torch.distributed vLLM's shutdown also destroys the default process group:
        close it only when nothing collective follows (``lifecycle.fit`` does so last)."""
        with contextlib.suppress(Exception):
            del self.llm
        self._tmp.cleanup()
