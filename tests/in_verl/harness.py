"""CPU harness that drives verl 0.9.1's real actor (TrainingWorker around FSDPEngineWithLMHead, FSDP2) on a tiny
random Qwen2, in-process or through a Ray worker group.

verl 0.9.1 only runs on cuda/npu out of the box. `apply_cpu_shims()` (called on import, idempotent) makes it run on
CPU without touching verl's code:

* a CPU platform registered through `PlatformRegistry` and made the current one (`VERL_PLATFORM=cpu` too, so Ray
  workers pick it): device "cpu", communication backend gloo, `current_device()` returning the string "cpu" (verl
  calls `tensor.to(get_device_id())`, an int would mean cuda:N) and a device module with the memory/RNG calls verl
  makes on `torch.cuda` (max_memory_allocated, empty_cache, ...), which `torch.cpu` lacks;
* verl's FSDP engines registered for device "cpu" (`EngineRegistry.register` only lists cuda/npu);
* `transformer_impl.device_name` reset to "cpu" in case verl's engine module was imported before the platform was
  set (it reads the platform at import time);
* (in-process, `init_process_group`) the torch.distributed env of a world of one (MASTER_ADDR/PORT, RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE: verl's Worker reads them) and a plain gloo process group, made before the
  worker so that verl's `initialize_global_process_group_ray` finds it initialised. Ray workers get the env from
  RayWorkerGroup.

Two things the harness does around verl's build (CpuTrainingWorker.reset), not CPU-specific:

* verl's fused-kernel patch (`patch_forward_with_backends`) assigns `Qwen2ForCausalLM.forward` class-wide; the
  harness moves it onto the worker's own model and restores the class, so workers (and the HF reference) built later
  in the same process are not silently switched to the fused forward;
* `lm_head_own_fsdp_unit` selects FSDP2's wrapping of an untied lm_head/embed_tokens (verl 0.9.1 always makes them
  units of their own, which is what triggers verl#5633 with its fused backends; no verl config selects it).

Packed batches (use_remove_padding=True) need no flash-attn: verl passes one packed row with attention_mask=None and
per-sequence position_ids, and transformers' masking_utils (find_packed_sequence_indices) turns position_ids that
restart at 0 into a block-diagonal causal mask for eager/sdpa attention. verl's `_flash_attention_forward` monkey
patch is installed but never called under eager.

Helpers: `tiny_model_dir`, `make_actor`, `make_batch`, `with_old_log_probs`, `infer`, `train_step`,
`infer_tensordict` / `train_tensordict` (what the worker gets), `hf_reference_logprobs`, `hf_param_shapes`,
`trainable_params`, `ray_init` + `make_ray_actor`. Every worker is fp32 end to end (model_dtype fp32, FSDP2 mixed
precision param/reduce/buffer fp32, so verl's forward runs without autocast), dropout 0, no offload, no torch.compile,
no dynamic batch size, gradient checkpointing off (selectable), one intra-op thread, so two workers built from one
model dir give bit-identical results on the same path.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import socket
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

_SHIMS_APPLIED = False


# --------------------------------------------------------------------------------------------------------------------
# CPU shims
# --------------------------------------------------------------------------------------------------------------------


class _CpuDeviceModule(types.ModuleType):
    """What verl calls on `get_torch_device()` (normally torch.cuda), for CPU: torch.cpu plus no-op memory stats."""

    def __init__(self):
        super().__init__("verl_cpu_device")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def set_device(*_a, **_k):
        return None

    @staticmethod
    def synchronize(*_a, **_k):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def ipc_collect():
        return None

    @staticmethod
    def memory_allocated(*_a, **_k):
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(*_a, **_k):
        return None

    @staticmethod
    def mem_get_info(*_a, **_k):
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(*_a, **_k):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *_a, **_k):
        torch.set_rng_state(state)

    @staticmethod
    def set_per_process_memory_fraction(*_a, **_k):
        return None

    @staticmethod
    def get_device_name(*_a, **_k):
        return "cpu"


_CPU_DEVICE_MODULE = _CpuDeviceModule()


def _make_cpu_platform_cls():
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CPU_DEVICE_MODULE

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):
            return "CPU"

        def ray_resource_options(self, num_gpus):
            return {}

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

    # PlatformBase's abstract properties are satisfied by the class attributes above
    PlatformCPU.__abstractmethods__ = frozenset()
    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    return PlatformCPU


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_dist_env() -> None:
    """torch.distributed env of a world of one (what verl's Worker reads), unless already set (Ray sets its own)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")


def init_process_group() -> None:
    """The gloo process group verl's worker would otherwise create with "cpu:gloo,cpu:gloo"."""
    import torch.distributed as dist

    if not dist.is_initialized():
        set_single_process_dist_env()
        dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


def apply_cpu_shims() -> None:
    """Make verl 0.9.1's FSDP actor run on CPU (platform, engine registration, env). Idempotent."""
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED:
        return
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["VERL_DISABLE_FLASH_ATTN_CE"] = "1"  # no flash-attn here anyway; never its Triton CE

    from verl.plugin.platform import platform_manager

    cls = platform_manager.PlatformRegistry.get("cpu") or _make_cpu_platform_cls()
    if not isinstance(platform_manager._current_platform, cls):
        platform_manager.set_platform(cls())

    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.device_name = "cpu"
    _teach_fp64()
    for model_type, engine_cls in (("language_model", transformer_impl.FSDPEngineWithLMHead),
                                   ("value_model", transformer_impl.FSDPEngineWithValueHead)):
        by_backend = EngineRegistry._engines.get(model_type, {})
        if "cpu" not in by_backend.get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine_cls)
    _SHIMS_APPLIED = True


