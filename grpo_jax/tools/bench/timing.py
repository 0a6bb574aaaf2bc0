"""Timing shared by the benchmarks: medians after a warm-up, and the in-run matmul peak."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], iters: int, warmup: int = 1) -> tuple[float, float]:
    """(seconds of the first call, median seconds of `iters` later calls)."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


def peak_matmul_flops(dtype: str = "float32", n: int = 2048, iters: int = 5) -> float:
    """FLOP/s of a jitted n x n x n matmul on the default device (median of `iters`): the in-run
    peak that MFU is measured against."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.dtype(dtype))
    matmul = jax.jit(lambda x, y: x @ y)
    _, seconds = median_time(lambda: matmul(a, b).block_until_ready(), iters, warmup=2)
    return 2.0 * n**3 / seconds
