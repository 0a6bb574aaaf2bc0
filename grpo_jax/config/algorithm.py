"""The objective's sections: `grpo:` (advantages, clipping, aggregation, KL and entropy terms) and
`ppo:` (the critic baseline), with the choices each variant may take."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal, get_args

from grpo_jax.config.checks import choice_in, non_negative, positive

Scale = Literal["group", "batch", "none"]
Estimator = Literal["grpo", "rloo"]
KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
RatioLevel = Literal["token", "sequence"]
PolicyLoss = Literal["clip", "cispo"]
CriticKind = Literal["head", "model"]
SCALES: tuple[str, ...] = get_args(Scale)
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
CRITIC_KINDS: tuple[str, ...] = get_args(CriticKind)

@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """The GRPO objective: advantages, clipping, aggregation, KL and entropy terms.

    ratio_level "token" is GRPO/DAPO's per-token importance ratio; "sequence" is GSPO's
    length-normalised sequence ratio (its clip range is ~1e-3, not ~0.2). loss_agg:
    "token_mean" (DAPO), "seq_mean_token_mean" (original GRPO), "seq_mean_token_sum_norm"
    (Dr. GRPO: the token sum divided by the constant rows x max_completion_length, every row of the
    batch counted, those dropped or masked as truncated too).

    policy_loss "clip" is PPO's clipped surrogate; "cispo" is MiniMax-M1's CISPO,
    -stop_gradient(min(ratio, cispo_max_ratio)) * A * log pi per token (TRL's loss_type="cispo"
    with epsilon_high as the bound), aggregated like the others. kl_importance_weighted multiplies
    the KL term by the importance ratio pi / pi_old (TRL's use_bias_correction_kl). std_ddof 0
    divides group (or batch) advantages by the population std, 1 by the Bessel-corrected one (TRL).
    The entropy bonus (entropy_coef) is aggregated like the policy term (loss_agg), where TRL
    always takes its token mean: the two agree for token_mean.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # > epsilon_low is DAPO's clip-higher
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens at c * |A|
    ratio_level: RatioLevel = "token"
    loss_agg: LossAggregation = "token_mean"
    max_completion_length: int | None = None  # required by seq_mean_token_sum_norm
    beta: float = 0.0  # KL coefficient; 0 = no reference model is held or run
    kl_estimator: KLEstimator = "k3"
    policy_loss: PolicyLoss = "clip"
    cispo_max_ratio: float | None = None  # CISPO's bound; None = 5.0 (TRL's suggested epsilon_high)
    kl_importance_weighted: bool = False
    std_ddof: int = 0
    entropy_coef: float = 0.0
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss
    advantage_scale: Scale = "group"
    advantage_estimator: Estimator = "grpo"
    advantage_eps: float = 1e-6
    num_iterations: int = 1  # mu: policy updates per rollout
    # Truncated importance sampling for a sampler whose log-probs differ from the trainer's (bf16
    # sampling, another engine): each token's loss is weighted by min(pi_train / pi_sampler, cap),
    # the trainer's and sampler's probabilities of the sampled token. None = off. The difference is
    # measured on every run either way (health/sampler_train_logprob_diff).
    sampler_is_cap: float | None = None
    # Masked importance sampling: [low, high]; a token whose weight falls outside is dropped from the
    # policy term (weight 0; the loss's normaliser is unchanged), the others keep their weight
    # (capped by sampler_is_cap when set). None = off.
    sampler_is_mask: tuple[float, float] | None = None
    # token: each token's weight is its own ratio; sequence: every token of a row takes the geometric
    # mean of the row's token ratios, so the cap and the mask act on whole sequences.
    sampler_is_level: RatioLevel = "token"

    @property
    def cispo_bound(self) -> float:
        return 5.0 if self.cispo_max_ratio is None else self.cispo_max_ratio

    def __post_init__(self):
        choice_in("grpo", "ratio_level", self.ratio_level, RATIO_LEVELS)
        choice_in("grpo", "policy_loss", self.policy_loss, POLICY_LOSSES)
        if self.cispo_max_ratio is not None:
            if self.policy_loss != "cispo":
                raise ValueError("grpo.cispo_max_ratio bounds CISPO's weight: set grpo.policy_loss: cispo too")
            if self.cispo_max_ratio < 1:
                raise ValueError(f"grpo.cispo_max_ratio must be >= 1, got {self.cispo_max_ratio}")
        if self.std_ddof not in (0, 1):
            raise ValueError(f"grpo.std_ddof must be 0 (population std) or 1 (Bessel-corrected), got {self.std_ddof}")
        choice_in("grpo", "loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        choice_in("grpo", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        choice_in("grpo", "advantage_scale", self.advantage_scale, SCALES)
        choice_in("grpo", "advantage_estimator", self.advantage_estimator, ESTIMATORS)
        if not 0 < self.epsilon_low < 1:
            raise ValueError(f"grpo.epsilon_low must be in (0, 1), got {self.epsilon_low}")
        if self.epsilon_high < self.epsilon_low:
            raise ValueError(
                f"grpo.epsilon_high={self.epsilon_high} < epsilon_low={self.epsilon_low}: clip-higher needs "
                "epsilon_high >= epsilon_low"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"grpo.dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.loss_agg == "seq_mean_token_sum_norm" and not (self.max_completion_length or 0) > 0:
            raise ValueError("grpo.loss_agg=seq_mean_token_sum_norm needs a positive grpo.max_completion_length")
        for name in ("beta", "entropy_coef", "advantage_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"grpo.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_iterations < 1:
            raise ValueError(f"grpo.num_iterations must be >= 1, got {self.num_iterations}")
        if self.sampler_is_cap is not None and self.sampler_is_cap < 1:
            raise ValueError(f"grpo.sampler_is_cap must be >= 1 (or null = off), got {self.sampler_is_cap}")
        if self.sampler_is_mask is not None:
            bounds = tuple(self.sampler_is_mask)
            if len(bounds) != 2 or not 0 <= bounds[0] <= 1 <= bounds[1]:
                raise ValueError(f"grpo.sampler_is_mask must be [low, high] with 0 <= low <= 1 <= high (or null = "
                                 f"off), got {list(bounds)}")
            object.__setattr__(self, "sampler_is_mask", (float(bounds[0]), float(bounds[1])))
        choice_in("grpo", "sampler_is_level", self.sampler_is_level, RATIO_LEVELS)
        if self.sampler_is_level != "token" and self.sampler_is_cap is None and self.sampler_is_mask is None:
            raise ValueError("grpo.sampler_is_level: sequence sets the level of grpo.sampler_is_cap or "
                             "grpo.sampler_is_mask; set one of them too")
        if self.ratio_level == "sequence" and max(self.epsilon_low, self.epsilon_high) >= 0.01:
            warnings.warn(
                f"GSPO (ratio_level=sequence) with epsilon {self.epsilon_low}/{self.epsilon_high}: sequence "
                "ratios are length-normalised and need clip ranges near 3e-4/4e-4; token-level epsilons "
                "almost never clip",
                stacklevel=2,
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """The critic baseline (`algorithm: ppo`): a linear value head on the policy's final hidden
    states (a shared trunk), trained with the policy by a clipped value loss weighted by
    `value_coef`; per-token advantages by GAE with the sequence's reward on its last token,
    decoupled as in VAPO: the critic's targets with `lam_critic` (1.0: Monte Carlo returns), the
    policy's advantages with `lam_policy`, or with `length_adaptive_alpha` a lambda per sequence of
    l tokens, 1 - 1 / (alpha * l). The policy loss is GRPO's clipped surrogate with the `grpo` section's clip range,
    aggregation and KL term, so the two algorithms differ only in where advantages come from.

    VAPO's other parts: `value_warmup_steps` (the first steps update the critic alone, on the
    Monte-Carlo returns of the starting policy's rollouts; the policy and its optimizer do not move),
    `positive_lm_coef` (a language-model loss on the rows with a positive reward, token mean over the
    batch's positive tokens), and `critic: model` (the critic is a separate transformer with its own
    optimizer state and a value head, initialised from `critic_path`, an HF directory, a causal LM or
    a sequence-classification reward model whose score head becomes the value head, or, unset, from
    the policy's starting weights; `critic: head` is the linear head on the policy's trunk)."""

    gamma: float = 1.0
    lam_critic: float = 1.0
    lam_policy: float = 0.95
    length_adaptive_alpha: float | None = None  # VAPO: 0.05
    value_coef: float = 0.5
    value_clip: float = 0.2  # |V - V_old| beyond this is clipped in the value loss (PPO2)
    # The value head's own AdamW learning rate (constant); None = train.learning_rate and its
    # schedule. Critics usually learn faster than policies (a freshly zeroed head must catch up).
    critic_learning_rate: float | None = None
    # critic: model: the learning rate of its transformer (the value head keeps critic_learning_rate);
    # None = critic_learning_rate. A head initialised at 0 (or a reward model's, on another scale)
    # must move fast; a pretrained trunk moved as fast forgets what it knew.
    critic_trunk_learning_rate: float | None = None
    value_warmup_steps: int = 0
    positive_lm_coef: float = 0.0
    critic: CriticKind = "head"
    critic_path: str | None = None

    def __post_init__(self):
        choice_in("ppo", "critic", self.critic, CRITIC_KINDS)
        non_negative("ppo", "value_warmup_steps", self.value_warmup_steps)
        non_negative("ppo", "positive_lm_coef", self.positive_lm_coef)
        if self.critic_trunk_learning_rate is not None:
            positive("ppo", "critic_trunk_learning_rate", self.critic_trunk_learning_rate)
            if self.critic != "model":
                raise ValueError("ppo.critic_trunk_learning_rate is the critic model's: set ppo.critic: model too")
        if self.critic_path is not None and self.critic != "model":
            raise ValueError("ppo.critic_path initialises a separate critic model: set ppo.critic: model too")
        if self.critic_learning_rate is not None:
            positive("ppo", "critic_learning_rate", self.critic_learning_rate)
        if self.length_adaptive_alpha is not None:
            positive("ppo", "length_adaptive_alpha", self.length_adaptive_alpha)
        for name in ("gamma", "lam_critic", "lam_policy"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ppo.{name} must be in [0, 1], got {getattr(self, name)}")
        positive("ppo", "value_coef", self.value_coef)
        positive("ppo", "value_clip", self.value_clip)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """On-policy distillation (`algorithm: distill`): the student (the policy) samples, the teacher
    scores the same tokens, and each token's advantage is `coef` x (log pi_teacher - log pi_student)
    at the sampled token (the negative reverse KL's per-token estimate), plus `reward_coef` x the
    group advantage of the verifiable rewards (0: the rewards are logged, not trained on). The
    policy loss is the `grpo` section's. `teacher`: an HF directory or a GGUF file, with the
    student's tokenizer."""

    teacher: str | None = None
    coef: float = 1.0
    reward_coef: float = 0.0

    def __post_init__(self):
        positive("distill", "coef", self.coef)
        non_negative("distill", "reward_coef", self.reward_coef)