def _teach_fp64() -> None:
    """verl's precision names stop at fp32; "fp64" runs a whole actor in float64: the reference a float32 run is held
    to (grpo_fast.testing's rule)."""
    from verl.utils.torch_dtypes import PrecisionType

    if getattr(PrecisionType, "_grpo_fast_fp64", False):
        return
    to_dtype, to_str = PrecisionType.to_dtype, PrecisionType.to_str
    PrecisionType.to_dtype = staticmethod(lambda p: torch.float64 if p in ("fp64", "float64", torch.float64)
                                          else to_dtype(p))
    PrecisionType.to_str = staticmethod(lambda p: "fp64" if p == torch.float64 else to_str(p))
    PrecisionType._grpo_fast_fp64 = True


apply_cpu_shims()


# --------------------------------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------------------------------


def _save_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    words = specials + [f"t{i}" for i in range(vocab - len(specials))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(path))


def tiny_model_dir(tmp_path, tied: bool, vocab: int = 96, hidden: int = 32, layers: int = 2, seed: int = 0,
                   heads: int = 4, kv_heads: int = 2, intermediate: int = 64) -> str:
    """save_pretrained of a random float32 Qwen2ForCausalLM (eager attention, dropout 0) plus a WordLevel tokenizer
    (HFModelConfig loads one) under tmp_path/"qwen2-{tied|untied}-..."; returns the dir (reused when present)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(tmp_path) / f"qwen2-{'tied' if tied else 'untied'}-v{vocab}-h{hidden}-l{layers}-s{seed}"
    if (path / "config.json").exists():
        return str(path)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      tie_word_embeddings=tied, attention_dropout=0.0, rms_norm_eps=1e-6,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
        # HF's init (std 0.02) gives near-uniform distributions; scale up so log-probs/entropies vary per token
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    _save_tokenizer(path, vocab)
    return str(path)


# --------------------------------------------------------------------------------------------------------------------
# Actor
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Actor:
    """A verl TrainingWorker (in-process: `worker`; through Ray: `group`, a RayWorkerGroup) plus what the harness
    needs to drive it as RayPPOTrainer does."""

    worker: Any
    actor_config: Any
    n_micro: int
    temperature: float
    use_remove_padding: bool
    group: Any = None

    @property
    def engine(self):
        return self.worker.engine


def build_configs(model_dir, *, use_remove_padding: bool, use_fused_kernels: bool = False,
                  fused_backend: str | None = None, loss_mode: str = "vanilla", loss_agg_mode: str = "token-mean",
                  lora_rank: int = 0, lora_alpha: int = 16, clip_ratio: float = 0.2,
                  clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
                  clip_ratio_c: float = 3.0, entropy_coeff: float = 0.0, use_kl_loss: bool = False,
                  kl_loss_type: str = "low_var_kl", kl_loss_coef: float = 0.001, calculate_entropy: bool = False,
                  policy_loss: dict | None = None, actor_overrides: dict | None = None,
                  engine_overrides: dict | None = None, model_overrides: dict | None = None,
                  gradient_checkpointing: bool = False, lr: float = 1e-3, clip_grad: float = 1.0, seed: int = 0,
                  precision: str = "fp32"):
    """(TrainingWorkerConfig, ActorConfig) of an fp32 FSDP2 actor: what ActorRolloutRefWorker.init_model builds from
    a trainer config. See `make_actor` for the arguments."""
    from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.engine_workers import TrainingWorkerConfig

    apply_cpu_shims()
    model_kwargs = dict(path=str(model_dir), use_remove_padding=use_remove_padding,
                        use_fused_kernels=use_fused_kernels,
                        fused_kernel_options={"impl_backend": fused_backend} if fused_backend is not None else {},
                        override_config={"attn_implementation": "eager", "attention_dropout": 0.0},
                        enable_gradient_checkpointing=gradient_checkpointing, lora_rank=lora_rank,
                        lora_alpha=lora_alpha)
    model_kwargs.update(model_overrides or {})
    model_config = HFModelConfig(**model_kwargs)

    engine_kwargs = dict(strategy="fsdp2", forward_only=False, param_offload=False, optimizer_offload=False,
                         offload_policy=False, model_dtype=precision,
                         mixed_precision={"param_dtype": precision, "reduce_dtype": precision,
                                          "buffer_dtype": precision},
                         use_dynamic_bsz=False, use_torch_compile=False, fsdp_size=-1, seed=seed,
                         full_determinism=False, reshard_after_forward=True)
    engine_kwargs.update(engine_overrides or {})
    engine_config = FSDPEngineConfig(**engine_kwargs)
    optimizer_config = FSDPOptimizerConfig(lr=lr, clip_grad=clip_grad, weight_decay=0.0, total_training_steps=10,
                                           lr_warmup_steps=0)

    pl = {"loss_mode": loss_mode}
    pl.update(policy_loss or {})
    actor_kwargs = dict(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                        clip_ratio=clip_ratio,
                        clip_ratio_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
                        clip_ratio_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
                        clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode, entropy_coeff=entropy_coeff,
                        use_kl_loss=use_kl_loss, kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef,
                        calculate_entropy=calculate_entropy, use_torch_compile=False,
                        use_fused_kernels=use_fused_kernels, engine=engine_config, optim=optimizer_config,
                        model_config=model_config)
    actor_kwargs.update(actor_overrides or {})
    actor_config = ActorConfig(policy_loss=PolicyLossConfig(**pl), **actor_kwargs)

    config = TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                  engine_config=engine_config, optimizer_config=optimizer_config,
                                  checkpoint_config=None)
    return config, actor_config


from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402


class CpuTrainingWorker(TrainingWorker):
    """verl's TrainingWorker, plus: the CPU shims applied in its own process (Ray workers import this module, which
    applies them on import) and a `reset` that builds the engine under the chosen FSDP2 wrapping and keeps verl's
    class-wide fused-kernel forward patch local to this worker's model."""

    def __init__(self, config, lm_head_own_fsdp_unit=None, seed=0):
        apply_cpu_shims()
        init_process_group()
        torch.set_num_threads(1)
        self._lm_head_own_fsdp_unit = lm_head_own_fsdp_unit
        self._seed = seed
        super().__init__(config=config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self):
        from transformers import PreTrainedModel

        saved = {c: c.__dict__["forward"] for c in _all_subclasses(PreTrainedModel) if "forward" in c.__dict__}
        with _wrap_policy(self._lm_head_own_fsdp_unit), torch.random.fork_rng():
            torch.manual_seed(self._seed)
            self.engine.initialize()
        _localise_forward_patch(self.engine.module, saved)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fsdp_unit_names(self):
        """Names of the modules FSDP2 made units ("" is the root)."""
        return [n for n, m in self.engine.module.named_modules() if type(m).__name__.startswith("FSDP")]


