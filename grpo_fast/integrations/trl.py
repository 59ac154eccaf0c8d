"""TRL drop-in: ``FastGRPOTrainer`` is TRL's ``GRPOTrainer`` with grpo-fast's loss and log-prob passes.

    from grpo_fast.integrations.trl import FastGRPOTrainer   # was: from trl import GRPOTrainer
    trainer = FastGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

Same constructor, same config, same generation, rewards, advantages, logging and checkpoints. Two methods change:

- ``_compute_loss``: the model's own forward runs with a forward pre-hook on its output embedding (the lm_head) that
  keeps the hidden states and hands the head an empty slice, so the ``[B, T, V]`` logits never exist; then
  ``grpo_loss(hidden, lm_head.weight, completion_ids, ...)`` computes TRL 1.16's ``_compute_loss`` with TRL's
  gradient-accumulation scaling and logs the metrics TRL logs (kl, entropy, clip_ratio/*, cispo_clip_ratio,
  vespo/phi_seq_mean, policy_loss, entropy_coef).
- ``_get_per_token_logps_and_entropies`` (old-policy and reference log-probs): the same hidden states through
  ``fused_logprobs``.

The hook lives on one module for the duration of one forward call and is removed in a ``finally``: nothing is patched
globally, a plain ``GRPOTrainer`` in the same process is untouched, and the forward still goes through every wrapper
the model has (accelerate/DDP, PEFT adapters, autocast). Options this trainer cannot reproduce exactly are refused when
it is constructed, never ignored (the table with the reasons is in ``docs/trl.md``). ``train`` adds one check: a
resume under DeepSpeed, whose engine unpickles checkpoint files in full, is refused unless the checkpoint is trusted
(``trust_deepspeed_checkpoints``); every other file a resume reads is loaded as tensors and plain values only.

Importing this module imports trl (>= 1.16); ``import grpo_fast`` does not.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import warnings

import torch

from grpo_fast.bnb_layout import keep_training_layout, quiet_cpu_kernel_message

quiet_cpu_kernel_message()  # TRL imports peft, which imports bitsandbytes: not its CPU 4-bit kernel message
# TRL imports vLLM where it is installed; vLLM's CPU build says at import that it disables Triton, which concerns
# vLLM's own kernels only (grpo-fast's run under TRITON_INTERPRET or on a GPU): that one line is left out
logging.getLogger("vllm.triton_utils.importing").addFilter(
    lambda record: not record.getMessage().startswith("Triton is installed, but doesn't include CPU backend"))

try:
    # importing TRL checks the installed vLLM against the range TRL was tested with and warns when it is outside
    # (vLLM 0.32, which grpo-fast's own --rollout vllm is tested with, is); that concerns TRL's use_vllm=True path
    # only, and TRL checks again when a trainer takes it: so that one warning is left out of the import alone
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"TRL currently supports vLLM versions", category=UserWarning)
        import trl
        from trl import GRPOTrainer
        from trl.trainer.utils import nanmax, nanmin
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "grpo_fast.integrations.trl needs TRL >= 1.16 (pip install 'grpo-fast[trl]' or pip install 'trl>=1.16'); "
        f"importing it failed: {exc}"
    ) from exc

from packaging.version import Version

from grpo_fast.config import REFUSED_LOSS_TYPES, GRPOLossConfig, LossType
from grpo_fast.integrations import heads
from grpo_fast.logprobs import fused_logprobs
from grpo_fast.loss import grpo_loss, grpo_loss_from_logps, micro_batch_scale

MIN_TRL = "1.16"
if Version(trl.__version__) < Version(MIN_TRL):
    raise ImportError(
        f"grpo_fast.integrations.trl needs trl >= {MIN_TRL} (its loss semantics are TRL {MIN_TRL}'s), "
        f"got trl {trl.__version__}: pip install -U 'trl>={MIN_TRL}'"
    )

__all__ = ["FastGRPOTrainer"]

# The GRPOConfig fields of TRL 1.16 beyond TrainingArguments. A field outside this set is an option a newer TRL added
# and this trainer does not know: it is refused when set away from its default instead of being silently ignored.
_KNOWN_GRPO_FIELDS = frozenset(
    """model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32 num_generations
    num_generations_eval max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of
    generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs chat_template_kwargs
    repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode
    vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout
    vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size beta num_iterations
    epsilon delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg
    vespo_lambda_neg importance_sampling_level reward_weights multi_objective_aggregation scale_rewards loss_type
    mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile
    entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target
    max_tool_calling_iterations vllm_importance_sampling_correction vllm_importance_sampling_mode
    vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min off_policy_mask_threshold
    use_bias_correction_kl log_completions log_multimodal num_completions_to_print log_unique_prompts
    log_completions_hub_repo use_transformers_continuous_batching transformers_continuous_batching_config
    use_transformers_paged vllm_importance_sampling_cap""".split()
)

class FastGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose loss runs through ``grpo_loss`` from the last hidden state and the lm_head weight.

    Constructor, config and behaviour are TRL's (the parity tests compare losses, metrics and parameters after
    training with ``GRPOTrainer`` for every loss type). Unsupported options raise ``ValueError`` here, naming the
    option. ``impl`` (class attribute) is the grpo-fast implementation: ``"auto"`` (Triton on CUDA when available,
    else the chunked torch path).
    """

    impl = "auto"
    # DeepSpeed's engine unpickles the global_step*/ files of a checkpoint in full: resuming from one is refused
    # unless this is set (for checkpoints you wrote or otherwise trust); see ``train``
    trust_deepspeed_checkpoints = False

    @functools.wraps(GRPOTrainer.__init__)
    def __init__(self, *args, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if config is not None:  # refuse before any model is loaded
            _refuse(_config_refusals(config))
        super().__init__(*args, **kwargs)
        _refuse(_config_refusals(self.args) + self._model_refusals())
        # a 4-bit base never repacks itself for CPU inference (an eval pass would leave it unable to train)
        keep_training_layout(self.model, "FastGRPOTrainer model")
        self._softcap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        self._logit_scale = heads.logit_scale(self.model.config.get_text_config())
        try:
            self._loss_config()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"FastGRPOTrainer: this GRPOConfig does not map onto grpo-fast's loss: {exc}") from exc

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """TRL's ``train``. A resume reads the checkpoint as transformers' ``Trainer`` does: the weights from
        safetensors, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and ``rng_state.pth`` through
        ``torch.load(weights_only=True)`` (tensors and plain values; ``rng_state.pth`` also numpy's RNG arrays),
        ``trainer_state.json`` as JSON; a file that needs more is refused by torch's unpickler before anything in it
        runs. Under DeepSpeed the engine reads its ``global_step*/`` files with ``torch.load(weights_only=False)``,
        which runs any code a planted file holds: that resume is refused unless ``trust_deepspeed_checkpoints``."""
        resuming = resume_from_checkpoint is not None and resume_from_checkpoint is not False
        if resuming and self.is_deepspeed_enabled and not self.trust_deepspeed_checkpoints:
            raise ValueError(
                f"FastGRPOTrainer.train(resume_from_checkpoint={resume_from_checkpoint!r}) under DeepSpeed: "
                "DeepSpeed's engine reads the checkpoint's global_step*/ files with torch.load(weights_only=False), "
                "which runs any code a file planted there holds; for a checkpoint you wrote or otherwise trust, set "
                "trainer.trust_deepspeed_checkpoints = True first")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ----------------------------------------------------------------------------------------------------------------
    # Construction-time checks

    def _model_refusals(self) -> list[str]:
        from accelerate.utils import is_peft_model

        out = []
        if self._is_vlm:
            out.append(f"processing_class={type(self.processing_class).__name__} (a vision-language processor): "
                       "multimodal inputs are not supported by FastGRPOTrainer; use trl.GRPOTrainer")
        if self.aux_loss_enabled:
            out.append(f"router_aux_loss_coef={self.router_aux_loss_coef} on a MoE model: the load-balancing loss is "
                       "not added by FastGRPOTrainer; pass GRPOConfig(router_aux_loss_coef=0.0) to train without it")
        if self.is_fsdp_enabled:
            out.append("FSDP: FastGRPOTrainer reads lm_head.weight outside the sharded forward; not supported")
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_deepspeed_enabled and plugin is not None and plugin.zero_stage == 3:
            out.append("DeepSpeed ZeRO-3: FastGRPOTrainer reads lm_head.weight outside the sharded forward; "
                       "use ZeRO-1/2 or trl.GRPOTrainer")
        if self.accelerator.num_processes > 1 and self.top_entropy_quantile < 1.0:
            out.append(f"top_entropy_quantile={self.top_entropy_quantile} on {self.accelerator.num_processes} "
                       "processes: TRL's quantile spans all processes, grpo-fast's mask is per process; "
                       "use top_entropy_quantile=1.0 or one process")
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):
            peft_config = model.peft_config[model.active_adapter]
            if getattr(peft_config, "is_prompt_learning", False):
                out.append(f"peft_config={type(peft_config).__name__} (prompt learning): not supported by "
                           "FastGRPOTrainer; use a LoRA-style adapter")
        head = model.get_output_embeddings()
        if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
            out.append(f"{type(model).__name__} has no output embedding with a weight (get_output_embeddings() "
                       f"returned {type(head).__name__}); FastGRPOTrainer needs the lm_head weight")
        elif type(head).__module__.split(".")[0] == "peft" and type(head).__name__ != "ModulesToSaveWrapper":
            # modules_to_save=["lm_head"] is fine: the wrapper's .weight is the trainable copy (the original while
            # adapters are disabled, i.e. in the reference pass). A tuner layer's .weight is the frozen base.
            out.append(f"a PEFT adapter on the lm_head ({type(head).__name__}): the loss reads lm_head.weight "
                       "directly, so the adapter would get no gradient; remove 'lm_head' from target_modules (or "
                       "train a full copy of it with modules_to_save=['lm_head'])")
        elif not head.weight.dtype.is_floating_point:
            out.append(f"a quantized lm_head (weight dtype {head.weight.dtype}): the fused log-prob op needs a "
                       "floating-point weight; keep the lm_head unquantized (e.g. llm_int8_skip_modules=['lm_head'])")
        return out

    def _loss_config(self) -> GRPOLossConfig:
        """TRL's loss options (the trainer attributes TRL's ``_compute_loss`` reads, so runtime changes count).
        The entropy bonus is never part of it: TRL scales it by GA alone, so it is added in ``_compute_loss``."""
        args = self.args
        return GRPOLossConfig(
            loss_type=self.loss_type,
            beta=self.beta,
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=args.delta,
            importance_sampling_level=self.importance_sampling_level,
            temperature=self.temperature,
            softcap=self._softcap,
            use_bias_correction_kl=args.use_bias_correction_kl,
            max_completion_length=self.max_completion_length,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            top_entropy_quantile=self.top_entropy_quantile,
            entropy_coef=0.0,
        )

    # ----------------------------------------------------------------------------------------------------------------
    # Hidden states instead of logits

    def _lm_head_inputs(self, model, input_ids, attention_mask, logits_to_keep):
        """Run ``model``'s own forward without its lm_head projection.

        Returns ``hidden [B, logits_to_keep, H]`` (``hidden[:, t]`` predicts ``input_ids[:, -logits_to_keep + t]``),
        the lm_head ``weight [V, H]`` and ``bias [V]`` (or None), all in the dtype TRL's fused head computes in (the
        autocast dtype inside ``accelerator.autocast()``, float32 with ``cast_lm_head_to_fp32``, else the hidden
        states' dtype), with the model's logit scale folded into hidden and bias, and a context that turns autocast
        off so the fused op runs in exactly that dtype.
        """
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        captured = []

        def keep_hidden_skip_projection(module, args):
            captured.append(args[0])
            return (args[0][..., :0, :], *args[1:])  # the head projects zero positions: [B, 0, V] logits

        handle = head.register_forward_pre_hook(keep_hidden_skip_projection)
        try:
            with self.accelerator.autocast():
                model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                device_type = input_ids.device.type
                autocast_dtype = (torch.get_autocast_dtype(device_type)
                                  if torch.is_autocast_enabled(device_type) else None)
        finally:
            handle.remove()
        if len(captured) != 1 or tuple(captured[0].shape[:-1]) != tuple(input_ids.shape):
            raise RuntimeError(
                f"FastGRPOTrainer: expected the lm_head ({type(head).__name__}) to be called once on hidden states of "
                f"shape [{', '.join(map(str, input_ids.shape))}, H]; got "
                f"{[tuple(h.shape) for h in captured]}. This model's forward is not supported"
            )
        hidden = captured[0][:, -logits_to_keep - 1 : -1]
        weight, bias = head.weight, getattr(head, "bias", None)
        if self.args.cast_lm_head_to_fp32:
            dtype = torch.float32
        else:
            dtype = autocast_dtype or hidden.dtype
        hidden = hidden.to(weight.device, dtype)
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        hidden, bias = heads.scaled(hidden, bias, self._logit_scale)  # TRL's fused head: before softcap, temperature
        return hidden, weight, bias, torch.autocast(device_type, enabled=False)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal_inputs,
    ):
        """TRL's old-policy / reference log-prob pass (and entropies) through ``fused_logprobs``: ``[B, T]`` each,
        0 where ``attention_mask`` is 0, as TRL's fused head returns them."""
        given = sorted(k for k, v in multimodal_inputs.items() if v is not None)
        if given:
            raise ValueError(f"FastGRPOTrainer: multimodal inputs are not supported, got {given}")
        if compute_aux_loss:
            raise ValueError("FastGRPOTrainer: the MoE auxiliary loss is not supported (router_aux_loss_coef=0.0)")
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, am = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            hidden, weight, bias, no_autocast = self._lm_head_inputs(model, ids, am, logits_to_keep)
            with no_autocast:
                out = fused_logprobs(
                    hidden, weight, ids[:, -logits_to_keep:].to(hidden.device), bias=bias,
                    temperature=self.temperature, softcap=self._softcap, return_entropy=compute_entropy,
                    impl=self.impl,
                )
            logps, entropy = out if compute_entropy else (out, None)
            scored = am[:, -logits_to_keep:].to(logps.device).bool()
            all_logps.append(logps.masked_fill(~scored, 0.0))
            if compute_entropy:
                all_entropies.append(entropy.masked_fill(~scored, 0.0))
        entropies = torch.cat(all_entropies) if compute_entropy else None
        return torch.cat(all_logps), entropies, None

    # ----------------------------------------------------------------------------------------------------------------
    # The loss

    def _compute_loss(self, model, inputs):
        given = sorted(k for k in _MULTIMODAL_KEYS if inputs.get(k) is not None)
        if given:
            raise ValueError(f"FastGRPOTrainer: multimodal inputs are not supported, got {given}")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mode = "train" if self.model.training else "eval"
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0

        advantages = inputs["advantages"]  # [B] or [B, T]; TRL's unsqueezed form feeds the metrics
        adv_2d = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = inputs.get("old_per_token_logps")
        ref = inputs["ref_per_token_logps"] if self.beta != 0.0 else None
        if self.loss_type == "vespo":  # TRL folds any importance-sampling ratio into the gamma weight
            sampling_ratio = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            sampling_ratio = inputs["importance_sampling_ratio"]
        else:
            sampling_ratio = None
        num_items, rescale = self._token_normaliser(inputs, mode)
        config = self._loss_config()

        hidden, weight, bias, no_autocast = self._lm_head_inputs(model, input_ids, attention_mask, logits_to_keep)
        targets = completion_ids.to(hidden.device)
        scored = completion_mask.bool()
        kw = dict(old_logps=old, ref_logps=ref, num_items_in_batch=num_items)
        entropies = entropy_mask = None
        with no_autocast:
            if not self._entropy_bonus_enabled and self.off_policy_mask_threshold is None:
                out = grpo_loss(hidden, weight, targets, advantages, mask, sampling_ratio=sampling_ratio, bias=bias,
                                config=config, impl=self.impl, **kw)
            else:  # the bonus and the off-policy mask need the per-token log-probs / entropies outside the loss
                logps, entropies = fused_logprobs(hidden, weight, targets, bias=bias, temperature=self.temperature,
                                                  softcap=self._softcap, return_entropy=True, impl=self.impl)
                logps, entropies = logps.masked_fill(~scored, 0.0), entropies.masked_fill(~scored, 0.0)
                if self.off_policy_mask_threshold is not None:
                    off_policy_mask = self.get_off_policy_mask(
                        advantages=adv_2d,
                        per_token_logps=logps,
                        sampling_per_token_logps=inputs.get(
                            "sampling_per_token_logps", logps.detach() if old is None else old
                        ),
                        mask=mask,
                        off_policy_threshold=self.off_policy_mask_threshold,
                    ).to(logps.dtype)  # [B, 1] of 0/1: multiplies the policy term exactly as a sampling ratio does
                    sampling_ratio = off_policy_mask if sampling_ratio is None else sampling_ratio * off_policy_mask
                out = grpo_loss_from_logps(logps, advantages, mask, sampling_ratio=sampling_ratio,
                                           entropy=entropies.detach(), config=config, impl=self.impl, **kw)

        # TRL's scaling: dapo/cispo/vespo by their normaliser's rescale (1 unless it is below 1), the rest by 1 / GA
        scale = micro_batch_scale(config.loss_type, 1 / ga, 1 / ga) * rescale
        loss = out.loss * scale if scale != 1.0 else out.loss
        policy_loss = (loss if config.loss_type.divides_by_num_items else out.loss).detach()

        if self._entropy_bonus_enabled:
            if self.top_entropy_quantile < 1.0:
                entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            effective_mask = mask if entropy_mask is None else mask * entropy_mask
            entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / ga
            loss = loss - self.entropy_coef * entropy_loss
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

        logps = out.per_token_logps.masked_fill(~scored, 0.0)  # TRL's fused head gives 0 at padding
        self._log_loss_metrics(mode, mask, logps, old, ref, adv_2d, inputs, out, entropies)
        return loss

    def _token_normaliser(self, inputs, mode):
        """dapo/cispo/vespo: TRL divides by ``num_items_in_batch / num_processes`` (times ``GA / steps_per_generation``
        in training). grpo_loss clamps its denominator at 1, so a smaller one is passed as 1 plus a rescale."""
        if not LossType(self.loss_type).divides_by_num_items:
            return None, 1.0
        normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normaliser = normaliser * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        if float(normaliser) < 1.0:
            return 1.0, 1.0 / float(normaliser)
        return normaliser, 1.0

    def _log_loss_metrics(self, mode, mask, logps, old, ref, advantages, inputs, out, entropies):
        """The metrics TRL's ``_compute_loss`` logs, with TRL's reductions over processes."""
        logps = logps.detach()
        old = logps if old is None else old
        metrics = self._metrics[mode]

        def reduce_mean(local_sum, local_count):
            totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def global_masked_mean(x):
            if x.shape[1] == 1:  # one value per sequence
                return reduce_mean(x.sum(), torch.tensor(float(x.shape[0]), device=x.device))
            return reduce_mean((x * mask).sum(), mask.sum().float())

        def masked_seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        log_ratio = logps - old
        if self.importance_sampling_level == "token":
            coef_1 = torch.exp(log_ratio)
        else:
            coef_1 = torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)

        if self.beta != 0.0:
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * coef_1
            metrics["kl"].append(global_masked_mean(kl))
        if entropies is not None:
            metrics["entropy"].append(global_masked_mean(entropies.detach()))
        else:  # LossOutput.entropy is the local masked mean: mean * count is the local sum
            count = mask.sum().float()
            metrics["entropy"].append(reduce_mean(out.entropy.to(count.dtype) * count, count))

        if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            if self.args.delta is not None:  # TRL clamps coef_1 in place before it counts the clipped ratios
                coef_1 = torch.clamp(coef_1, max=self.args.delta)
            is_low = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
            is_high = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
            metrics["clip_ratio/low_mean"].append(global_masked_mean(is_low.float()))
            metrics["clip_ratio/high_mean"].append(global_masked_mean(is_high.float()))
            metrics["clip_ratio/region_mean"].append(global_masked_mean((is_low | is_high).float()))
            low_seq = self.accelerator.gather(masked_seq_mean(is_low.float()))
            metrics["clip_ratio/low_min"].append(nanmin(low_seq).item())
            high_seq = self.accelerator.gather(masked_seq_mean(is_high.float()))
            metrics["clip_ratio/high_max"].append(nanmax(high_seq).item())
        elif self.loss_type == "cispo":
            is_clipped = (coef_1 > self.epsilon_high) & (advantages > 0)
            metrics["cispo_clip_ratio"].append(global_masked_mean(is_clipped.float()))
        elif self.loss_type == "vespo":
            args = self.args
            phi_seq = self.get_gamma_weights(
                advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"), k_pos=args.vespo_k_pos,
                lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg, lambda_neg=args.vespo_lambda_neg,
            )
            metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi_seq))


