"""GRPO's known failure patterns in a run's metrics (`diagnose`), at two levels: a failure (the run
is broken in a way that has a name and a fix) and a notice (a trend worth a look before it becomes
one). `grpo-jax report` shows them (grpo_jax.observe.report). This module holds the checks of the
training dynamics (entropy, dead groups, lengths, KL, sampler drift, skipped updates) and
`diagnose`, which runs them with grpo_jax.observe.heldout_checks' (held-out accuracy, the second
verifier, over-optimisation against a gold judge, retention on general text).

The trend checks compare an early window of steps with a late one (`flags.windows`: the first and
last quarter of the logged steps, at least 3 each) so a single noisy step raises nothing.
Thresholds are module constants, stated in each flag's evidence and in `THRESHOLDS` (the report's
table).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_jax.observe import heldout_checks as heldout
from grpo_jax.observe.flags import FAILURE, MIN_STEPS, NOTICE, Flag, train_records, windows
from grpo_jax.observe.writers import series

# Thresholds (late window vs early window unless said otherwise).
ENTROPY_DROP = 0.35  # late entropy below this share of the early one
DEAD_EXCESS = 0.2  # observed dead-group fraction above the pass-rate expectation by this much
DEAD_MIN = 0.3  # ... and at least this many groups dead
LENGTH_GROWTH = 1.5  # late completion length over early
TRUNCATED_MAX = 0.2  # share of truncated completions late in the run
KL_MAX = 0.5  # late k3 KL to the reference, in nats per token
LOGPROB_DIFF_MEAN = 0.02  # mean |sampler - trainer| log-prob per token
LOGPROB_DIFF_MAX = 1.0  # largest single-token difference
# Notices: below a failure, each raised only when the failure it precedes is not.
NOTICE_ENTROPY_DROP = 0.6  # late entropy below this share of the early one
NOTICE_DEAD_SHARE = 0.25  # over the second half, at least this share of groups all-equal
NOTICE_DRIFT_RISE = 2.0  # sampler/learner log-prob difference: late window this many times the early one
NOTICE_DRIFT_FLOOR = 1e-4  # ... and at least this (float32 rounding is ~1e-7)


# (key, level, the rule) of every check, for the report's table and the README.
THRESHOLDS: tuple[tuple[str, str, str], ...] = (
    ("skipped_steps", FAILURE, "train/skipped_steps above 0"),
    ("entropy_collapse", FAILURE, f"late policy/entropy below {ENTROPY_DROP:.0%} of the early"),
    ("dead_groups", FAILURE, f"second-half groups/frac_zero_std at least {DEAD_MIN:.0%} and {DEAD_EXCESS:.0%} above "
                             "what the pass rate predicts"),
    ("length_blowup", FAILURE, f"completion/len_mean grows {LENGTH_GROWTH}x, or over {TRUNCATED_MAX:.0%} truncated"),
    ("kl_drift", FAILURE, f"late kl/k3 above {KL_MAX} nats/token"),
    ("sampler_train_drift", FAILURE, f"health/sampler_train_logprob_diff mean above {LOGPROB_DIFF_MEAN} or max above "
                                     f"{LOGPROB_DIFF_MAX}"),
    ("entropy_falling", NOTICE, f"late policy/entropy below {NOTICE_ENTROPY_DROP:.0%} of the early"),
    ("dead_groups_share", NOTICE, f"second-half groups/frac_zero_std above {NOTICE_DEAD_SHARE:.0%}"),
    ("sampler_drift_rising", NOTICE, f"health/sampler_train_logprob_diff late window {NOTICE_DRIFT_RISE:g}x the early "
                                     f"and above {NOTICE_DRIFT_FLOOR:g}"),
) + heldout.THRESHOLDS


def _entropy_collapse(train) -> Flag | None:
    _, ent = series(train, "policy/entropy")
    w = windows(ent)
    if w is None or w[0] <= 0 or w[1] >= ENTROPY_DROP * w[0]:
        return None
    _, distinct = series(train, "health/distinct_answers")
    d = windows(distinct)
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


def _length_blowup(train) -> Flag | None:
    _, length = series(train, "completion/len_mean")
    _, trunc = series(train, "completion/truncated_frac")
    w, t = windows(length), windows(trunc)
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
    w = windows(kl)
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
    w = windows(ent)
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


def _sampler_drift_rising(train) -> Flag | None:
    _, diff = series(train, "health/sampler_train_logprob_diff")
    w = windows(diff)
    if w is None or w[1] < NOTICE_DRIFT_FLOOR or w[1] < NOTICE_DRIFT_RISE * w[0]:
        return None
    return Flag("sampler_drift_rising", "Sampler and learner drifting apart",
                f"health/sampler_train_logprob_diff {w[0]:.2e} -> {w[1]:.2e} per token (notice at {NOTICE_DRIFT_RISE:g}x "
                f"and above {NOTICE_DRIFT_FLOOR:g}; a failure at a mean of {LOGPROB_DIFF_MEAN}).",
                (("grpo.sampler_is_cap", "truncated importance sampling"),
                 ("model.dtype: float32", "sample in the training precision")), NOTICE)


def diagnose(records: Sequence[Mapping[str, Any]], *, eval_samples: int | None = None) -> list[Flag]:
    """The failure patterns `records` (metrics.jsonl rows) show, each with its evidence and knobs,
    then the notices whose failure did not fire; an empty list for a healthy run (or one too short
    to judge trends: see MIN_STEPS). `eval_samples` (eval.num_prompts x eval.k) sizes held-out noise."""
    train = train_records(records)
    judged = len(train) >= MIN_STEPS
    checks = [_skipped(records)]
    if judged:
        checks += [_entropy_collapse(train), _dead_groups(train), _length_blowup(train), _kl_drift(train),
                   _sampler_drift(train)]
    checks += heldout.failures(train, records, eval_samples, judged=judged)
    flags = [f for f in checks if f is not None]
    fired = {f.key for f in flags}
    notices = []
    if judged:
        notices = [("entropy_collapse", _entropy_falling(train)), ("dead_groups", _dead_share(train)),
                   ("sampler_train_drift", _sampler_drift_rising(train))]
    notices += heldout.notices(train, records, eval_samples, judged=judged)
    return flags + [n for failures, n in notices if n is not None and not fired & set(failures.split())]
