"""Every engine records a mixture-of-experts model's routing (grpo_jax.engine.routing): the experts of
each real prompt token (its prefill) and of each completion token when it was fed are those of a
teacher-forced plain pass over [prompt, completion]; slots no token was fed through hold 0.

- the static engine, with its shared prefill and the reference path that repeats every prompt G times;
- the continuous engine with slots refilled mid-loop, and its over-sampling stream, whose chosen
  groups carry the experts of the rows they came from;
- the paged engine with a pool so short that sequences are preempted and recomputed (the recompute's
  routing is the one recorded).
And each engine on a mesh with an expert axis (its prefill and decode steps run the experts by
all-to-all, `models.experts`) draws the rollout it draws on one device, experts and all.
A dense model's rollouts carry none (tests/engine/test_engine.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from teacher_forcing import assert_same_experts, teacher_forced_experts, tiny_moe
from test_engine import PROMPTS, M, config, stream_over

from grpo_jax.engine.draw import SampleRows
from grpo_jax.engine.paged import paged_program
from grpo_jax.engine.sampling import check_rollout, generate, pad_prompts
from grpo_jax.engine.pages import page_bytes, pages_needed
from grpo_jax.runtime.hosts import local_rows, whole
from grpo_jax.config import MeshConfig
from grpo_jax.runtime.sharding import make_mesh, one_device_mesh, place_model


@pytest.fixture(scope="module")
def moe():
    return tiny_moe()


def sampled(**kw):
    return config(group_size=2, temperature=1.0, stop_token_ids=tuple(range(3, 30)), **kw)


def assert_recorded(model, rollout) -> None:
    """The rollout's experts are the teacher-forced pass's at every real prompt token and every fed
    completion token (all but a sequence's last), and 0 at every other completion slot."""
    check_rollout(rollout, rows=len(PROMPTS) * rollout.group_size, max_new_tokens=M)
    c = model.config
    assert rollout.experts.dtype == rollout.prompt_experts.dtype == np.uint8
    assert rollout.experts.shape[2:] == (c.num_layers, c.num_experts_per_tok)
    want_prompt, want = teacher_forced_experts(model, rollout.prompt_ids, rollout.prompt_mask, rollout.tokens,
                                               group_size=rollout.group_size)
    assert_same_experts(rollout.prompt_experts, want_prompt, np.asarray(rollout.prompt_mask, bool), "prompt")
    lengths = np.asarray(rollout.lengths)
    fed = np.arange(M)[None] < lengths[:, None] - 1
    assert len(set(lengths.tolist())) >= 3 and fed.sum() > 20  # stops at different steps, and max_new_tokens
    assert_same_experts(rollout.experts, want, fed, "completion")
    assert (np.asarray(rollout.experts)[~fed] == 0).all()


def test_the_static_engine_records_the_experts_of_a_teacher_forced_pass(moe):
    for share_prefill in (True, False):  # False: every prompt prefilled G times (the reference path)
        rollout = generate(moe, PROMPTS, sampled(engine="static"), jax.random.key(1), share_prefill=share_prefill)
        assert rollout.truncated.any()
        assert_recorded(moe, rollout)
    # The rows a rollout source scores and collects (this host's: all of them here), each with its prompt's.
    G, N = rollout.group_size, len(PROMPTS)
    rows = SampleRows.of(rollout, read=lambda arrays: local_rows(arrays, whole(N * G)),
                         read_prompts=lambda arrays: local_rows(arrays, whole(N)))
    np.testing.assert_array_equal(rows.experts, np.asarray(rollout.experts))
    np.testing.assert_array_equal(rows.prompt_experts, np.repeat(np.asarray(rollout.prompt_experts), G, axis=0))


def test_the_continuous_engine_records_them_through_refills_and_over_sampling(moe):
    cfg = sampled(engine="continuous", slots=3)  # 16 sequences, 3 slots: refilled mid-loop
    one_shot = generate(moe, PROMPTS, cfg, jax.random.key(5))
    assert_recorded(moe, one_shot)
    # Over-sampling (rollout.stream), same key: the chosen groups (uniform ones dropped, the rest in
    # the order they finished) carry the experts of the rows they came from.
    stream, c = stream_over(moe, cfg, informative={1, 2, 5, 6, 7}, num_groups=3)
    G, chosen = cfg.group_size, [ex.index for ex in c.examples]
    assert not stream.done and chosen[0] > 0  # prompt 0 was set aside: rows moved
    for g, i in enumerate(chosen):
        mine, theirs = slice(g * G, (g + 1) * G), slice(i * G, (i + 1) * G)
        np.testing.assert_array_equal(c.rows.tokens[mine], np.asarray(one_shot.tokens)[theirs])
        np.testing.assert_array_equal(c.rows.experts[mine], np.asarray(one_shot.experts)[theirs])
        np.testing.assert_array_equal(c.rows.prompt_experts[mine],
                                      np.repeat(np.asarray(one_shot.prompt_experts)[i:i + 1], G, axis=0))


def test_the_paged_engine_records_the_recomputed_routing_of_preempted_sequences(moe):
    c = moe.config
    Tp, most = pages_needed(8, M, 4)
    pool = (1 + len(PROMPTS) * Tp + int(1.5 * most)) * page_bytes(c.num_layers, c.num_kv_heads, c.head_dim, 4, 4)
    cfg = sampled(engine="paged", slots=9, page_size=4, kv_cache_bytes=pool)
    graphdef, state = nnx.split(moe)
    rollout, stats = paged_program(graphdef, cfg, one_device_mesh())(state, *pad_prompts(PROMPTS, (8,), 0),
                                                                      jax.random.key(7))
    assert int(stats["preemptions"]) > 0 and int(stats["recomputed_tokens"]) > 0
    assert_recorded(moe, rollout)


@pytest.mark.parametrize("engine", ["static", "continuous", "paged"])
def test_each_engine_with_expert_parallelism_draws_what_one_device_draws(moe, engine):
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))  # 2 of the 8 experts per device
    spread = nnx.clone(moe)  # the same weights, spread over the mesh
    place_model(spread, mesh)
    cfg = sampled(engine=engine)
    one, many = (generate(m, PROMPTS, cfg, jax.random.key(3), mesh=mesh_) for m, mesh_ in ((moe, None), (spread, mesh)))
    for name in ("tokens", "mask", "experts", "prompt_experts"):
        np.testing.assert_array_equal(np.asarray(getattr(many, name)), np.asarray(getattr(one, name)), err_msg=name)
    np.testing.assert_allclose(np.asarray(many.logprobs), np.asarray(one.logprobs), atol=1e-5)
    assert np.asarray(one.experts).any()