# The multimodal keys TRL's _compute_loss forwards to the model.
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _config_refusals(args) -> list[str]:
    out = []
    if getattr(args, "use_liger_kernel", False):
        out.append("use_liger_kernel=True: Liger patches the model classes globally and grpo-fast already replaces "
                   "the loss head; expected use_liger_kernel=False")
    if args.use_adaptive_entropy:
        out.append("use_adaptive_entropy=True: the adaptive entropy controller is not supported; expected "
                   "use_adaptive_entropy=False (a fixed entropy_coef is)")
    not_in_trl = [t.value for t in LossType if not t.in_trl]
    if args.loss_type in not_in_trl or args.loss_type in REFUSED_LOSS_TYPES:
        out.append(f"loss_type={args.loss_type!r}: verl's policy loss, which TRL {MIN_TRL}'s GRPOTrainer does not have "
                   f"(its _compute_loss raises 'Unknown loss type'); expected one of "
                   f"{', '.join(t.value for t in LossType if t.in_trl)}. grpo_fast.grpo_loss (GRPOLossConfig) offers "
                   f"{', '.join(not_in_trl)}, grpo_fast.verl_losses.policy_loss every verl loss")
    if args.off_policy_mask_threshold is not None and args.loss_type == "vespo":
        out.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold} with loss_type='vespo': VESPO folds "
                   "importance weights into its gamma weight, so the mask cannot be applied; expected "
                   "off_policy_mask_threshold=None or another loss_type")
    for field in dataclasses.fields(args):
        if field.name in _KNOWN_GRPO_FIELDS or not _is_grpo_field(field.name):
            continue
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        value = getattr(args, field.name)
        if value != default:
            out.append(f"{field.name}={value!r}: a GRPOConfig option newer than TRL {MIN_TRL} that FastGRPOTrainer "
                       f"does not know; expected its default {default!r}")
    return out


@functools.lru_cache(maxsize=None)
def _training_argument_names() -> frozenset:
    from transformers import TrainingArguments

    return frozenset(f.name for f in dataclasses.fields(TrainingArguments))


def _is_grpo_field(name: str) -> bool:
    return name not in _training_argument_names()


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ValueError(
            "FastGRPOTrainer cannot reproduce GRPOTrainer with these options (use trl.GRPOTrainer for them, see "
            "docs/trl.md):\n  - " + "\n  - ".join(problems)
        )
