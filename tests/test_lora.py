"""LoRA adapters (issue 16): fresh adapters are exactly the base model, the unmerged path (training,
prefill) equals the merged weights (the sampler's decode, the export) to 1e-5 in fp32, and the
sampler's rollout uses the adapters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.models import Transformer
from grpo_jax.models.lora import TARGETS, LoRAParam, add_adapters, merge_adapters, split_adapters
from grpo_jax.models.presets import tiny
from grpo_jax.sampling import SamplingConfig, generate


def _ids(seed=0, shape=(3, 9)):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 250, shape), jnp.int32)


def _adapted(family="qwen3", targets=TARGETS, rank=4, scale=0.05):
    model = Transformer(tiny(family), rngs=nnx.Rngs(0))
    add_adapters(model, rank=rank, alpha=2.0 * rank, targets=targets, key=jax.random.key(1))
    graphdef, adapters, base = split_adapters(model)
    # Trained-looking adapters: B no longer 0.
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    adapters = jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return nnx.merge(graphdef, adapters, base)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_fresh_adapters_give_exactly_the_base_logits(family):
    model = Transformer(tiny(family), rngs=nnx.Rngs(0))
    ids = _ids()
    base = np.asarray(model(ids))
    add_adapters(model, rank=8, alpha=16, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(model(ids)), base)
    _, adapters, rest = split_adapters(model)
    names = {str(k[-1]) for k, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    assert len(jax.tree.leaves(adapters)) == 2 * len(TARGETS)
    assert not any("lora" in str(p) for p, _ in jax.tree_util.tree_flatten_with_path(rest)[0]), names


@pytest.mark.parametrize("targets", [TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj")])
def test_adapters_equal_their_merged_weights(targets):
    model = _adapted(targets=targets)
    merged = merge_adapters(model)
    assert not any(isinstance(v, LoRAParam) for _, v in nnx.iter_graph(merged))
    ids = _ids(1)
    got, want = np.asarray(model(ids)), np.asarray(merged(ids))
    base = np.asarray(Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))(ids))
    assert np.abs(got - base).max() > 1e-3  # the adapters do something
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_rollout_uses_the_adapters():
    model = _adapted(scale=0.3)
    merged = merge_adapters(model)
    base = Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))
    prompts = [list(range(5, 12)), list(range(20, 24))]
    cfg = SamplingConfig(group_size=2, max_new_tokens=8, temperature=0.0, prompt_buckets=(8,))
    out = {name: generate(m, prompts, cfg, jax.random.key(0)) for name, m in
           (("lora", model), ("merged", merged), ("base", base))}
    np.testing.assert_array_equal(np.asarray(out["lora"].tokens), np.asarray(out["merged"].tokens))
    np.testing.assert_allclose(np.asarray(out["lora"].logprobs), np.asarray(out["merged"].logprobs), atol=1e-5)
    assert not np.array_equal(np.asarray(out["lora"].tokens), np.asarray(out["base"].tokens))