def test_a_mixed_dense_and_moe_stack_with_expert_parallelism_equals_one_device():
    """Layers 0 and 2 dense, 1 and 3 experts (Qwen3-MoE's decoder_sparse_step=2): the paged engine
    on a mesh with an expert axis draws what one device draws, its routing recorded for the sparse
    layers (0 in the dense layers' slots), and the teacher-forced log-probs on the mesh equal one
    device's; the scanned pass equals the unrolled one, and so do their gradients (the scan's MLP
    stacks are closed over, each layer's cond slicing its own)."""
    from grpo_jax.models import Transformer
    from grpo_jax.models.presets import tiny

    cfg = tiny("qwen3_moe", num_layers=4, dense_layers=(0, 2))
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    assert cfg.sparse_layers == (1, 3) and model.layers.expert_gate[...].shape[0] == 2
    assert model.layers.gate_proj[...].shape[0] == 2 and model.layers.q_proj[...].shape[0] == 4
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    spread = nnx.clone(model)
    place_model(spread, mesh)
    s = sampled(engine="paged")
    one, many = (generate(m, PROMPTS, s, jax.random.key(5), mesh=mesh_) for m, mesh_ in ((model, None), (spread, mesh)))
    for name in ("tokens", "mask", "experts", "prompt_experts"):
        np.testing.assert_array_equal(np.asarray(getattr(many, name)), np.asarray(getattr(one, name)), err_msg=name)
    experts = np.asarray(one.experts)
    assert experts[:, :, [1, 3]].any() and not experts[:, :, [0, 2]].any()
    assert_recorded(model, one)
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    unrolled = Transformer(cfg, rngs=nnx.Rngs(1), scan_layers=False)
    np.testing.assert_allclose(np.asarray(unrolled(ids, attention_mask=mask)), np.asarray(model(ids, attention_mask=mask)),
                               atol=1e-5)

    def loss(m):
        return jax.nn.log_softmax(m(ids, attention_mask=mask))[..., 5].sum()

    grads = [nnx.state(nnx.grad(loss)(m), nnx.Param) for m in (model, unrolled)]
    flat = [dict(nnx.to_flat_state(g)) for g in grads]
    assert flat[0].keys() == flat[1].keys()
    for k in flat[0]:
        np.testing.assert_allclose(np.asarray(flat[0][k][...]), np.asarray(flat[1][k][...]), rtol=1e-5, atol=1e-5,
                                   err_msg=str(k))
    assert np.abs(np.asarray(flat[0][("layers", "expert_gate")][...])).max() > 0
    assert np.abs(np.asarray(flat[0][("layers", "gate_proj")][...])).max() > 0