def make_actor(model_dir, *, use_remove_padding: bool, use_fused_kernels: bool = False,
               fused_backend: str | None = None, temperature: float = 1.0, loss_mode: str = "vanilla",
               loss_agg_mode: str = "token-mean", lora_rank: int = 0, n_micro: int = 1,
               lm_head_own_fsdp_unit: bool | None = None, seed: int = 0, **options) -> Actor:
    """An in-process verl TrainingWorker (strategy fsdp2, fp32 params and compute, gloo world of one) built and
    reset as ActorRolloutRefWorker.init_model does, with `loss_fn = partial(ppo_loss, config=ActorConfig(...))`.

    use_fused_kernels / fused_backend go verbatim to HFModelConfig.use_fused_kernels /
    fused_kernel_options.impl_backend (verl knows "torch"/"triton"/"liger"; "grpo_fast" comes from grpo-fast's
    plugin). n_micro: micro-batches per mini-batch in train_step (the batch size must divide by it).
    lm_head_own_fsdp_unit: None keeps verl 0.9.1's FSDP2 wrapping, which makes an untied lm_head (and embed_tokens)
    units of their own (`verl.utils.fsdp_utils._select_fsdp2_wrap_targets`; no config selects it); False keeps them in
    the root unit; True asks for own units (verl's default already for untied; refused for tied: shared weight).
    options (see build_configs): loss_agg_mode, clip_ratio[_low/_high], clip_ratio_c, entropy_coeff, use_kl_loss,
    kl_loss_type, kl_loss_coef, calculate_entropy, policy_loss (extra PolicyLossConfig fields), lora_alpha,
    gradient_checkpointing, lr, clip_grad (verl's default 1.0; train_step's gradients are taken before clipping),
    actor_overrides / engine_overrides / model_overrides (raw config fields)."""
    from verl.workers.utils.losses import ppo_loss

    config, actor_config = build_configs(model_dir, use_remove_padding=use_remove_padding,
                                         use_fused_kernels=use_fused_kernels, fused_backend=fused_backend,
                                         loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, lora_rank=lora_rank,
                                         seed=seed, **options)
    worker = CpuTrainingWorker(config, lm_head_own_fsdp_unit=lm_head_own_fsdp_unit, seed=seed)
    worker.reset()
    worker.set_loss_fn(functools.partial(ppo_loss, config=actor_config))
    return Actor(worker=worker, actor_config=actor_config, n_micro=n_micro, temperature=temperature,
                 use_remove_padding=use_remove_padding)


