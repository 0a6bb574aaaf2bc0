"""GRPO's known failure patterns in a run's metrics (`diagnose`), at two levels: a failure (the run
is broken in a way that has a name and a fix) and a notice (a trend worth a look before it becomes
one). `grpo-jax report` shows them (grpo_jax.observe.report).

The trend checks compare an early window of steps with a late one (`_windows`: the first and last
quarter of the logged steps, at least 3 each) so a single noisy step raises nothing. Thresholds are
module constants, stated in each flag's evidence and in `THRESHOLDS` (the report's table).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grpo_jax.observe.writers import series

MIN_STEPS = 8  # fewer logged train steps than this: too short to judge trends (said on the page)

# Thresholds (late window vs early window unless said otherwise).
ENTROPY_DROP = 0.35  # late entropy below this share of the early one
DEAD_EXCESS = 0.2  # observed dead-group fraction above the pass-rate expectation by this much
DEAD_MIN = 0.3  # ... and at least this many groups dead
REWARD_RISE = 0.05  # training reward up by at least this much
ACCURACY_FALL = 0.05  # held-out accuracy below its best by at least this much (with reward rising)
HELDOUT_REGRESSION = 0.1  # ... by this much whatever the reward does
LENGTH_GROWTH = 1.5  # late completion length over early
TRUNCATED_MAX = 0.2  # share of truncated completions late in the run
KL_MAX = 0.5  # late k3 KL to the reference, in nats per token
LOGPROB_DIFF_MEAN = 0.02  # mean |sampler - trainer| log-prob per token
LOGPROB_DIFF_MAX = 1.0  # largest single-token difference
VERIFIER_DISAGREEMENT = 0.05  # held-out samples the two judges disagree on
# Notices: below a failure, each raised only when the failure it precedes is not.
NOTICE_ENTROPY_DROP = 0.6  # late entropy below this share of the early one
NOTICE_DEAD_SHARE = 0.25  # over the second half, at least this share of groups all-equal
NOTICE_HELDOUT_SE = 2.0  # held-out accuracy below its best by this many standard errors of the difference
NOTICE_DRIFT_RISE = 2.0  # sampler/learner log-prob difference: late window this many times the early one
NOTICE_DRIFT_FLOOR = 1e-4  # ... and at least this (float32 rounding is ~1e-7)


FAILURE, NOTICE = "failure", "notice"


@dataclasses.dataclass(frozen=True)
class Flag:
    key: str  # a stable identifier, e.g. "entropy_collapse"
    title: str
    evidence: str  # the numbers that raised it
    knobs: tuple[tuple[str, str], ...]  # (config key or setting, how it helps) for what addresses it
    level: str = FAILURE  # FAILURE, or NOTICE: a trend to watch


# (key, level, the rule) of every check, for the report's table and the README.
THRESHOLDS: tuple[tuple[str, str, str], ...] = (
    ("skipped_steps", FAILURE, "train/skipped_steps above 0"),
    ("entropy_collapse", FAILURE, f"late policy/entropy below {ENTROPY_DROP:.0%} of the early"),
    ("dead_groups", FAILURE, f"second-half groups/frac_zero_std at least {DEAD_MIN:.0%} and {DEAD_EXCESS:.0%} above "
                             "what the pass rate predicts"),
    ("reward_up_heldout_down", FAILURE, f"reward/mean up {REWARD_RISE} while eval/accuracy is {ACCURACY_FALL} below "
                                        "its best"),
    ("heldout_regression", FAILURE, f"eval/accuracy {HELDOUT_REGRESSION} below its best"),
    ("length_blowup", FAILURE, f"completion/len_mean grows {LENGTH_GROWTH}x, or over {TRUNCATED_MAX:.0%} truncated"),
    ("kl_drift", FAILURE, f"late kl/k3 above {KL_MAX} nats/token"),
    ("sampler_train_drift", FAILURE, f"health/sampler_train_logprob_diff mean above {LOGPROB_DIFF_MEAN} or max above "
                                     f"{LOGPROB_DIFF_MAX}"),
    ("verifier_disagreement", FAILURE, f"last health/verifier_disagreement at least {VERIFIER_DISAGREEMENT:.0%}"),
    ("entropy_falling", NOTICE, f"late policy/entropy below {NOTICE_ENTROPY_DROP:.0%} of the early"),
    ("dead_groups_share", NOTICE, f"second-half groups/frac_zero_std above {NOTICE_DEAD_SHARE:.0%}"),
    ("heldout_below_best", NOTICE, f"last eval/accuracy below its best by more than {NOTICE_HELDOUT_SE:g} standard "
                                   "errors of the difference (binomial, eval.num_prompts x eval.k samples each)"),
    ("sampler_drift_rising", NOTICE, f"health/sampler_train_logprob_diff late window {NOTICE_DRIFT_RISE:g}x the early "
                                     f"and above {NOTICE_DRIFT_FLOOR:g}"),
    ("verifier_accuracy_falling", NOTICE, f"reward/mean up {REWARD_RISE} while eval/verifier_accuracy is "
                                          f"{ACCURACY_FALL} below its best"),
)


def _windows(values: np.ndarray) -> tuple[float, float] | None:
    """(mean of the first quarter, mean of the last quarter), each at least 3 values; None if too few."""
    if values.size < 2 * 3:
        return None
    w = max(3, values.size // 4)
    return float(values[:w].mean()), float(values[-w:].mean())


def train_records(records):
    return [r for r in records if r["step"] > 0 and "reward/mean" in r]


def _entropy_collapse(train) -> Flag | None:
    _, ent = series(train, "policy/entropy")
    w = _windows(ent)
    if w is None or w[0] <= 0 or w[1] >= ENTROPY_DROP * w[0]:
        return None
    _, distinct = series(train, "health/distinct_answers")
    d = _windows(distinct)
    extra = f"; distinct answers per group {d[0]:.2f} -> {d[1]:.2f}" if d else ""
    return Flag("entropy_collapse", "Entropy collapse",
                f"policy/entropy fell from {w[0]:.3f} to {w[1]:.3f} nats/token (below {ENTROPY_DROP:.0%} of its "
                f"start){extra}. A collapsed policy samples the same completion G times: its groups stop "
                "carrying signal and exploration ends.",
                (("grpo.epsilon_high", "clip-higher, e.g. 0.28: lets low-probability tokens grow"),
                 ("grpo.entropy_coef", "an entropy bonus, e.g. 1e-3"), ("train.learning_rate", "lower"),
                 ("sampling.temperature", "sample at 1.0")))


def _dead_groups(train) -> Flag | None:
    _, observed = series(train, "groups/frac_zero_std")
    _, expected = series(train, "health/frac_zero_std_expected")
    if observed.size < 3 or expected.size != observed.size:
        return None
    half = slice(observed.size // 2, None)
    obs, exp = float(observed[half].mean()), float(expected[half].mean())
    if obs < DEAD_MIN or obs - exp < DEAD_EXCESS:
        return None
    _, right = series(train, "groups/frac_all_correct")
    _, wrong = series(train, "groups/frac_all_wrong")
    split = (f" ({right[half].mean():.0%} of groups all correct, {wrong[half].mean():.0%} all wrong)"
             if right.size == observed.size and wrong.size == observed.size else "")
    return Flag("dead_groups", "Dead groups above what the pass rate predicts",
                f"over the second half, {obs:.0%} of groups had identical rewards{split}, against {exp:.0%} "
                f"expected if every prompt had the batch's pass rate (excess {obs - exp:.0%} > {DEAD_EXCESS:.0%}). "
                "Those groups give zero advantage: the batch is effectively smaller and its gradient noisier.",
                (("train.dynamic_sampling", "DAPO: resample groups with identical rewards"),
                 ("data", "a curriculum closer to the model's level: drop solved and hopeless prompts"),
                 ("sampling.group_size", "larger groups are less often uniform"),
                 ("grpo.advantage_scale: none", "Dr. GRPO: no std scaling, so near-uniform groups are not amplified")))


def _best_checkpoint(step: int) -> tuple[str, str]:
    if step == 0:
        return ("train.steps", "the policy before any update had the best held-out accuracy")
    return (f"checkpoints/{step}", "the best held-out accuracy, if that step was saved (checkpoint.every)")


def _reward_vs_heldout(train, records) -> Flag | None:
    _, reward = series(train, "reward/mean")
    w = _windows(reward)
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
                 _best_checkpoint(int(steps[best]))))


def _heldout_regression(train, records) -> Flag | None:
    """Held-out accuracy well below its best without the training reward rising (that case is
    `_reward_vs_heldout`): the update is hurting the policy, whatever the reward says."""
    _, reward = series(train, "reward/mean")
    w = _windows(reward)
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
                 _best_checkpoint(int(steps[best]))))


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


def _length_blowup(train) -> Flag | None:
    _, length = series(train, "completion/len_mean")
    _, trunc = series(train, "completion/truncated_frac")
    w, t = _windows(length), _windows(trunc)
    grew = w is not None and w[0] > 0 and w[1] > LENGTH_GROWTH * w[0]
    cut = t is not None and t[1] > TRUNCATED_MAX
    if not (grew or cut):
        return None
    parts = []
    if w is not None:
        parts.append(f"completion/len_mean {w[0]:.1f} -> {w[1]:.1f} tokens")
    if t is not None:
        parts.append(f"completion/truncated_frac {t[0]:.2f} -> {t[1]:.2f}")
    _, lc = series(train, "completion/len_correct")
    _, li = series(train, "completion/len_incorrect")
    if lc.size and li.size:
        parts.append(f"late correct / incorrect lengths {lc[-max(3, lc.size // 4):].mean():.1f} / "
                     f"{li[-max(3, li.size // 4):].mean():.1f}")
    return Flag("length_blowup", "Completion length blow-up",
                "; ".join(parts) + f" (flagged above {LENGTH_GROWTH}x growth or {TRUNCATED_MAX:.0%} truncated).",
                (("rewards: overlong", "DAPO's soft overlong penalty"), ("grpo.mask_truncated", "truncated samples out of the loss"),
                 ("grpo.loss_agg: seq_mean_token_sum_norm", "Dr. GRPO: no length bias"),
                 ("sampling.max_new_tokens", "the cap itself")))


def _kl_drift(train) -> Flag | None:
    _, kl = series(train, "kl/k3")
    w = _windows(kl)
    if w is None or w[1] < KL_MAX:
        return None
    return Flag("kl_drift", "KL drift from the reference",
                f"kl/k3 {w[0]:.3f} -> {w[1]:.3f} nats/token (above {KL_MAX}): the policy has moved far from the "
                "reference; gains may not transfer and the update is at risk of instability.",
                (("grpo.beta", "raise the KL coefficient"), ("train.learning_rate", "lower"),
                 ("grpo.epsilon_low, grpo.epsilon_high", "a tighter clip range")))


def _sampler_drift(train) -> Flag | None:
    _, mean = series(train, "health/sampler_train_logprob_diff")
    _, peak = series(train, "health/sampler_train_logprob_diff_max")
    if not mean.size:
        return None
    m, p = float(mean.mean()), float(peak.max()) if peak.size else 0.0
    if m < LOGPROB_DIFF_MEAN and p < LOGPROB_DIFF_MAX:
        return None
    return Flag("sampler_train_drift", "Sampler and trainer disagree on log-probs",
                f"health/sampler_train_logprob_diff mean {m:.4f} per token, max {p:.3f} (flagged above "
                f"{LOGPROB_DIFF_MEAN} / {LOGPROB_DIFF_MAX}): the samples come from a different policy than the "
                "one being updated, so the update is off-policy without saying so.",
                (("grpo.sampler_is_cap", "truncated importance sampling, e.g. 2.0"),
                 ("model.dtype: float32", "sample in the training precision")))


def _skipped(records) -> Flag | None:
    _, skipped = series(records, "train/skipped_steps")
    if not skipped.size or skipped.max() <= 0:
        return None
    return Flag("skipped_steps", "Skipped updates",
                f"train/skipped_steps reached {int(skipped.max())}: updates with a non-finite loss or gradient "
                "were dropped.",
                (("train.learning_rate", "lower"), ("train.max_grad_norm", "clip harder"),
                 ("model.param_dtype: float32", "float32 master weights"), ("rewards", "check for NaN or huge values")))


def _entropy_falling(train) -> Flag | None:
    _, ent = series(train, "policy/entropy")
    w = _windows(ent)
    if w is None or w[0] <= 0 or w[1] >= NOTICE_ENTROPY_DROP * w[0]:
        return None
    return Flag("entropy_falling", "Entropy falling",
                f"policy/entropy {w[0]:.3f} -> {w[1]:.3f} nats/token (below {NOTICE_ENTROPY_DROP:.0%} of its start, "
                f"a collapse below {ENTROPY_DROP:.0%}): exploration is narrowing.",
                (("grpo.epsilon_high", "clip-higher keeps low-probability tokens alive"),
                 ("grpo.entropy_coef", "a small entropy bonus")), NOTICE)


def _dead_share(train) -> Flag | None:
    _, observed = series(train, "groups/frac_zero_std")
    if observed.size < 3:
        return None
    share = float(observed[observed.size // 2:].mean())
    if share <= NOTICE_DEAD_SHARE:
        return None
    return Flag("dead_groups_share", "Many groups carry no signal",
                f"over the second half {share:.0%} of groups had identical rewards (notice above "
                f"{NOTICE_DEAD_SHARE:.0%}); the pass rate explains it so far, but the batch is effectively smaller.",
                (("train.dynamic_sampling", "resample groups with identical rewards"),
                 ("data", "prompts closer to the model's level")), NOTICE)


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
                (_best_checkpoint(int(steps[best])), ("eval.num_prompts", "more held-out prompts: a smaller noise")),
                NOTICE)


def _sampler_drift_rising(train) -> Flag | None:
    _, diff = series(train, "health/sampler_train_logprob_diff")
    w = _windows(diff)
    if w is None or w[1] < NOTICE_DRIFT_FLOOR or w[1] < NOTICE_DRIFT_RISE * w[0]:
        return None
    return Flag("sampler_drift_rising", "Sampler and learner drifting apart",
                f"health/sampler_train_logprob_diff {w[0]:.2e} -> {w[1]:.2e} per token (notice at {NOTICE_DRIFT_RISE:g}x "
                f"and above {NOTICE_DRIFT_FLOOR:g}; a failure at a mean of {LOGPROB_DIFF_MEAN}).",
                (("grpo.sampler_is_cap", "truncated importance sampling"),
                 ("model.dtype: float32", "sample in the training precision")), NOTICE)


def _verifier_accuracy_falling(train, records) -> Flag | None:
    _, reward = series(train, "reward/mean")
    w = _windows(reward)
    steps, acc = series(records, "eval/verifier_accuracy")
    if w is None or acc.size < 2 or w[1] - w[0] < REWARD_RISE:
        return None
    best = int(np.argmax(acc))
    if best == acc.size - 1 or acc[best] - acc[-1] < ACCURACY_FALL:
        return None
    return Flag("verifier_accuracy_falling", "Reward rising while the second verifier's accuracy falls",
                f"reward/mean {w[0]:.3f} -> {w[1]:.3f} while eval/verifier_accuracy fell from {acc[best]:.3f} (step "
                f"{int(steps[best])}) to {acc[-1]:.3f}: the training reward may pay for what the independent judge rejects.",
                (("rewards", "tighten the training verifier"), _best_checkpoint(int(steps[best]))), NOTICE)


def diagnose(records: Sequence[Mapping[str, Any]], *, eval_samples: int | None = None) -> list[Flag]:
    """The failure patterns `records` (metrics.jsonl rows) show, each with its evidence and knobs,
    then the notices whose failure did not fire; an empty list for a healthy run (or one too short
    to judge trends: see MIN_STEPS). `eval_samples` (eval.num_prompts x eval.k) sizes held-out noise."""
    train = train_records(records)
    checks = [_skipped(records)]
    if len(train) >= MIN_STEPS:
        checks += [_entropy_collapse(train), _dead_groups(train), _reward_vs_heldout(train, records),
                   _heldout_regression(train, records), _length_blowup(train), _kl_drift(train),
                   _sampler_drift(train)]
    checks.append(_verifier(records))
    flags = [f for f in checks if f is not None]
    fired = {f.key for f in flags}
    notices = []
    if len(train) >= MIN_STEPS:
        notices = [("entropy_collapse", _entropy_falling(train)), ("dead_groups", _dead_share(train)),
                   ("reward_up_heldout_down heldout_regression", _heldout_below_best(records, eval_samples)),
                   ("sampler_train_drift", _sampler_drift_rising(train)),
                   ("verifier_disagreement", _verifier_accuracy_falling(train, records))]
    return flags + [n for failures, n in notices if n is not None and not fired & set(failures.split())]
