"""The run-health checks that read held-out evaluations: held-out accuracy against the training
reward, the second verifier (`eval.verifier`), over-optimisation (the training reward, a proxy,
rising while a gold judge's score falls, with the KL from the initial policy at the gold peak and
at the end), and retention (what the run costs the policy on general text: `eval.retention`).
`failures` and `notices` are what grpo_jax.observe.health_checks.diagnose runs of them.
"""

from __future__ import annotations

import math

import numpy as np

from grpo_jax.observe.flags import ACCURACY_FALL, FAILURE, NOTICE, REWARD_RISE, Flag, best_checkpoint, windows
from grpo_jax.observe.writers import series

HELDOUT_REGRESSION = 0.1  # held-out accuracy below its best by this much whatever the reward does
VERIFIER_DISAGREEMENT = 0.05  # held-out samples the two judges disagree on
OVEROPT_FALL = 0.05  # the gold judge's held-out score below its best by at least this much ...
OVEROPT_SE = 2.0  # ... and (for a score in [0, 1], eval.num_prompts x eval.k samples) this many standard errors
NOTICE_HELDOUT_SE = 2.0  # held-out accuracy below its best by this many standard errors of the difference
NOTICE_GOLD_FALL = 0.02  # the gold judge's score below its best by this much while the training reward rises
RETENTION_KL = 0.05  # retention/kl (nats per token of general text) at the last evaluation
RETENTION_NLL_RISE = 0.05  # retention/general_nll above its first evaluation's by this much (nats per token)

THRESHOLDS: tuple[tuple[str, str, str], ...] = (
    ("reward_up_heldout_down", FAILURE, f"reward/mean up {REWARD_RISE} while eval/accuracy is {ACCURACY_FALL} below "
                                        "its best"),
    ("heldout_regression", FAILURE, f"eval/accuracy {HELDOUT_REGRESSION} below its best"),
    ("verifier_disagreement", FAILURE, f"last health/verifier_disagreement at least {VERIFIER_DISAGREEMENT:.0%}"),
    ("overoptimisation", FAILURE, f"the training reward (reward/mean or eval/reward_mean) up {REWARD_RISE} while the "
                                  f"gold judge's eval/verifier_reward_mean is {OVEROPT_FALL} and {OVEROPT_SE:g} "
                                  "standard errors below its best"),
    ("heldout_below_best", NOTICE, f"last eval/accuracy below its best by more than {NOTICE_HELDOUT_SE:g} standard "
                                   "errors of the difference (binomial, eval.num_prompts x eval.k samples each)"),
    ("verifier_accuracy_falling", NOTICE, f"reward/mean up {REWARD_RISE} while the gold judge's score is "
                                          f"{NOTICE_GOLD_FALL} below its best"),
    ("retention_loss", NOTICE, f"last retention/kl at least {RETENTION_KL} nats/token, or retention/general_nll "
                               f"{RETENTION_NLL_RISE} above its first"),
)


def _gold(records) -> tuple[str, np.ndarray, np.ndarray]:
    """(metric, steps, values) of the gold judge's held-out score: eval/verifier_reward_mean (a gold
    reward model's mean score; a verifier's share correct of the judged), else eval/verifier_accuracy."""
    for key in ("eval/verifier_reward_mean", "eval/verifier_accuracy"):
        steps, values = series(records, key)
        if values.size:
            return key, steps, values
    return "", np.zeros(0), np.zeros(0)


def _proxy_rise(train, records) -> tuple[float, str]:
    """How much the training reward rose (its late window over its early one, or the held-out
    eval/reward_mean from the first evaluation to the last, whichever is more), and how it is said."""
    rises = []
    w = windows(series(train, "reward/mean")[1])
    if w is not None:
        rises.append((w[1] - w[0], f"reward/mean {w[0]:.3f} -> {w[1]:.3f}"))
    _, held = series(records, "eval/reward_mean")
    if held.size >= 2:
        rises.append((float(held[-1] - held[0]), f"eval/reward_mean {held[0]:.3f} -> {held[-1]:.3f}"))
    return max(rises, default=(0.0, ""))


def _at(records, step: int, key: str) -> float | None:
    values = [r[key] for r in records if r["step"] == step and key in r]
    return float(values[-1]) if values else None


def kl_windows(records, key: str = "kl/k3") -> dict[int, float]:
    """Each evaluation's step (a record with eval/accuracy) -> the mean of `key` over the updates
    since the previous evaluation, its own step's included: one batch's k3 estimate is noisy, the
    window's mean is what to quote and plot against. An evaluation with no update before it (step
    0) is absent."""
    out, window = {}, []
    for r in records:
        if r.get(key) is not None:
            window.append(float(r[key]))
        if "eval/accuracy" in r:
            if window:
                out[int(r["step"])] = float(np.mean(window))
            window = []
    return out


