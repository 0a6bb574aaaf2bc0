"""Meshes: params are placed exactly as the rules say, and a full GRPO step (sampling, rewards,
advantages, update) gives the same parameters on every mesh shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from grpo_jax.config import GRPOConfig, MeshConfig, SamplingConfig
from grpo_jax.learner.grpo import group_advantages
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.engine.sampling import generate
from grpo_jax.runtime.sharding import (batch_sharding, make_mesh, mesh_shape, param_shardings, place_train_state,
                                       rows_per_shard)
from grpo_jax.learner.train_step import Batch, StepSpec, init_state, make_train_step

N, G = 8, 4
SAMPLING = SamplingConfig(group_size=G, max_new_tokens=6, temperature=1.0, stop_token_ids=(2,), prompt_buckets=(8,),
                          attend_phases=1)  # one attention program: fewer compiles on 4 meshes
MESHES = [(1, 1, 1, 1), (8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2)]  # (data, fsdp, expert, tensor)


def model():
    # Every sharded dimension divides its mesh axis on all the meshes.
    return Transformer(tiny("qwen3", hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2),
                       rngs=nnx.Rngs(0))


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, n).tolist() for n in (3, 5, 8, 2, 7, 4, 6, 8)]


def reward(tokens, lengths):
    """A deterministic stand-in verifier: the share of even tokens in the completion."""
    return np.array([np.mean(t[:n] % 2 == 0) if n else 0.0 for t, n in zip(tokens, lengths)], np.float32)


def grpo_step(shape):
    data, fsdp, expert, tensor = shape
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, expert=expert, tensor=tensor),
                     jax.devices()[:int(np.prod(shape))])
    policy = model()
    # SGD with momentum: Adam's first step, lr * g / (|g| + eps), would turn the rounding differences
    # of near-zero gradients into lr-sized ones and hide what this test measures.
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    graphdef, state = init_state(policy, opt)
    state, shardings, left_whole = place_train_state(state, mesh)
    assert left_whole == []
    nnx.update(policy, state.params)
    rollout = generate(policy, prompts(), SAMPLING, jax.random.key(1), mesh=mesh)
    tokens, lengths = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
    rewards = jnp.asarray(reward(tokens, lengths))
    adv = group_advantages(rewards, G)
    batch = Batch(prompt_ids=jnp.repeat(rollout.prompt_ids, G, axis=0),
                  prompt_mask=jnp.repeat(rollout.prompt_mask, G, axis=0), completion_ids=rollout.tokens,
                  completion_mask=rollout.mask, rewards=rewards, advantages=adv.advantages, valid=adv.valid,
                  zero_std=adv.zero_std, truncated=rollout.truncated, old_logprobs=rollout.logprobs)
    step = make_train_step(StepSpec(graphdef=graphdef, optimizer=opt, config=GRPOConfig(), micro_batches=2), mesh=mesh,
                           state_shardings=shardings)
    state, metrics = step(state, batch)
    return mesh, state, tokens, float(metrics["train/loss"])


@pytest.fixture(scope="module")
def results():
    return {shape: grpo_step(shape) for shape in MESHES}


@pytest.mark.parametrize("shape", MESHES)
def test_grpo_step_is_the_same_on_every_mesh(results, shape):
    _, ref_state, ref_tokens, ref_loss = results[(1, 1, 1, 1)]
    _, state, tokens, loss = results[shape]
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert any(float(jnp.abs(a - b).max()) > 1e-4 for a, b in
               zip(jax.tree.leaves(state.params), jax.tree.leaves(nnx.split(model(), nnx.Param)[1]))), "no update"


@pytest.mark.parametrize("shape", MESHES)
def test_params_are_placed_exactly_as_the_rules_say(results, shape):
    mesh, state, _, _ = results[shape]
    E = ("fsdp", "expert")  # embed: over fsdp and the expert axis (which splits rows as fsdp does)
    expected = {  # logical axes -> mesh axes: embed->E, heads/kv_heads/mlp/vocab->tensor
        ("embed",): P("tensor", E),  # [vocab, embed]
        ("lm_head",): P(E, "tensor"),  # [embed, vocab]
        ("final_norm",): P(E),
        ("layers", "q_proj"): P(None, E, "tensor", None),
        ("layers", "k_proj"): P(None, E, "tensor", None),
        ("layers", "o_proj"): P(None, "tensor", None, E),
        ("layers", "gate_proj"): P(None, E, "tensor"),
        ("layers", "down_proj"): P(None, "tensor", E),
        ("layers", "q_norm"): P(None, None),
    }

    def normalise(spec):  # size-1 mesh axes are not split: compare against what the mesh can do
        def split(a):
            axes = [x for x in ((a,) if isinstance(a, str) else a or ()) if mesh.shape[x] > 1]
            return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
        return P(*[split(a) for a in spec])

    flat = dict(nnx.to_flat_state(state.params))
    for path, spec in expected.items():
        actual = flat[path].get_value().sharding
        assert actual.mesh.shape == mesh.shape
        assert normalise(actual.spec + (None,) * (len(spec) - len(actual.spec))) == normalise(spec), path
    # Optimizer state shaped like the params (here the momentum trace) is sharded like them.
    moments = [x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, nnx.State))
               if isinstance(x, nnx.State)]
    assert moments
    for (path, var), (_, m) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(moments[0])):
        assert m.get_value().sharding.is_equivalent_to(var.get_value().sharding, var.get_value().ndim), path


def test_a_dimension_the_mesh_cannot_split_is_reported():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))
    _, params = nnx.split(model(), nnx.Param)
    sharded = param_shardings(params, mesh)
    # 2 kv heads over 8 tensor devices: replicated, and said so.
    assert any("k_proj" in r and "kv_heads(2) over tensor(8)" in r for r in sharded.replicated)


def test_mesh_shape_resolution_and_errors():
    assert mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=1), 8) == (4, 2, 1, 1)
    assert mesh_shape(MeshConfig(data=2, fsdp=1, expert=-1, tensor=2), 8) == (2, 1, 2, 2)
    assert mesh_shape(MeshConfig(expert=4), 8) == (1, 2, 4, 1)  # fsdp takes the rest by default
    assert mesh_shape(MeshConfig(expert=-1), 8) == (1, 1, 8, 1)  # ... and is 1 when another axis does
    with pytest.raises(ValueError, match="3 devices"):
        mesh_shape(MeshConfig(data=3, fsdp=1, tensor=1), 8)
    with pytest.raises(ValueError, match="not divisible"):
        mesh_shape(MeshConfig(data=-1, fsdp=3, tensor=1), 8)


def test_a_loaded_model_goes_from_the_host_to_the_rules_shardings(tmp_path):
    from grpo_jax.models import from_pretrained, save_pretrained
    from grpo_jax.runtime.sharding import place_model

    save_pretrained(model(), tmp_path)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    plain, loaded = from_pretrained(tmp_path), from_pretrained(tmp_path, mesh=mesh)
    moved = from_pretrained(tmp_path)
    place_model(moved, mesh)  # from the default device, through the host
    expected = param_shardings(nnx.state(plain, nnx.Param), mesh).shardings
    for (path, want), (_, x), (_, y), (_, p) in zip(*(nnx.to_flat_state(t) for t in (
            expected, nnx.state(loaded, nnx.Param), nnx.state(moved, nnx.Param), nnx.state(plain, nnx.Param)))):
        for placed in (x.get_value(), y.get_value()):
            assert placed.sharding == want.get_value(), path
            np.testing.assert_array_equal(np.asarray(placed), np.asarray(p.get_value()))


def test_a_drawn_or_loaded_model_stays_on_the_host_until_it_is_cut_onto_the_mesh(tmp_path):
    """`init_on_host` (a run's `model.architecture`, train-rm's fresh model) and `on_host` loading (a
    reward model, a judge) leave NumPy arrays in host memory: no device holds any of the model until
    `place_model` cuts each device's slices there; the values are the eager init's, bit for bit."""
    from grpo_jax.models import from_pretrained, save_pretrained
    from grpo_jax.runtime.sharding import init_on_host, place_model

    import gc

    def device_arrays():
        gc.collect()
        return {id(a): a for a in jax.live_arrays()}

    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    eager = model()
    save_pretrained(eager, tmp_path)
    expected = param_shardings(nnx.state(eager, nnx.Param), mesh).shardings
    for build in (lambda: init_on_host(model), lambda: from_pretrained(tmp_path, on_host=True)):
        before = device_arrays()
        host = build()
        assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(nnx.state(host, nnx.Param)))
        new = [a.shape for i, a in device_arrays().items() if i not in before]
        assert not new, new  # no device holds any of it
        place_model(host, mesh)
        for (path, want), (_, x), (_, e) in zip(*(nnx.to_flat_state(t) for t in (
                expected, nnx.state(host, nnx.Param), nnx.state(eager, nnx.Param)))):
            assert x.get_value().sharding == want.get_value(), path
            np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(e.get_value()))
    with pytest.raises(ValueError, match="exclude each other"):
        from_pretrained(tmp_path, on_host=True, mesh=mesh)


def test_expert_weights_split_over_the_expert_axis():
    # A mixture-of-experts layer's weights: experts over `expert`, each expert's MLP width over
    # `tensor`, their embed over `fsdp`; a dense weight's embed (the router's) over fsdp x expert, the
    # router's expert logits replicated.
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
    params = nnx.State({
        "expert_gate": nnx.Param(jnp.zeros((3, 8, 16, 4)), logical_axes=("layers", "experts", "embed", "expert_mlp")),
        "expert_down": nnx.Param(jnp.zeros((3, 8, 4, 16)), logical_axes=("layers", "experts", "expert_mlp", "embed")),
        "router": nnx.Param(jnp.zeros((3, 16, 8)), logical_axes=("layers", "embed", "router")),
    })
    sharded = param_shardings(params, mesh)
    assert sharded.replicated == []
    specs = {k: v.get_value().spec for k, v in nnx.to_flat_state(sharded.shardings)}
    assert specs[("expert_gate",)] == P(None, "expert", "fsdp", "tensor")
    assert specs[("expert_down",)] == P(None, "expert", "tensor", "fsdp")
    assert specs[("router",)] == P(None, ("fsdp", "expert"), None)
    # Batch rows are split over expert too: it is data parallelism for the dense layers, whose weights
    # it splits as fsdp does.
    assert rows_per_shard(mesh) == 4 and batch_sharding(mesh).spec == P(("data", "fsdp", "expert"))
    # One expert axis alone (multi-host v5e's layout): the dense weights split over it, no expert
    # weight's embed axis is.
    alone = param_shardings(params, make_mesh(MeshConfig(data=1, fsdp=1, expert=8, tensor=1)))
    specs = {k: v.get_value().spec for k, v in nnx.to_flat_state(alone.shardings)}
    assert specs[("expert_gate",)] == P(None, "expert", None, None) and specs[("router",)] == P(None, "expert", None)
    # An embed axis fsdp divides and fsdp x expert does not: over fsdp alone, and the rest is said.
    odd = nnx.State({"w": nnx.Param(jnp.zeros((6, 4)), logical_axes=("embed", None))})
    sharded = param_shardings(odd, mesh)
    assert sharded.shardings["w"].get_value().spec == P("fsdp", None)
    assert sharded.replicated == ["['w']: embed(6) over expert(2)"]


def test_the_engines_prefill_keeps_each_prompt_on_its_rows_devices():
    """Without the rows' split, XLA takes the embedding table's (embed over fsdp) for the prompts'
    hidden states: every device holds every prompt in slices of E and all-reduces each norm (on a
    multi-host v5e that all-reduce did not even compile). With it (what the engines pass), no
    all-reduce is left and the temporaries shrink."""
    mesh = make_mesh(MeshConfig(fsdp=8))
    graphdef, state = nnx.split(model())
    state = jax.device_put(state, param_shardings(state, mesh).shardings)
    ids = jax.device_put(jnp.ones((8, 64), jnp.int32), batch_sharding(mesh, 2))
    compiled = {}
    for name, rows in (("free", None), ("rows", batch_sharding(mesh, 1))):
        def last_logits(state, ids, rows=rows):
            return nnx.merge(graphdef, state).prefill_kv(ids, ids > 0, row_sharding=rows)[0]
        compiled[name] = jax.jit(last_logits).lower(state, ids).compile()
    assert "all-reduce(" in compiled["free"].as_text() and "all-reduce(" not in compiled["rows"].as_text()
    temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temps["rows"] < temps["free"] / 2, temps