def _all_subclasses(cls):
    out, todo = set(), [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in out:
                out.add(s)
                todo.append(s)
    return out


def _localise_forward_patch(module, saved: dict) -> None:
    """verl's fused-kernel monkey patch (`patch_forward_with_backends`) assigns `model.__class__.forward`, i.e. for
    every Qwen2ForCausalLM in the process, later workers and the HF reference included. Move whatever a worker's build
    patched onto that worker's module instance and restore the classes, so workers do not leak into each other."""
    from transformers import PreTrainedModel

    for c in _all_subclasses(PreTrainedModel):
        now = c.__dict__.get("forward")
        if c in saved and now is not saved[c]:
            c.forward = saved[c]
            for m in module.modules():
                if type(m) is c or (isinstance(m, c) and c.__name__ in type(m).__name__):
                    m.forward = types.MethodType(now, m)
                    break


@contextlib.contextmanager
def _wrap_policy(lm_head_own_fsdp_unit: bool | None):
    """Select how FSDP2 wraps embed_tokens/lm_head (verl 0.9.1 has no config for it)."""
    if lm_head_own_fsdp_unit is None:
        yield
        return
    from torch import nn

    from verl.utils import fsdp_utils

    original = fsdp_utils._select_fsdp2_wrap_targets

    def select(model, layer_cls_names):
        tie = getattr(model.config, "tie_word_embeddings", False)
        if lm_head_own_fsdp_unit:
            if tie:
                raise ValueError("a tied lm_head shares embed_tokens' weight: it cannot be an FSDP unit of its own")
            return original(model, layer_cls_names)
        return [m for _, m in model.named_modules()
                if m.__class__.__name__ in layer_cls_names and not isinstance(m, nn.Embedding)]

    fsdp_utils._select_fsdp2_wrap_targets = select
    try:
        yield
    finally:
        fsdp_utils._select_fsdp2_wrap_targets = original


# --------------------------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------------------------


def make_batch(vocab: int, batch: int = 4, prompt_len: int = 6, response_len: int = 5, seed: int = 0,
               old_log_probs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
               ref_log_prob: bool | torch.Tensor = True, rollout_is_weights: bool | torch.Tensor = False):
    """A padded rollout batch as RayPPOTrainer holds it (verl DataProto): prompts left-padded, responses
    right-padded, of varied lengths (row 0 has a full prompt and a full response, others shorter), with
    input_ids/attention_mask/position_ids/response_mask, plus for the update: old_log_probs (default: a deterministic
    random stand-in near -log(vocab); use `with_old_log_probs` to put the infer() result), advantages (per-sequence
    +-1 scaled, broadcast over tokens, default), ref_log_prob (True: random stand-in), rollout_is_weights (True:
    random in [0.5, 1.5])."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    special = 3  # ids 0..3 are <pad>/<bos>/<eos>/<unk>
    prompts = torch.zeros(batch, prompt_len, dtype=torch.long)
    responses = torch.zeros(batch, response_len, dtype=torch.long)
    p_mask = torch.zeros(batch, prompt_len, dtype=torch.long)
    r_mask = torch.zeros(batch, response_len, dtype=torch.long)
    for i in range(batch):
        pl = prompt_len if i == 0 else int(torch.randint(1, prompt_len + 1, (1,), generator=g))
        rl = response_len if i == 0 else int(torch.randint(1, response_len + 1, (1,), generator=g))
        prompts[i, prompt_len - pl:] = torch.randint(special + 1, vocab, (pl,), generator=g)
        p_mask[i, prompt_len - pl:] = 1
        responses[i, :rl] = torch.randint(special + 1, vocab, (rl,), generator=g)
        r_mask[i, :rl] = 1
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    rm = r_mask.float()
    if old_log_probs is None:
        old_log_probs = (-torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(batch, response_len, generator=g))
    if advantages is None:
        sign = torch.where(torch.arange(batch) % 2 == 0, 1.0, -1.0)
        advantages = (sign * (0.5 + torch.rand(batch, generator=g))).unsqueeze(1).expand(batch, response_len)
    tensors = dict(prompts=prompts, responses=responses, input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids, response_mask=r_mask,
                   old_log_probs=old_log_probs.float() * rm, advantages=advantages.float().contiguous() * rm)
    if ref_log_prob is True:
        ref_log_prob = -torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(batch, response_len, generator=g)
    if isinstance(ref_log_prob, torch.Tensor):
        tensors["ref_log_prob"] = ref_log_prob.float() * rm
    if rollout_is_weights is True:
        rollout_is_weights = 0.5 + torch.rand(batch, response_len, generator=g)
    if isinstance(rollout_is_weights, torch.Tensor):
        tensors["rollout_is_weights"] = rollout_is_weights.float() * rm
    return DataProto.from_single_dict(tensors)


def with_old_log_probs(batch, log_probs: torch.Tensor, noise: float = 0.0, seed: int = 0):
    """A copy of `batch` whose old_log_probs are `log_probs` (+ deterministic gaussian noise, to make ratios != 1)."""
    out = copy.deepcopy(batch)
    rm = out.batch["response_mask"].float()
    g = torch.Generator().manual_seed(seed)
    out.batch["old_log_probs"] = (log_probs.float() + noise * torch.randn(log_probs.shape, generator=g)) * rm
    return out


def _to_no_padding(batch, temperature: float, **meta):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    proto = copy.deepcopy(batch)
    proto.meta_info["temperature"] = temperature
    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(td, **meta)
    return td


def infer_tensordict(batch, temperature: float, calculate_entropy: bool = True):
    """The TensorDict `infer_batch` gets from `RayPPOTrainer._compute_old_log_prob` (no-padding nested layout,
    temperature, calculate_entropy, compute_loss=False), plus the whole batch as one micro-batch
    (use_dynamic_bsz=False, micro_batch_size_per_gpu=B)."""
    return _to_no_padding(batch, temperature, calculate_entropy=calculate_entropy, calculate_sum_pi_squared=False,
                          compute_loss=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(batch))


def train_tensordict(batch, temperature: float, n_micro: int = 1, calculate_entropy: bool = False):
    """The TensorDict `train_mini_batch` gets from `RayPPOTrainer._update_actor` with the whole batch as one
    mini-batch (global_batch_size = mini_batch_size = B, epochs 1, no shuffle) split into n_micro micro-batches."""
    n = len(batch)
    assert n % n_micro == 0, (n, n_micro)
    return _to_no_padding(batch, temperature, calculate_entropy=calculate_entropy, distillation_use_topk=False,
                          distillation_only=False, global_batch_size=n, mini_batch_size=n, epochs=1, seed=42,
                          dataloader_kwargs={"shuffle": False}, compute_loss=True, use_dynamic_bsz=False,
                          micro_batch_size_per_gpu=n // n_micro)


def _unpack_infer(output, td):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    log_probs = no_padding_2_padding(tu.get(output, "log_probs"), td)
    entropy = no_padding_2_padding(tu.get(output, "entropy"), td)
    rm = td["response_mask"].to(log_probs.dtype)
    return log_probs * rm, entropy * rm


def infer(actor: Actor, batch, temperature: float | None = None):
    """verl's old-log-prob pass (`RayPPOTrainer._compute_old_log_prob` -> `infer_batch`, calculate_entropy=True,
    compute_loss=False), the whole batch as one micro-batch: (log_probs [B, response_len], entropy [B, response_len])
    in the actor's precision, zero on response padding. Works in-process and through Ray (`make_ray_actor`)."""
    temperature = actor.temperature if temperature is None else temperature
    td = infer_tensordict(batch, temperature)
    if actor.group is not None:
        output = actor.group.infer_batch(copy.copy(td)).get()
    else:
        output = actor.worker.infer_batch(copy.copy(td))
    return _unpack_infer(output, td)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()


