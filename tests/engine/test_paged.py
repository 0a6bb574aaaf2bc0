"""The paged engine (`sampling.engine: paged`): slots over a pool of cache pages, admission by free
pages, preemption and recompute of the youngest when the pool runs short.

- greedy: every sequence equals the static engine's with fewer pages than all sequences need at
  once (admission waits, pages are reused), with preemption forced, page sizes 4 and 16, G 1 and 4,
  and Gemma 3's sliding layers and soft caps;
- sampled: the same rollout whatever the pages, slots and page size, token for token that of one
  max-length reservation per slot (no pool: `kv_cache_bytes: 0`), log-probs equal to a
  teacher-forced pass;
- accounting, step by step: no page in two tables except a prompt's shared pages, free and held
  pages disjoint and together the pool, every page back at the end;
- prompt pages do not grow with G; a cache below one max-length sequence is refused;
- the gather attention equals JAX's reference for the TPU kernel (ragged lengths, GQA, pages in
  random order, sliding window, soft cap) and the TPU kernel itself, run under shard_map by the TPU
  interpreter on CPU (two mends to JAX 0.10.2's interpreter: tests/engine/pallas_interpret.py); the
  TPU kernel compiles for a v5e slice in the engine's decode step with libtpu.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_engine import PROMPTS, M, arrays, config, teacher_forced_rollout

from grpo_jax.engine.pages import page_bytes, pages_needed
from grpo_jax.engine.paged import paged_program, paged_step, start_paged
from grpo_jax.engine.paged_decode import gather_attention
from grpo_jax.engine.sampling import generate, pad_prompts
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.runtime.sharding import AXES, one_device_mesh


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))


def cache_bytes(model, *, page_size: int, sequences: float, group_size: int = 4) -> int:
    """Bytes for the prompt region and `sequences` max-length sequences' pages (per shard)."""
    cfg = model.config
    Tp, most = pages_needed(8, M, page_size)
    pages = 1 + len(PROMPTS) * Tp + int(sequences * most)
    return pages * page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, 4)


def run(model, cfg, key=0):
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    graphdef, state = nnx.split(model)
    rollout, stats = paged_program(graphdef, cfg, one_device_mesh())(state, ids, mask, jax.random.key(key))
    return rollout, {k: int(v) for k, v in stats.items()}


def varied_stops(model) -> tuple[int, ...]:
    free = generate(model, PROMPTS, config(group_size=1, temperature=0.0, stop_token_ids=(1,)), jax.random.key(0))
    tokens = np.asarray(free.tokens)
    return tuple(sorted({int(tokens[i, (3 * i) % M]) for i in range(0, len(PROMPTS), 2)} - {0}))


@pytest.mark.parametrize("group_size", [1, 4])
def test_greedy_sequences_equal_the_static_engines_with_pages_short(model, group_size):
    cfg = config(group_size=group_size, temperature=0.0, stop_token_ids=varied_stops(model))
    static = arrays(generate(model, PROMPTS, cfg, jax.random.key(0)))
    assert len(set(static["lengths"].tolist())) >= 3 and static["truncated"].any()
    # G = 1: the forced preemption alone (the other layouts add compiles, not coverage).
    cases = ((4, 12, 1),) if group_size == 1 else ((4, 12, 1), (4, 5, 2.5), (16, 3, 3))
    for page_size, slots, sequences in cases:
        paged = dataclasses.replace(cfg, engine="paged", slots=slots, page_size=page_size,
                                    kv_cache_bytes=cache_bytes(model, page_size=page_size, sequences=sequences))
        rollout, stats = run(model, paged)
        got = arrays(rollout)
        for key in ("tokens", "mask", "lengths", "truncated"):
            np.testing.assert_array_equal(got[key], static[key], err_msg=f"{key}, {page_size=} {slots=}")
        np.testing.assert_allclose(got["logprobs"], static["logprobs"], atol=1e-5)
        if sequences == 1:  # one max-length sequence's pages for 12 slots: the youngest are preempted
            assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
            assert stats["pages_peak"] == stats["pool_pages"]
        assert stats["useful_slot_steps"] == got["lengths"].sum() + stats["recomputed_tokens"]


def test_sliding_window_layers_on_pages_equal_the_static_engine():
    gemma = Transformer(tiny("gemma3_text"), rngs=nnx.Rngs(1))
    cfg = config(group_size=4, temperature=0.0, stop_token_ids=(7, 8, 9))
    static = arrays(generate(gemma, PROMPTS, cfg, jax.random.key(0)))
    rollout, stats = run(gemma, dataclasses.replace(cfg, engine="paged", slots=6, page_size=4,
                                                    kv_cache_bytes=cache_bytes(gemma, page_size=4, sequences=2)))
    got = arrays(rollout)
    assert got["lengths"].max() > 8 and stats["preemptions"] > 0  # past the window of 8
    for key in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(got[key], static[key], err_msg=key)
    np.testing.assert_allclose(got["logprobs"], static["logprobs"], atol=1e-5)


