"""`sampling.kv_cache_bytes: auto` (grpo_jax.engine.sizing): the pool sized from a (faked) chip's
memory by the formula, what the run holds counted from its own construction, CPU keeping today's
behaviour, a chip too small refused in one line, and a run whose sequences cannot all fit at once
finishing by preemption with the same tokens as the lock-step loop."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from runs import CONFIG

from grpo_jax.config import ConfigError, config_from_dict
from grpo_jax.engine import sizing
from grpo_jax.engine.paged import paged_program
from grpo_jax.engine.sampling import pad_prompts
from grpo_jax.engine.sizing import pool_bytes, resolve_kv_cache, sampler_bytes
from grpo_jax.models import Transformer
from grpo_jax.runtime.sharding import one_device_mesh
from grpo_jax.trainer.prepare import prepare
from grpo_jax.trainer.construct import held_bytes

MIB = 2**20


def run_config(tmp_path, **sampling):
    return config_from_dict({**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path), "prompts_per_step": 8},
                             "sampling": {**CONFIG["sampling"], "max_new_tokens": 24, "engine": "paged", **sampling}})


def other_buffers(m, params: int, dtype: str = "float32") -> int:
    """The sampler's other buffers the pool leaves room for: the larger of the step's sampler (8
    prompts x 8) and evaluation's (CONFIG's 20 held-out prompts x 8)."""
    return max(sampler_bytes(m, dtype=dtype, param_dtype="float32", params_per_chip=params, prompts=n, prompt_slots=8,
                             sequences=n * 8, slots=n * 8, max_new_tokens=24) for n in (8, 20))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(run_config(tmp_path_factory.mktemp("tfds")))


def test_auto_is_the_formula_over_what_is_left_of_the_chip(prepared):
    config, m, mesh = prepared.config, prepared.model.config, one_device_mesh()
    s = prepared.rollout.sampling
    assert s.kv_cache_bytes == 0 and config.sampling.kv_cache_bytes == "auto"  # CPU: no chip, today's behaviour
    s = dataclasses.replace(s, kv_cache_bytes="auto")
    held = (5 * MIB, MIB)
    other = other_buffers(m, MIB)
    assert other > sampler_bytes(m, dtype="float32", param_dtype="float32", params_per_chip=MIB, prompts=8,
                                 prompt_slots=8, sequences=64, slots=64, max_new_tokens=24)  # evaluation's are larger
    got, sized = resolve_kv_cache(config, m, mesh, s, held=lambda: held, chip=64 * MIB)
    assert got.kv_cache_bytes == sized.pool == int(0.9 * (64 * MIB - 5 * MIB - other)) > 0
    assert sized.held == 5 * MIB and sized.sampler == other and "auto ->" in sized.line()
    # Linear in the chip and in what is held, scaled by the fraction.
    bigger, _ = resolve_kv_cache(config, m, mesh, s, held=lambda: held, chip=74 * MIB)
    assert bigger.kv_cache_bytes - got.kv_cache_bytes == pytest.approx(0.9 * 10 * MIB, abs=1)
    half, _ = resolve_kv_cache(config, m, mesh, dataclasses.replace(s, kv_cache_fraction=0.5), held=lambda: held,
                               chip=64 * MIB)
    assert half.kv_cache_bytes == pool_bytes(chip=64 * MIB, held=5 * MIB, sampler=other, fraction=0.5)
    # bf16 compute over float32 parameters: the sampler holds a bf16 copy of the weights (half their bytes).
    assert sampler_bytes(m, dtype="bfloat16", param_dtype="float32", params_per_chip=MIB, prompts=8, prompt_slots=8,
                         sequences=64, slots=64, max_new_tokens=24) > MIB // 2
    # Explicit bytes stay; an engine without pages takes none; CPU (no chip) keeps 0; the held
    # figure is asked only when a chip is sized.
    assert resolve_kv_cache(config, m, mesh, dataclasses.replace(s, kv_cache_bytes=123), held=None)[0].kv_cache_bytes == 123
    assert resolve_kv_cache(config, m, mesh, dataclasses.replace(s, engine="static"), held=None,
                            chip=64 * MIB)[0].kv_cache_bytes == 0
    assert resolve_kv_cache(config, m, mesh, s, held=None) == (dataclasses.replace(s, kv_cache_bytes=0), None)


def test_slots_follow_what_the_pool_keeps_busy_and_a_chip_too_small_is_refused(prepared):
    config, m, mesh = prepared.config, prepared.model.config, one_device_mesh()
    s = dataclasses.replace(prepared.rollout.sampling, kv_cache_bytes="auto")
    other = other_buffers(m, 0)
    roomy, _ = resolve_kv_cache(config, m, mesh, s, held=lambda: (0, 0), chip=other + 256 * MIB)
    assert roomy.slots == 64  # every sequence
    each = sizing.page_bytes(m.num_layers, m.num_kv_heads, m.head_dim, s.page_size, 4)
    tight, sized = resolve_kv_cache(config, m, mesh, s, held=lambda: (0, 0), chip=other + int(20 * each / 0.9) + 1)
    # 20 pages: the null page, 8 prompts' pages, then sequences of half max_new_tokens (2 pages each).
    assert tight.kv_cache_bytes // each == 20 and tight.slots == sized.slots == (20 - 1 - 8) // 2
    with pytest.raises(ConfigError, match=r"auto leaves .* GiB per chip for the KV cache .* shard the model"):
        resolve_kv_cache(config, m, mesh, s, held=lambda: (0, 0), chip=other + 4 * each)


def test_what_the_run_holds_is_its_train_state_and_reference(prepared):
    """Adam's two moments, the parameters and the KL reference's copy (grpo.beta > 0): four copies
    of the float32 parameters on the one device, plus the step counters."""
    total, params = held_bytes(prepared.config, prepared.model.config, one_device_mesh())
    model = Transformer(prepared.model.config, rngs=nnx.Rngs(0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params == 4 * n and 16 * n <= total <= 16 * n + 64
    apart, weights = held_bytes(prepared.config, prepared.model.config, one_device_mesh(), samples_apart=True)
    assert apart == weights == 4 * n


def test_a_run_sized_from_a_small_chip_preempts_and_samples_the_lockstep_tokens(tmp_path, monkeypatch):
    """prepare() with a faked chip that leaves the pool 20 pages: fewer sequences fit at once than
    the batch has, and the paged loop finishes by preemption with the tokens of the lock-step loop
    (a slot and max-length cache for every sequence)."""
    config = run_config(tmp_path, page_size=4)
    mesh = one_device_mesh()
    base = prepare(config)
    m = base.model.config
    held, params = held_bytes(config, m, mesh)
    other = other_buffers(m, params)
    each = sizing.page_bytes(m.num_layers, m.num_kv_heads, m.head_dim, 4, 4)
    monkeypatch.setattr(sizing, "chip_bytes", lambda mesh: held + other + int(40 * each / 0.9) + 1)
    prepared = prepare(config)
    s = prepared.rollout.sampling
    assert s.kv_cache_bytes // each == 40 and any(n.startswith("sampling.kv_cache_bytes: auto ->")
                                                  for n in prepared.notes)
    model = Transformer(m, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    ids, mask = pad_prompts([list(rng.integers(3, 20, size=n)) for n in (3, 5, 8, 2, 7, 4, 6, 1)], (8,),
                            s.pad_token_id)
    s = dataclasses.replace(s, stop_token_ids=tuple(range(3, 6)), temperature=1.0)
    sized, stats = paged_program(graphdef, s, mesh)(state, ids, mask, jax.random.key(3))
    lockstep, lock_stats = paged_program(graphdef, dataclasses.replace(s, kv_cache_bytes=0, slots=0), mesh)(
        state, ids, mask, jax.random.key(3))
    assert int(stats["preemptions"]) > 0 and int(lock_stats["pool_pages"]) == 0
    for key in ("tokens", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(sized, key)), np.asarray(getattr(lockstep, key)), err_msg=key)
    np.testing.assert_allclose(np.asarray(sized.logprobs), np.asarray(lockstep.logprobs), atol=1e-5)