def _param_name(name: str) -> str:
    # FSDP2 keeps the module tree; checkpoint/peft wrappers may add prefixes
    return name.replace("_checkpoint_wrapped_module.", "")


def train_step(actor: Actor, batch, temperature: float | None = None, calculate_entropy: bool | None = None) -> dict:
    """One `train_mini_batch` call as `RayPPOTrainer._update_actor` makes it (one mini-batch = the whole batch,
    `actor.n_micro` micro-batches, one epoch, no shuffle; calculate_entropy as the trainer sets it: actor
    calculate_entropy or entropy_coeff != 0). Returns {"metrics": verl's metrics dict as train_mini_batch returns it
    (lists, one entry per mini-batch: loss, grad_norm, actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, ...), "loss",
    "grad_norm" (floats), "grads": {param name: full gradient (the actor's precision), None if it got none}}. The
    gradients are read in
    `engine.optimizer_step` before verl's clip_grad_norm_ runs (so clipping never alters them; the optimizer step
    itself still sees clipped ones), for every parameter with requires_grad (LoRA: the adapters only)."""
    from verl.utils import tensordict_utils as tu

    temperature = actor.temperature if temperature is None else temperature
    cfg = actor.actor_config
    if calculate_entropy is None:
        calculate_entropy = bool(cfg.calculate_entropy or cfg.entropy_coeff != 0.0)
    assert actor.group is None, "train_step captures gradients in-process: use make_actor"
    td = train_tensordict(batch, temperature, actor.n_micro, calculate_entropy)
    w = actor.worker
    engine = w.engine
    grads: dict[str, torch.Tensor] = {}
    original_step = engine.optimizer_step

    def capturing_step():
        for name, p in engine.module.named_parameters():
            if p.requires_grad:  # None: the parameter got no gradient at all
                grads[_param_name(name)] = None if p.grad is None else _full(p.grad)
        return original_step()

    engine.optimizer_step = capturing_step
    try:
        output = w.train_mini_batch(td)
    finally:
        del engine.optimizer_step
    metrics = tu.get(output, "metrics")
    return {"metrics": metrics, "loss": float(metrics["loss"][0]), "grad_norm": float(metrics["grad_norm"][0]),
            "grads": grads}