def _kl_at(records, steps: tuple[int, int]) -> str:
    """The KL from the initial policy at two evaluations' steps: kl/k3 as the mean over the updates
    since the evaluation before (`kl_windows`), retention/kl (a fixed corpus, not noisy) as logged."""
    parts, windows_ = [], kl_windows(records)
    for key in ("kl/k3", "retention/kl"):
        a, b = ((windows_.get(s) for s in steps) if key == "kl/k3" else (_at(records, s, key) for s in steps))
        if a is not None and b is not None:
            parts.append(f"{key} {a:.4f} -> {b:.4f}")
    return ("; KL from the initial policy at those steps: " + ", ".join(parts)) if parts else ""


def _overoptimisation(train, records, eval_samples: int | None) -> Flag | None:
    key, steps, gold = _gold(records)
    rise, said = _proxy_rise(train, records)
    if gold.size < 3 or rise < REWARD_RISE:
        return None
    best = int(np.nanargmax(gold))
    b, last = float(gold[best]), float(gold[-1])
    if best == gold.size - 1 or b - last < OVEROPT_FALL:
        return None
    if eval_samples and 0 <= last <= b <= 1:
        se = math.sqrt((b * (1 - b) + last * (1 - last)) / eval_samples)
        if b - last < OVEROPT_SE * se:
            return None
    peak, end = int(steps[best]), int(steps[-1])
    return Flag("overoptimisation", "Over-optimisation: the proxy reward rises while the gold judge falls",
                f"{said} while the gold judge's {key} fell from {b:.3f} (step {peak}) to {last:.3f} (step {end})"
                f"{_kl_at(records, (peak, end))}. Past the gold peak the policy exploits what the training reward "
                "mis-scores; more optimisation makes it worse at what the proxy stands for.",
                (best_checkpoint(peak), ("grpo.beta", "a larger KL coefficient holds the policy nearer the KL of the peak"),
                 ("rewards", "a stronger proxy: a reward model trained on more pairs, an ensemble, or the strict verifier"),
                 ("eval.every", "evaluate often enough to see the peak")))


def _retention(records) -> Flag | None:
    steps, kl = series(records, "retention/kl")
    nsteps, nll = series(records, "retention/general_nll")
    far = bool(kl.size) and kl[-1] >= RETENTION_KL
    worse = nll.size >= 2 and nll[-1] - nll[0] >= RETENTION_NLL_RISE
    if not (far or worse):
        return None
    parts = []
    if kl.size:
        parts.append(f"retention/kl {kl[-1]:.4f} nats/token at step {int(steps[-1])} (notice at {RETENTION_KL})")
    if nll.size >= 2:
        parts.append(f"retention/general_nll {nll[0]:.3f} -> {nll[-1]:.3f} (step {int(nsteps[0])} -> "
                     f"{int(nsteps[-1])}; notice at +{RETENTION_NLL_RISE})")
    return Flag("retention_loss", "The policy is moving away from its start on general text",
                "; ".join(parts) + ". RL is changing what the model does outside its task: it may be forgetting.",
                (("grpo.beta", "a KL term toward the initial policy"), ("train.learning_rate", "lower"),
                 ("lora.rank", "LoRA adapters change less of the model"), ("train.steps", "fewer, or an earlier "
                                                                                        "checkpoint")), NOTICE)


def _gold_falling(train, records) -> Flag | None:
    key, steps, gold = _gold(records)
    rise, said = _proxy_rise(train, records)
    if gold.size < 2 or rise < REWARD_RISE:
        return None
    best = int(np.nanargmax(gold))
    if best == gold.size - 1 or gold[best] - gold[-1] < NOTICE_GOLD_FALL:
        return None
    return Flag("verifier_accuracy_falling", "Reward rising while the gold judge's score falls",
                f"{said} while {key} fell from {gold[best]:.3f} (step {int(steps[best])}) to {gold[-1]:.3f}: the "
                "training reward may pay for what the independent judge rejects.",
                (("rewards", "tighten the training verifier"), best_checkpoint(int(steps[best]))), NOTICE)


