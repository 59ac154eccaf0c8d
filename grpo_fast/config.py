"""The loss-type enum and the one frozen config every loss implementation reads.

Field names and defaults follow TRL 1.16's ``GRPOConfig`` so that a TRL config maps onto this one field by field.
Validation happens here, once, at the public boundary.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
from dataclasses import dataclass

from grpo_fast.checks import SAPO_TEMPERATURE, check_bool, check_softcap, float32_value, temperature_value


class LossType(str, enum.Enum):
    """Every GRPO variant grpo-fast implements: TRL 1.16's ``loss_type`` values, then verl 0.9.1's per-token policy
    losses that TRL lacks (``grpo_fast.verl_losses`` has verl's own aggregation and metrics for them; these are the
    same per-token terms on grpo-fast's options: docs/design.md §4). ``REFUSED_LOSS_TYPES`` lists verl's losses that
    have no form here, and why."""

    GRPO = "grpo"
    BNPO = "bnpo"
    DR_GRPO = "dr_grpo"
    DAPO = "dapo"
    CISPO = "cispo"
    SAPO = "sapo"
    LUSPO = "luspo"
    VESPO = "vespo"
    DPPO_TV = "dppo_tv"
    DPPO_KL = "dppo_kl"
    GPG = "gpg"
    DRO = "dro"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and value in REFUSED_LOSS_TYPES:
            raise ValueError(f"loss_type={value!r} (verl's policy loss) is not offered by grpo-fast's GRPOLossConfig: "
                             f"{REFUSED_LOSS_TYPES[value]}; grpo_fast.verl_losses.policy_loss({value!r}, ...) has it")
        return None

    @property
    def is_clip_family(self) -> bool:
        """PPO-style ``-min(r*A, clip(r)*A)`` objective (TRL's low/high clip metrics; ``clip_metrics``)."""
        return self in _CLIP_FAMILY

    @property
    def policy_through_ratio(self) -> bool:
        """The policy term is differentiated through the ratio r (the clip family, sapo); the others detach it or
        have none, so r reaches the gradient only through the bias-corrected KL."""
        return self.is_clip_family or self == LossType.SAPO

    @property
    def is_dppo(self) -> bool:
        """verl's DPPO (dppo_tv, dppo_kl): a truncated, detached ratio times ``A logp`` on the tokens inside a binary
        TV / KL trust region."""
        return self in (LossType.DPPO_TV, LossType.DPPO_KL)

    @property
    def divides_by_num_items(self) -> bool:
        """The loss is a sum over tokens divided by ``num_items_in_batch`` (dapo, cispo, vespo and verl's dppo_tv,
        dppo_kl, gpg, dro: verl's "token-mean" over its global token count; TRL's normaliser is then the generation
        batch's token count): with the whole batch's count there, a micro-batch's loss needs no gradient-accumulation
        weight (``grpo_fast.loss.micro_batch_scale``)."""
        return self in _NUM_ITEMS_DIVIDED

    @property
    def in_trl(self) -> bool:
        """TRL 1.16's ``GRPOTrainer`` has this loss type (the TRL drop-in and the TRL parity tests take only these)."""
        return self not in _VERL_ONLY

    @property
    def allows_sequence_level(self) -> bool:
        """``importance_sampling_level="sequence"`` has a meaning: not for verl's per-token losses, whose ratio (dppo)
        is truncated and detached per token, or absent (gpg, dro)."""
        return self not in _VERL_ONLY

    @property
    def clip_metrics(self) -> tuple[bool, bool, bool]:
        """Which of ``LossOutput.clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_region`` the type defines (the
        clip family: all three, TRL's; cispo: high, TRL's ``cispo_clip_ratio``; dppo: all three, the tokens outside
        the trust region with A < 0, with A > 0, and at all: verl's ``pg_clipfrac``)."""
        if self.is_clip_family or self.is_dppo:
            return True, True, True
        return False, self == LossType.CISPO, False


_CLIP_FAMILY = frozenset({LossType.GRPO, LossType.BNPO, LossType.DR_GRPO, LossType.DAPO, LossType.LUSPO})
_VERL_ONLY = frozenset({LossType.DPPO_TV, LossType.DPPO_KL, LossType.GPG, LossType.DRO})
_NUM_ITEMS_DIVIDED = frozenset({LossType.DAPO, LossType.CISPO, LossType.VESPO}) | _VERL_ONLY
# verl 0.9.1's policy losses that GRPOLossConfig does not offer, and why (grpo_fast.verl_losses.policy_loss has them)
REFUSED_LOSS_TYPES = {
    "clip_cov": "it zeroes tokens drawn at random (torch.randperm on the global generator) among those of high "
                "covariance, so the loss is not a deterministic function of the batch, and the draw has no kernel form",
    "kl_cov": "it picks its tokens by a top-k of a covariance over the whole batch (a sort across the batch), not by "
              "a per-token rule",
    "geo_mean": "it is a sequence-level geometric-mean ratio with an aggregation of its own (torch.mean over rows), "
                "not a per-token term",
}
DPPO_DEFAULT_CAP = 20.0  # verl's dppo_* truncation of the ratio without clip_ratio_c (config.get("clip_ratio_c", 20.0))
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _allowed(values) -> str:
    return ", ".join(repr(v.value if isinstance(v, enum.Enum) else v) for v in values)


def _field(default, help: str):
    """A field with a default and its description as ``help`` metadata (the ``--loss.NAME`` line of ``--help``)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class GRPOLossConfig:
    """Options of the GRPO loss. Semantics: docs/design.md §4 (TRL 1.16 ``GRPOTrainer._compute_loss``).

    Each field's ``help`` metadata (``dataclasses.fields(GRPOLossConfig)``) is its one description: ``grpo-fast
    train --help`` prints it as the ``--loss.NAME`` line. The bias-corrected KL is ``beta * r * (exp(ref - logp) -
    (ref - logp) - 1)`` with ``r = exp(logp - old_logp)``: on policy (``old_logp = logp.detach()``) ``r`` is 1 in
    value but not in gradient, so the term's gradient is ``(logp - ref) * d logp``, the score-function gradient of
    KL(policy || ref); without ``r`` (``use_bias_correction_kl=False``) it is ``(1 - exp(ref - logp)) * d logp``.
    """

    loss_type: LossType | str = _field(
        LossType.DAPO, f"{', '.join(t.value for t in LossType if t.in_trl)} (TRL 1.16 semantics); "
        f"{', '.join(t.value for t in LossType if not t.in_trl)} (verl 0.9.1's per-token losses, token-mean); verl's "
        f"{', '.join(REFUSED_LOSS_TYPES)} are refused here (grpo_fast.verl_losses.policy_loss has them)")
    beta: float = _field(0.0, "KL coefficient against the reference model (0: no reference model is kept)")
    epsilon: float = _field(0.2, "lower clip of the importance ratio (1 - epsilon; TRL's epsilon_low); dppo_tv / "
                                 "dppo_kl: the trust region's bound for A <= 0 (verl's clip_ratio_low)")
    epsilon_high: float | None = _field(None, "upper clip (1 + epsilon_high; None: epsilon); cispo's truncation "
                                        "bound, the cap on the ratio itself (TRL recommends 5.0); dppo_tv / dppo_kl: "
                                        "the trust region's bound for A > 0 (verl's clip_ratio_high)")
    delta: float | None = _field(None, "two-sided clipping: cap the unclipped ratio at delta (None: off); dppo_tv / "
                                 "dppo_kl: the cap of their truncated ratio, verl's clip_ratio_c (None: 20.0, the "
                                 "fallback in verl's dppo code; a default verl run sets 3.0)")
    importance_sampling_level: str = _field("token", "token, or sequence (GSPO)")
    temperature: float = _field(1.0, "the logits are divided by it, after softcap, exactly as at sampling time "
                                     "(at least 0.01: grpo_fast.checks.MIN_TEMPERATURE)")
    softcap: float | None = _field(None, "final-logit softcapping z = softcap * tanh(z / softcap), before the "
                                   "temperature, exactly as at sampling time (None: off)")
    use_bias_correction_kl: bool = _field(True, "multiply the KL term by the importance ratio (TRL 1.16's default; "
                                          "false: plain k3)")
    max_completion_length: int | None = _field(None, "dr_grpo's constant normaliser: the loss is divided by the "
                                               "batch size x this (None: the completions' padded length T)")
    sapo_temperature_pos: float = _field(1.0, "SAPO gate temperature for positive advantages (at least 0.01)")
    sapo_temperature_neg: float = _field(1.05, "SAPO gate temperature for negative advantages (at least 0.01)")
    vespo_k_pos: float = _field(2.0, "VESPO k for positive advantages")
    vespo_lambda_pos: float = _field(3.0, "VESPO lambda for positive advantages")
    vespo_k_neg: float = _field(3.0, "VESPO k for negative advantages")
    vespo_lambda_neg: float = _field(2.0, "VESPO lambda for negative advantages")
    top_entropy_quantile: float = _field(1.0, "train only on the top q fraction of tokens by entropy (1.0: all)")
    entropy_coef: float = _field(0.0, "entropy bonus coefficient (0: none)")
    dro_beta: float | None = _field(None, "dro's weight of the quadratic log-ratio penalty 0.5 * dro_beta * (logp - "
                                    "old)^2 (verl's policy_loss.dro_beta; > 0, required for loss_type dro)")

    def __post_init__(self):
        name = getattr(self.loss_type, "value", self.loss_type)
        if isinstance(name, str) and name in REFUSED_LOSS_TYPES:
            raise ValueError(
                f"GRPOLossConfig.loss_type {name!r} (verl's policy loss) is not offered here: "
                f"{REFUSED_LOSS_TYPES[name]}; grpo_fast.verl_losses.policy_loss({name!r}, ...) computes it with verl's "
                "semantics"
            )
        try:
            object.__setattr__(self, "loss_type", LossType(self.loss_type))
        except ValueError:
            raise ValueError(
                f"GRPOLossConfig.loss_type must be one of {_allowed(LossType)}, got {self.loss_type!r}"
            ) from None
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                "GRPOLossConfig.importance_sampling_level must be one of "
                f"{_allowed(IMPORTANCE_SAMPLING_LEVELS)}, got {self.importance_sampling_level!r}"
            )
        if self.importance_sampling_level == "sequence" and not self.loss_type.allows_sequence_level:
            raise ValueError(
                f"GRPOLossConfig.importance_sampling_level 'sequence' with GRPOLossConfig.loss_type "
                f"{self.loss_type.value!r}: verl's per-token losses have no sequence-level ratio (dppo truncates and "
                "detaches each token's ratio, gpg and dro have none); expected importance_sampling_level='token'"
            )
        self._check_real("beta", low=0.0)
        self._check_real("epsilon", low=0.0)
        if self.epsilon_high is not None:
            self._check_real("epsilon_high", low=0.0)
        if self.delta is not None:
            self._check_real("delta", low=0.0, strict=True)
        self._check_real("temperature", check=temperature_value)
        if self.softcap is not None:
            self._check_real("softcap", check=check_softcap)
        if self.max_completion_length is not None:
            n = self.max_completion_length
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
                raise ValueError(f"GRPOLossConfig.max_completion_length must be a positive int or None, got {n!r}")
            object.__setattr__(self, "max_completion_length", int(n))  # numpy ints -> int (the JSON form)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            self._check_real(name, check=lambda label, value: temperature_value(label, value, SAPO_TEMPERATURE))
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            self._check_real(name)
        self._check_real("top_entropy_quantile", low=0.0, high=1.0)
        self._check_real("entropy_coef")
        if self.dro_beta is not None:
            if self.loss_type != LossType.DRO:
                raise ValueError(f"GRPOLossConfig.dro_beta is dro's weight of its log-ratio penalty and means nothing "
                                 f"for loss_type={self.loss_type.value!r}: expected None, got {self.dro_beta!r}")
            self._check_real("dro_beta", low=0.0, strict=True)
        elif self.loss_type == LossType.DRO:
            raise ValueError("GRPOLossConfig.dro_beta must be a number > 0 for loss_type='dro' (the weight of its "
                             "quadratic log-ratio penalty, verl's policy_loss.dro_beta), got None")
        object.__setattr__(self, "use_bias_correction_kl",
                           check_bool("GRPOLossConfig.use_bias_correction_kl", self.use_bias_correction_kl))
        fields = dataclasses.asdict(self)
        fields["loss_type"] = self.loss_type.value
        # the custom ops take the config as a string; made once here so torch.compile never traces json
        object.__setattr__(self, "_json", json.dumps(fields, sort_keys=True))

    def to_json(self) -> str:
        """All fields as a JSON string (``GRPOLossConfig(**json.loads(s))`` rebuilds it)."""
        return self._json

    def _check_real(self, name, low=None, high=None, strict=False, check=None):
        """A finite real number (Python or numpy scalar) in range and in float32's (the ops take it as a float32
        scalar), or what ``check(label, value)`` accepts; a numpy scalar is stored as a Python float so the config
        serialises to JSON and compares equal to one built from plain floats."""
        value = getattr(self, name)
        label = f"GRPOLossConfig.{name}"
        number = (check(label, value) if check is not None
                  else float32_value(label, value, low=low, high=high, strict=strict))
        if type(value) not in (int, float):  # np.float64 subclasses float but prints as np.float64(...)
            object.__setattr__(self, name, number)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def eps_high(self) -> float:
        """The effective upper clip (``epsilon_high`` or, when unset, ``epsilon``)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def dppo_cap(self) -> float:
        """dppo_*'s cap on the (detached) ratio: ``delta``, or verl's default 20.0."""
        return DPPO_DEFAULT_CAP if self.delta is None else self.delta

    @property
    def sequence_level(self) -> bool:
        return self.importance_sampling_level == "sequence"