def trainable_params(actor: Actor) -> dict[str, torch.Tensor]:
    """Current full float32 values of the trainable parameters."""
    return {_param_name(n): _full(p.data) for n, p in actor.worker.engine.module.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------------------------------------------------
# Independent reference
# --------------------------------------------------------------------------------------------------------------------


def hf_reference_logprobs(model_dir, batch, temperature: float = 1.0, dtype: torch.dtype = torch.float64):
    """Recompute with plain transformers on the saved weights in ``dtype``, one sequence at a time without padding:
    (log_probs, entropy) [B, response_len] of log_softmax(logits / T) at the response tokens."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype, attn_implementation="eager")
    model.eval()
    ids, am = batch.batch["input_ids"], batch.batch["attention_mask"]
    rm = batch.batch["response_mask"]
    B, R = rm.shape
    P = ids.shape[1] - R
    lp = torch.zeros(B, R, dtype=dtype)
    ent = torch.zeros(B, R, dtype=dtype)
    with torch.no_grad():
        for i in range(B):
            keep = am[i].bool()
            seq = ids[i, keep].unsqueeze(0)
            logits = model(input_ids=seq, use_cache=False).logits[0] / temperature
            logp = torch.log_softmax(logits, dim=-1)
            n_prompt = int(am[i, :P].sum())
            n_resp = int(rm[i].sum())
            rows = logp[n_prompt - 1: n_prompt - 1 + n_resp]
            lp[i, :n_resp] = rows.gather(-1, seq[0, n_prompt: n_prompt + n_resp].unsqueeze(-1)).squeeze(-1)
            ent[i, :n_resp] = -(rows.exp() * rows).sum(-1)
    return lp, ent


def hf_param_shapes(model_dir) -> dict[str, torch.Size]:
    """{name: shape} of the HF model's parameters (tied weights once, as named_parameters gives them): the names
    train_step's gradients use for a full (non-LoRA) actor."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    return {n: p.shape for n, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------------------------
# Ray
# --------------------------------------------------------------------------------------------------------------------

def ray_init(num_cpus: int = 2):
    """ray.init for the CPU worker group: no dashboard, this directory on the workers' PYTHONPATH (they unpickle
    CpuTrainingWorker from this module) and the CPU platform selected there (VERL_PLATFORM=cpu)."""
    import ray

    paths = [str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "VERL_PLATFORM": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
           "VERL_LOGGING_LEVEL": "WARN"}
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})


def make_ray_actor(model_dir, *, use_remove_padding: bool, temperature: float = 1.0, n_micro: int = 1,
                   lm_head_own_fsdp_unit: bool | None = None, seed: int = 0, world_size: int = 1,
                   **options) -> Actor:
    """The same actor as make_actor, but as verl's RayWorkerGroup over RayResourcePool(use_gpu=False) (one CPU
    bundle per worker: max_colocate_count=1, since verl's default of 10 CPUs a bundle does not fit a small machine),
    reset and given its loss fn through the group. Call ray_init() first; infer() drives it."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.utils.losses import ppo_loss
    import ray

    config, actor_config = build_configs(model_dir, use_remove_padding=use_remove_padding, seed=seed, **options)
    pool = RayResourcePool(process_on_nodes=[world_size], use_gpu=False, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(CpuTrainingWorker), config=config,
                               lm_head_own_fsdp_unit=lm_head_own_fsdp_unit, seed=seed)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, use_gpu=False)
    group.reset()
    group.set_loss_fn(functools.partial(ppo_loss, config=actor_config))
    return Actor(worker=None, actor_config=actor_config, n_micro=n_micro, temperature=temperature,
                 use_remove_padding=use_remove_padding, group=group)