def _reward_vs_heldout(train, records) -> Flag | None:
    _, reward = series(train, "reward/mean")
    w = windows(reward)
    steps, acc = series(records, "eval/accuracy")
    if w is None or acc.size < 3:
        return None
    best = int(np.argmax(acc))
    if w[1] - w[0] < REWARD_RISE or best == acc.size - 1 or acc[best] - acc[-1] < ACCURACY_FALL:
        return None
    return Flag("reward_up_heldout_down", "Training reward rising while held-out accuracy falls",
                f"reward/mean rose {w[0]:.3f} -> {w[1]:.3f} while eval/accuracy fell from its best {acc[best]:.3f} "
                f"(step {int(steps[best])}) to {acc[-1]:.3f} (step {int(steps[-1])}). The policy is learning what the "
                "training reward pays for, not the task: reward hacking or overfitting to the verifier.",
                (("eval.verifier", "a second, independent judge: health/verifier_disagreement"),
                 ("rewards", "tighten the verifier; check samples.jsonl for what it accepts"),
                 ("grpo.beta", "a KL coefficient keeps the policy near the reference"),
                 ("reward_control: random", "a spurious-reward control run: gains it matches are not from the reward"),
                 best_checkpoint(int(steps[best]))))


def _heldout_regression(train, records) -> Flag | None:
    """Held-out accuracy well below its best without the training reward rising (that case is
    `_reward_vs_heldout`): the update is hurting the policy, whatever the reward says."""
    _, reward = series(train, "reward/mean")
    w = windows(reward)
    steps, acc = series(records, "eval/accuracy")
    if acc.size < 2 or (w is not None and w[1] - w[0] >= REWARD_RISE):
        return None
    best = int(np.argmax(acc))
    if best == acc.size - 1 or acc[best] - acc[-1] < HELDOUT_REGRESSION:
        return None
    trend = f"; reward/mean {w[0]:.3f} -> {w[1]:.3f}" if w is not None else ""
    return Flag("heldout_regression", "Held-out accuracy fell",
                f"eval/accuracy fell from {acc[best]:.3f} (step {int(steps[best])}) to {acc[-1]:.3f} (step "
                f"{int(steps[-1])}){trend}. The updates are making the policy worse: a learning rate too high for "
                "the signal, rewards that carry no information about the task, or drift from the reference.",
                (("train.learning_rate", "lower"),
                 ("grpo.beta", "a KL coefficient keeps the policy near the reference"),
                 ("rewards", "do they reward the task? compare with a reward_control: random run"),
                 best_checkpoint(int(steps[best]))))


def _verifier(records) -> Flag | None:
    _, dis = series(records, "health/verifier_disagreement")
    if not dis.size or dis[-1] < VERIFIER_DISAGREEMENT:
        return None
    return Flag("verifier_disagreement", "The two verifiers disagree",
                f"health/verifier_disagreement {dis[0]:.3f} at the first evaluation, {dis[-1]:.3f} at the last "
                f"(above {VERIFIER_DISAGREEMENT:.0%}): the training reward accepts answers the independent judge "
                "does not, or the reverse.",
                (("rewards", "align the training verifier with the independent one"),
                 ("eval.verifier", "the judge used")))


def _heldout_below_best(records, eval_samples: int | None) -> Flag | None:
    steps, acc = series(records, "eval/accuracy")
    if eval_samples is None or acc.size < 2:
        return None
    best = int(np.argmax(acc))
    b, last = float(acc[best]), float(acc[-1])
    se = math.sqrt((b * (1 - b) + last * (1 - last)) / eval_samples)
    if best == acc.size - 1 or b - last <= NOTICE_HELDOUT_SE * max(se, 1e-12):
        return None
    return Flag("heldout_below_best", "Held-out accuracy below its best",
                f"eval/accuracy {last:.3f} at step {int(steps[-1])} against its best {b:.3f} at step {int(steps[best])}: "
                f"{(b - last) / max(se, 1e-12):.1f} standard errors of the difference ({eval_samples} samples per "
                f"evaluation; notice above {NOTICE_HELDOUT_SE:g}).",
                (best_checkpoint(int(steps[best])), ("eval.num_prompts", "more held-out prompts: a smaller noise")),
                NOTICE)



def failures(train, records, eval_samples: int | None, *, judged: bool) -> list[Flag | None]:
    """The failure checks (`judged`: the run has enough train steps for its trends)."""
    checks = [_verifier(records)]
    if judged:
        checks = [_reward_vs_heldout(train, records), _heldout_regression(train, records),
                  _overoptimisation(train, records, eval_samples)] + checks
    return checks


def notices(train, records, eval_samples: int | None, *, judged: bool) -> list[tuple[str, Flag | None]]:
    """(the failures that stand in for it, the notice) of each notice check."""
    out = []
    if judged:
        out = [("reward_up_heldout_down heldout_regression", _heldout_below_best(records, eval_samples)),
               ("overoptimisation verifier_disagreement", _gold_falling(train, records))]
    return out + [("", _retention(records))]
