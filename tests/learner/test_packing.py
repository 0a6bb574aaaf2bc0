"""Sequence packing (`train.packing`): a packed forward gives each sequence its own logits; a packed
train step (shared prompts, the KL term, micro-batches) equals the unpacked one; the plan is
first-fit decreasing, never overlaps or overflows, does not depend on the order of the rows, and
refuses a sequence longer than a bin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from batches import one_device_ref_step, one_device_step
from flax import nnx
from learner.test_shared_prompt import CONFIGS, grouped_batch

from grpo_jax.config import GRPOConfig
from grpo_jax.learner.packing import pack_batch, plan_packing, row_lengths
from grpo_jax.learner.train_step import init_state
from grpo_jax.models import Transformer

LOSS_CONFIG = GRPOConfig(beta=0.04, entropy_coef=0.01)


@pytest.mark.parametrize("family,impl", [("qwen3", "xla"), ("gemma3_text", "chunked")])
def test_a_packed_row_gives_each_sequence_its_own_logits(family, impl):
    # Three sequences laid end to end in one row (then padding), positions restarting per sequence;
    # Gemma's window (5) and soft caps act inside each sequence as in its own pass.
    model = Transformer(CONFIGS[family], rngs=nnx.Rngs(3), attention=impl)
    rng = np.random.default_rng(0)
    lengths, T = (9, 4, 6), 24
    seqs = [rng.integers(3, 256, n).astype(np.int32) for n in lengths]
    ids = np.zeros((1, T), np.int32)
    seg = np.zeros((1, T), np.int32)
    at = 0
    for i, s in enumerate(seqs):
        ids[0, at:at + len(s)], seg[0, at:at + len(s)] = s, i + 1
        at += len(s)
    packed = np.asarray(model(input_ids=jnp.asarray(ids), segment_ids=jnp.asarray(seg)))
    at = 0
    for s in seqs:
        own = np.asarray(model(input_ids=jnp.asarray(s[None])))[0]
        np.testing.assert_allclose(packed[0, at:at + len(s)], own, atol=1e-5, rtol=1e-5)
        at += len(s)


def test_the_plan_is_first_fit_decreasing_without_overlap():
    rng = np.random.default_rng(1)
    R, G, L = 32, 4, 40
    plen = np.repeat(rng.integers(2, 8, R // G), G)
    clen = rng.integers(1, 30, R)
    clen[5] = 0  # an empty completion is not placed
    for shared in (False, True):
        plan = plan_packing(plen, clen, length=L, shards=2, micro_batches=2, unit=G, group_size=G, shared=shared)
        rows = plan.rows
        assert rows.bin[5] == -1
        # Every placed sequence lies inside its bin, and no two bins' tokens overlap.
        used: dict[tuple[int, int], np.ndarray] = {}
        prompts: dict[tuple, int] = {}
        for r in np.flatnonzero(clen > 0):
            # Bins are numbered within a micro-batch (rows of runs of G, interleaved over 2 micro-batches).
            b = (((r % (R // 2)) // G) % 2, int(rows.bin[r]))
            p0, c0 = int(rows.prompt_start[r]), int(rows.completion_start[r])
            cells = used.setdefault(b, np.zeros(L, int))
            key = (b, r // G) if shared else (b, r)
            if key in prompts:  # a group's prompt is laid once per bin
                assert prompts[key] == p0
            else:
                prompts[key] = p0
                cells[p0:p0 + plen[r]] += 1
            if not shared:
                assert c0 == p0 + plen[r], "a completion follows its own prompt"
            assert c0 + clen[r] <= L
            cells[c0:c0 + clen[r]] += 1
        assert all(c.max() <= 1 for c in used.values()), "two sequences share a slot"
        assert plan.fill == pytest.approx(sum(int(c.sum()) for c in used.values()) / plan.capacity)
        # Rows of one (micro-batch, shard) share bins only with each other: bins are shard-major.
        per_shard = R // 2
        for r in np.flatnonzero(clen > 0):
            assert int(rows.bin[r]) // (rows.bins // 2) == r // per_shard
    with pytest.raises(ValueError, match=r"raise train.pack_length to at least 43"):
        plan_packing(np.array([13, 2]), np.array([30, 5]), length=L)


def _packed(batch, micro_batches, shared=True, length=16):
    return pack_batch(batch, length=length, shards=1, micro_batches=micro_batches, unit=2, group_size=2,
                      shared=shared)[0]


def test_a_packed_update_equals_the_unpacked_update():
    # SGD with lr 1 after clipping: the parameter difference is the gradient difference. The KL term
    # (reference log-probs from a packed and an unpacked reference pass), shared prompts, two
    # micro-batches; then the rows permuted (whole groups, and samples within a group) give the
    # same update too.
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    G = 2
    batch = grouped_batch(N=4, G=G, seed=5)
    perm = np.concatenate([[2 * g + 1, 2 * g] for g in (3, 1, 0, 2)])
    permuted = jax.tree.map(lambda x: x[perm] if x.shape[0] == 8 else x[np.array([3, 1, 0, 2])], batch)
    results = {}
    for name, b, pack in (("plain", batch, None), ("packed", batch, True), ("unshared", batch, False),
                          ("permuted", permuted, True)):
        graphdef, state = init_state(Transformer(CONFIGS["qwen3"], rngs=nnx.Rngs(0)), opt)
        if pack is not None:
            b = _packed(b, micro_batches=2, shared=pack)
            if pack:
                assert int(b.packing.bins) < 4, "the rows should share bins"
        ref = one_device_ref_step(graphdef, state.params, logprob_chunk=4, group_size=G, micro_batches=2)
        ref_logp = ref(state.params, b.prompt_ids, b.prompt_mask, b.completion_ids, b.packing)
        step = one_device_step(graphdef, opt, LOSS_CONFIG, state, micro_batches=2, logprob_chunk=4, group_size=G)
        state, metrics = step(state, b.replace(ref_logprobs=ref_logp + 0.01))
        results[name] = (np.asarray(ref_logp) * np.asarray(b.completion_mask), jax.tree.leaves(state.params),
                         {k: float(v) for k, v in metrics.items()})
    plain_ref, plain_params, plain_metrics = results["plain"]
    for name in ("packed", "unshared", "permuted"):
        ref_logp, params, metrics = results[name]
        if name == "permuted":
            ref_logp = ref_logp[np.argsort(perm)]
        np.testing.assert_allclose(ref_logp, plain_ref, rtol=5e-5, atol=1e-5, err_msg=name)
        for k in ("train/loss", "kl/k3", "policy/entropy", "train/grad_norm"):
            assert metrics[k] == pytest.approx(plain_metrics[k], abs=1e-5), (name, k)
        for a, b in zip(plain_params, params):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, err_msg=name)


def test_row_lengths_count_through_the_last_model_token():
    pmask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    cmask = np.array([[1, 0, 0, 1, 0], [0, 0, 0, 0, 0]])  # an episode's env tokens in between
    plen, clen = row_lengths(pmask, cmask)
    assert plen.tolist() == [2, 4] and clen.tolist() == [4, 0]
