"""Micro-batching: a batch's rows split into micro-batches (`split_micro_batches`), gradients
summed over them in a scan (`accumulate`), and the gradient noise scale those pieces measure
(`grad_noise_scale`). Every training step runs them through grpo_jax.learner.step_factory.update,
the RL step (grpo_jax.learner.train_step) under jit on a mesh and under pmap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax.learner.grpo import accumulate_sums


def split_micro_batches(rows, micro_batches: int, unit: int = 1):
    """A pytree of [R, ...] arrays -> [micro_batches, R / micro_batches, ...]: micro-batch m takes
    every micro_batches-th run of `unit` rows (a shared prompt pass's groups stay whole).

    Interleaved, not contiguous: a batch's rows are split over the devices in contiguous blocks,
    so a contiguous micro-batch m would be (part of) device m's block, to be sent to every device
    before each piece of the scan (all-to-alls: 11 in a 4-device test step against 4) or computed
    whole on each. Interleaved, each device holds its own rows of every micro-batch (the config
    checks they split evenly) and the scan runs on them where they are. Any partition gives the
    same update: the loss is normalised by the whole batch."""
    def one(x):
        R = x.shape[0]
        runs = x.reshape(R // (micro_batches * unit), micro_batches, unit, *x.shape[1:])
        return jnp.swapaxes(runs, 0, 1).reshape(micro_batches, R // micro_batches, *x.shape[1:])

    return jax.tree.map(one, rows)


def merge_micro_batches(micro, unit: int = 1):
    """The inverse of `split_micro_batches`: [micro_batches, R / micro_batches, ...] -> [R, ...] in
    the batch's row order."""
    def one(x):
        m, rows = x.shape[:2]
        runs = x.reshape(m, rows // unit, unit, *x.shape[2:])
        return jnp.swapaxes(runs, 0, 1).reshape(m * rows, *x.shape[2:])

    return jax.tree.map(one, micro)


def accumulate(micro_loss, trainable, rows, step_key: jax.Array, micro_batches: int, *, unit: int = 1):
    """Gradients of `micro_loss(trainable, micro_batch, key) -> (loss, sums)` summed over
    `micro_batches` parts of `rows` (a pytree of per-row arrays; `split_micro_batches` with
    `unit`) in a scan, micro-batch m drawing with fold_in(step_key, m) -> (loss, grads, the loss's
    sums added up by `grpo.accumulate_sums`, the sum of the micro-batch gradients' squared norms)."""
    micro = split_micro_batches(rows, micro_batches, unit)
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def add_piece(carry, xs):
        mb, m = xs
        loss, grads, sums, sq = carry
        (piece_loss, s), g = grad_fn(trainable, mb, jax.random.fold_in(step_key, m))
        # sq: the sum of squared norms of the micro-batch gradients, for the gradient noise scale.
        return (loss + piece_loss, jax.tree.map(jnp.add, grads, g), accumulate_sums(sums, s), sq + sq_norm(g)), None

    (l_shape, s_shape), g_shape = jax.eval_shape(grad_fn, trainable, jax.tree.map(lambda x: x[0], micro), step_key)
    zeros = functools.partial(jax.tree.map, lambda a: jnp.zeros(a.shape, a.dtype))
    init = (zeros(l_shape), zeros(g_shape), zeros(s_shape), jnp.zeros((), jnp.float32))
    return jax.lax.scan(add_piece, init, (micro, jnp.arange(micro_batches)))[0]


def sq_norm(tree) -> jax.Array:
    """The squared L2 norm of a pytree of arrays, in float32."""
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def grad_noise_scale(sum_sq_pieces: jax.Array, sq_total: jax.Array, *, pieces, rows) -> jax.Array:
    """The simple gradient noise scale B = tr(Sigma) / |g|^2 (McCandlish et al., 2018), in rows.

    The batch's gradient g = sum_k g_k is the sum of K = `pieces` micro-batch contributions (each
    already divided by the whole batch's normaliser), so K g_k estimates g from b = rows / K rows.
    tr(Sigma) per row = b * the unbiased variance of those K estimates around their mean g:
    b / (K - 1) * sum_k |K g_k - g|^2 = b / (K - 1) * (K^2 sum_k |g_k|^2 - K |g|^2). |g|^2 is the
    batch gradient's own squared norm (above the true one by tr(Sigma) / rows on average).
    B at or above `rows` means the batch's gradient is mostly noise: larger batches would help.
    `sum_sq_pieces` = sum_k |g_k|^2, `sq_total` = |g|^2. NaN with one piece (no spread to measure).
    """
    k = jnp.asarray(pieces, jnp.float32)
    b = jnp.asarray(rows, jnp.float32) / k
    trace = b / jnp.maximum(k - 1.0, 1.0) * (k * k * sum_sq_pieces - k * sq_total)
    return jnp.where(k > 1, jnp.maximum(trace, 0.0) / jnp.maximum(sq_total, 1e-30), jnp.nan)