def test_a_sampled_rollout_does_not_depend_on_pages_or_slots_and_is_a_reservation_per_slots(model):
    cfg = config(group_size=4, temperature=0.8, stop_token_ids=tuple(range(3, 30)))
    reserved, stats = run(model, dataclasses.replace(cfg, engine="paged", slots=5), key=7)
    assert stats["pool_pages"] == 0 and stats["steps"] > 0  # the slot loop over one reservation per slot
    want = arrays(reserved)
    assert len(set(want["lengths"].tolist())) >= 4 and want["truncated"].any()
    preempted = 0
    # (4, 0, 0): a slot and max_new_tokens of pages for every sequence: the lock-step loop.
    for page_size, slots, sequences in ((4, 9, 1.5), (16, 4, 0), (8, 32, 4), (4, 0, 0)):
        rollout, stats = run(model, dataclasses.replace(
            cfg, engine="paged", slots=slots, page_size=page_size,
            kv_cache_bytes=sequences and cache_bytes(model, page_size=page_size, sequences=sequences)), key=7)
        got = arrays(rollout)
        preempted += stats["preemptions"]
        for key in ("tokens", "mask", "lengths", "truncated"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key}, {page_size=} {slots=}")
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-5)
    assert preempted > 0 and rollout.experts is None and rollout.prompt_experts is None
    m = got["mask"].astype(bool)
    np.testing.assert_allclose(got["logprobs"][m], teacher_forced_rollout(model, rollout)[m], atol=1e-5)


def test_every_page_is_held_once_or_free_at_every_step_and_all_return(model):
    cfg = config(group_size=4, temperature=1.0, stop_token_ids=tuple(range(3, 40)), engine="paged", slots=7,
                 page_size=4, kv_cache_bytes=cache_bytes(model, page_size=4, sequences=2))
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    graphdef, state = nnx.split(model)
    mesh = one_device_mesh()

    @jax.jit
    def start(state):
        return start_paged(nnx.merge(graphdef, state), ids, mask, jax.random.key(4), config=cfg, mesh=mesh)[1]

    st = start(state)
    step = stepper(graphdef, ids, mask, cfg, mesh)
    pool = st.cache.pool
    first_pool = 1 + len(PROMPTS) * st.cache.prompt_pages
    steps = 0
    while (np.asarray(st.done) < len(PROMPTS) * 4).any():
        st = step(state, st)
        steps += 1
        seq, table, nfree = np.asarray(st.seq)[0], np.asarray(st.cache.table)[0], int(st.cache.nfree[0])
        held = np.asarray(st.cache.held_pages())[0] & (seq >= 0)[:, None]
        private = table[held]
        assert len(set(private.tolist())) == len(private), f"a page in two tables at step {steps}"
        assert (private >= first_pool).all()
        shared = table[(seq >= 0)[:, None] & ~held & (table > 0)]
        assert (shared < first_pool).all()  # everything else a slot reads is its prompt's pages
        free = np.asarray(st.cache.free)[0, :nfree]
        assert not set(free.tolist()) & set(private.tolist())
        assert sorted(free.tolist() + private.tolist()) == list(range(first_pool, first_pool + pool))
    assert int(st.cache.nfree[0]) == pool and int(st.counts["preemptions"]) > 0


def stepper(graphdef, ids, mask, cfg, mesh):
    """A jitted single step of the loop (the loop's constants rebuilt inside; its prefill unused)."""
    @jax.jit
    def step(state, st):
        loop, _ = start_paged(nnx.merge(graphdef, state), ids, mask, jax.random.key(4), config=cfg, mesh=mesh)
        return paged_step(loop, st)
    return step


def test_prompt_pages_do_not_grow_with_the_group_and_a_cache_too_small_is_refused(model):
    byts = cache_bytes(model, page_size=4, sequences=2)
    pools = {}
    for G in (1, 8):
        _, stats = run(model, config(group_size=G, temperature=0.0, engine="paged", slots=4, page_size=4,
                                     kv_cache_bytes=byts))
        pools[G] = stats["pool_pages"]
    assert pools[1] == pools[8] == 2 * pages_needed(8, M, 4)[1]
    with pytest.raises(ValueError, match="paged_attention=pallas runs on tpu, and this run's devices are cpu.*use sampling.paged_attention=gather"):
        run(model, config(group_size=2, temperature=0.0, engine="paged", slots=4, page_size=8, paged_attention="pallas"))
    with pytest.raises(ValueError, match="raise it to at least"):
        run(model, config(group_size=2, temperature=0.0, engine="paged", slots=4, page_size=4,
                          kv_cache_bytes=cache_bytes(model, page_size=4, sequences=0.5)))


