"""Statistics for comparisons over seeds, without SciPy (a plain install runs the benchmarks):
a mean with its t confidence interval, a paired comparison (the per-seed differences' mean, its t
interval, the paired t-test's two-sided p and the exact sign-flip permutation test's) and Holm's
correction over a family of comparisons. The sign-flip test assumes nothing about the
differences' distribution but cannot go below 2 / 2^n (0.031 at 6 seeds: never significant after
a correction for several comparisons), so decisions use the t-test's p, and the sign-flip p is
reported beside it. Seeds pair runs: the same seed gives two arms the same warm-started policy
and the same prompt order, so their difference has less noise than two independent means.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

# Student's t, 97.5th percentile, by degrees of freedom (two-sided 95%); beyond 30, the normal's.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else 1.96


def mean_ci(values) -> dict:
    """{"mean", "lo", "hi", "n"}: the 95% t interval of the mean (lo = hi = mean for one value)."""
    x = np.asarray(values, float)
    m = float(x.mean())
    if x.size < 2:
        return {"mean": m, "lo": m, "hi": m, "n": int(x.size)}
    half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return {"mean": m, "lo": m - half, "hi": m + half, "n": int(x.size)}


def t_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t statistic `t` with integer `df` (the closed forms for
    integer degrees of freedom, Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + 2.4/(3.5) cos^4 + ...)), to cos^(df-2)
        term, series = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= 2 * k / (2 * k + 1) * c2
            series += term
        inside = 2 / math.pi * (theta + s * math.cos(theta) * series)
    else:  # even: sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...), to cos^(df-2)
        term, series = 1.0, 1.0
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * c2
            series += term
        inside = s * series
    return max(0.0, 1.0 - inside)


def sign_flip_p(diffs) -> float:
    """Two-sided p of the exact paired permutation test: the share of the 2^n sign assignments of
    the differences whose mean is at least as far from 0 as the observed one (n <= 16; beyond, 2^16
    random assignments)."""
    d = np.asarray(diffs, float)
    observed = abs(d.mean())
    if d.size <= 16:
        signs = np.asarray(list(itertools.product((1.0, -1.0), repeat=d.size)))
    else:
        signs = np.random.default_rng(0).choice((1.0, -1.0), size=(1 << 16, d.size))
    means = np.abs(signs @ d) / d.size
    return float(np.mean(means >= observed - 1e-12))


def paired(a: dict, b: dict) -> dict:
    """a vs b, each {seed: value}, over the seeds both have: {"diff" (mean of a - b), "lo", "hi"
    (its 95% t interval), "p" (the paired t-test's two-sided p), "p_sign_flip", "n", "seeds"}."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        raise ValueError(f"a paired comparison needs two seeds in common, got {seeds}")
    d = np.asarray([a[s] - b[s] for s in seeds], float)
    ci = mean_ci(d)
    sd = float(d.std(ddof=1))
    p = (1.0 if ci["mean"] == 0 else 0.0) if sd == 0 else t_p(ci["mean"] / (sd / math.sqrt(d.size)), d.size - 1)
    return {"diff": ci["mean"], "lo": ci["lo"], "hi": ci["hi"], "p": p, "p_sign_flip": sign_flip_p(d), "n": len(d),
            "seeds": seeds}


def holm(ps: dict) -> dict:
    """Holm-Bonferroni adjusted p-values of a family {name: p} (reject at 0.05 where adjusted <= 0.05)."""
    order = sorted(ps, key=ps.get)
    out, running = {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * ps[name]))
        out[name] = running
    return out
