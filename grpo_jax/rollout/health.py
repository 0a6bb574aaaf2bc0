"""Health metrics of a step's samples, on the host: the evidence behind `grpo-jax report`'s flags.

GRPO's known failure modes each leave a trace in the rollouts before they show in accuracy:

- dead groups (every sample of a prompt scores the same: no gradient) beyond what the pass rate
  predicts: `health/frac_zero_std_expected` beside the observed `groups/frac_zero_std`, and the
  shares of groups all right / all wrong (too easy / too hard);
- collapse of diversity: `health/distinct_answers` (distinct final answers per group);
- length hacking: `completion/len_correct` vs `completion/len_incorrect`;
- format terms doing the work: `health/format_reward_share` (share of |reward| from format terms);
- the per-group pass-rate histogram (TensorBoard `health/pass_rate`).

Gradient noise and sampler/trainer drift are measured inside the train step
(`micro_batches.grad_noise_scale`, `grpo.policy_loss`). "Correct" means the evaluation's reward
(`eval.reward`, default the first reward) scored the sample above 0.5, as `eval/accuracy` does.
Row i*G + j of every array is sample j of prompt i.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from grpo_jax.rewards import RewardResult, RewardSpec, extract_answer
from grpo_jax.rewards.format import format_reward


def expected_zero_std_fraction(pass_rates: np.ndarray | Sequence[float], group_size: int) -> float:
    """The share of groups of `group_size` binary rewards expected to be all equal when prompt i's
    samples pass independently with probability pass_rates[i]: mean of p^G + (1 - p)^G."""
    p = np.asarray(pass_rates, np.float64)
    if p.size == 0:
        return float("nan")
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"pass rates must lie in [0, 1], got {p.min()} .. {p.max()}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return float(np.mean(p**group_size + (1.0 - p) ** group_size))


def is_format_term(spec: RewardSpec) -> bool:
    """A reward that judges the form of a completion (the built-in `format`, or one named so)."""
    fn = spec.fn.func if isinstance(spec.fn, functools.partial) else spec.fn
    return fn is format_reward or "format" in spec.name.lower()


def _answer_key(text: str) -> str:
    answer = extract_answer(text)
    return answer.strip() if answer is not None else "\x00" + " ".join(text.split())


def distinct_answers(texts: Sequence[str], group_size: int) -> np.ndarray:
    """float32 [N]: the number of distinct final answers (`extract_answer`, else the whitespace-
    normalised text) among each group's completions."""
    return np.asarray([len({_answer_key(t) for t in texts[i:i + group_size]})
                       for i in range(0, len(texts), group_size)], np.float32)


def rollout_health(rewards: RewardResult, distinct: np.ndarray, lengths: np.ndarray, *, group_size: int,
                   correct_by: str, specs: Sequence[RewardSpec]) -> tuple[dict[str, float], np.ndarray]:
    """(health metrics of one round of samples, the per-group pass rates [N] for the histogram).
    `distinct` from `distinct_answers`; `lengths` [N*G] in tokens.

    `correct_by` names the reward whose score > 0.5 means correct; samples it could not judge
    (None) count in neither pass rate nor length split. The expected dead-group fraction uses the
    batch's pass rate p for every prompt: it is what the observed fraction would be if all prompts
    were equally hard, so observed above it measures the spread of difficulty (prompts always
    solved or never solved) or samples of a prompt that are not independent (a collapsed policy);
    a prompt's own group cannot give its p without making the two equal by construction.
    """
    scores = np.asarray(rewards.per_fn[correct_by], np.float64)
    judged = ~np.isnan(scores)
    correct = judged & (np.nan_to_num(scores, nan=0.0) > 0.5)
    lengths = np.asarray(lengths, np.float64)
    G = group_size
    correct_NG, judged_NG = correct.reshape(-1, G), judged.reshape(-1, G)
    n_judged = judged_NG.sum(axis=1)
    has = n_judged > 0
    rates = correct_NG.sum(axis=1)[has] / n_judged[has]
    p = float(correct.sum() / max(judged.sum(), 1))
    out = {
        "health/pass_rate": p if judged.any() else float("nan"),
        "health/frac_zero_std_expected": expected_zero_std_fraction([p], G) if judged.any() else float("nan"),
        "groups/frac_all_correct": float(np.mean(rates == 1.0)) if rates.size else float("nan"),
        "groups/frac_all_wrong": float(np.mean(rates == 0.0)) if rates.size else float("nan"),
        "health/distinct_answers": float(np.mean(distinct)),
        "completion/len_correct": float(lengths[correct].mean()) if correct.any() else float("nan"),
        "completion/len_incorrect": (float(lengths[judged & ~correct].mean()) if (judged & ~correct).any()
                                     else float("nan")),
    }
    formats = [s for s in specs if is_format_term(s)]
    if formats:
        weighted = {s.name: np.abs(s.weight * np.nan_to_num(rewards.per_fn[s.name], nan=0.0)).sum() for s in specs}
        total = sum(weighted.values())
        out["health/format_reward_share"] = float(sum(weighted[s.name] for s in formats) / total) if total else 0.0
    return out, rates


def random_control(rewards: np.ndarray, mean: float, rng: np.random.Generator) -> np.ndarray:
    """`reward_control: random`: coin flips with probability `mean` (clipped to [0, 1]) in place of
    each reward (float32 [n]); dropped samples (NaN) stay dropped. The spurious-reward control: an
    update that learns from these learns nothing about the task."""
    rewards = np.asarray(rewards, np.float32)
    q = float(np.clip(mean, 0.0, 1.0)) if np.isfinite(mean) else 0.0
    flips = (rng.random(rewards.shape) < q).astype(np.float32)
    return np.where(np.isnan(rewards), np.float32(np.nan), flips)