def test_gather_attention_equals_the_tpu_kernels_reference():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    rng = np.random.default_rng(0)
    J, H, K, D, Sg, pages, T = 5, 6, 2, 16, 4, 40, 6
    lengths = np.array([1, 5, 24, 13, 8], np.int32)
    table = rng.permutation(np.arange(1, pages))[:J * T].reshape(J, T).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(J, H, D)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(pages, Sg, 2 * K, D)), jnp.float32)
    for window, cap in ((None, None), (5, 3.0)):
        want = ref_ragged_paged_attention(q, kv, jnp.asarray(lengths), jnp.asarray(table),
                                          jnp.arange(J + 1, dtype=jnp.int32), jnp.array([J], jnp.int32),
                                          sm_scale=0.25, sliding_window=window, soft_cap=cap)
        kv5 = kv.reshape(pages, Sg, K, 2, D)  # the split layout of the same pages
        split = (kv5[..., 0, :].transpose(0, 2, 3, 1)[None], kv5[..., 1, :].transpose(0, 2, 1, 3)[None])
        got = gather_attention(q, split, jnp.asarray(table)[None], jnp.asarray(lengths)[None], window=window,
                               scale=0.25, cap=cap, dtype=jnp.float32)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


def test_the_tpu_kernel_in_interpret_mode_equals_the_gather_path():
    """`kernel_attention` (JAX's TPU kernel under shard_map, each of 2 row shards over its own pages) run
    by the TPU interpreter on CPU equals `gather_attention` on the same pages: ragged lengths (1 to
    a full table), GQA 2:1, page tables in random order, with and without a window and soft cap."""
    from jax.experimental.pallas import tpu as pltpu
    from pallas_interpret import mend_masked_stores, mend_reshaped_loads

    from grpo_jax.config import MeshConfig
    from grpo_jax.engine.paged_decode import kernel_attention
    from grpo_jax.runtime.sharding import make_mesh

    mend_reshaped_loads()
    mend_masked_stores()
    rng = np.random.default_rng(1)
    Z, J, H, K, D, Sg, T, pages = 2, 3, 4, 2, 128, 8, 4, 16  # the kernel needs head_dim % 128, Sg % 8
    lengths = np.array([[1, 17, 32], [9, 8, 25]], np.int32)
    table = np.stack([rng.permutation(np.arange(1, pages))[:J * T].reshape(J, T) for _ in range(Z)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(Z * J, H, D)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(Z, pages, Sg, 2 * K, D)), jnp.float32)  # interleaved: k0 v0 k1 v1
    kv6 = kv.reshape(Z, pages, Sg, K, 2, D)
    split = (kv6[..., 0, :].transpose(0, 1, 3, 4, 2), kv6[..., 1, :].transpose(0, 1, 3, 2, 4))
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    for window, cap in ((None, None), (6, 3.0)):
        want = gather_attention(q, split, jnp.asarray(table), jnp.asarray(lengths), window=window, scale=D ** -0.5,
                                cap=cap, dtype=jnp.float32)
        with pltpu.force_tpu_interpret_mode():
            got = kernel_attention(q, (kv,), jnp.asarray(table), jnp.asarray(lengths), window=window,
                                   scale=D ** -0.5, cap=cap, mesh=mesh)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, err_msg=f"{window=} {cap=}")
        # A table read in the wrong order is caught.
        assert np.abs(np.asarray(gather_attention(q, split, jnp.asarray(table[..., ::-1]), jnp.asarray(lengths),
                      window=window, scale=D ** -0.5, cap=cap, dtype=jnp.float32)) - np.asarray(got)).max() > 0.1


@pytest.mark.slow
def test_the_tpu_kernel_compiles_in_the_engine_for_a_v5e_slice():
    """The whole paged program, decode attention by `ragged_paged_attention` under shard_map over 4
    row shards, compiled by XLA:TPU (libtpu, no TPU attached): the kernel is in the program."""
    pytest.importorskip("libtpu", reason="XLA:TPU comes with libtpu: pip install 'grpo-jax[tpu-compile]'")
    from grpo_jax.tools.bench.abstract_run import with_shardings
    from grpo_jax.tools.bench.memory import topology_devices
    from grpo_jax.runtime.sharding import param_shardings
    from jax.sharding import Mesh

    mesh = Mesh(np.array(topology_devices("v5e:2x2")).reshape(4, 1, 1, 1), AXES)
    shape = tiny("qwen3", head_dim=128, num_heads=4, num_kv_heads=2)
    abstract = nnx.eval_shape(lambda: Transformer(shape, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    graphdef, state = nnx.split(abstract)
    state = with_shardings(state, param_shardings(state, mesh).shardings)
    cfg = config(group_size=4, max_new_tokens=128, prompt_buckets=(32,), stop_token_ids=(2,), engine="paged",
                 slots=8, page_size=16, paged_attention="pallas")
    ids = jax.ShapeDtypeStruct((8, 32), jnp.int32)
    # The prefill's splash kernel (a mesh on TPU) takes bf16 at the default precision: the tests'
    # "highest" (conftest.py) asks Mosaic for an fp32 contraction of bf16, which it refuses.
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        lowered = paged_program(graphdef, cfg, mesh).lower(state, ids, ids, jax.eval_shape(lambda: jax.random.key(0)))
        compiled = lowered.compile()
    assert compiled.as_text().count("tpu_custom_call") >= shape.num_layers
    with pytest.raises(ValueError, match="page_size % 8 == 0.*use sampling.paged_attention=gather"):
        paged_program(graphdef, dataclasses.replace(cfg, page_size=4), mesh).lower(
            state, ids, ids, jax.eval_shape(lambda: jax.random.key(0)))
