"""Parity of the NNX decoder with transformers' PyTorch models, for every supported family."""

from __future__ import annotations

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_models import CASES, build_hf_model, left_padded_batch, torch_logits

from grpo_jax.models import TransformerConfig, config_from_hf, from_pretrained, load_config, save_pretrained

LENGTHS = [12, 7, 3]  # unequal, left-padded; 12 > Gemma's sliding window of 4


def assert_close(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray, rel: float = 1e-4):
    sel = mask.astype(bool)
    scale = max(1.0, float(np.abs(ref[sel]).max()))
    err = float(np.abs(ours[sel] - ref[sel]).max())
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel} * logit scale {scale:.3g}"


@pytest.fixture(scope="module", params=list(CASES))
def hf_case(request, tmp_path_factory):
    """(case name, torch model, directory it was saved to by transformers)."""
    model = build_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, mask):
    return nnx.merge(graphdef, state)(ids, attention_mask=mask)


# The sampler's own entry points: `generate` prefills N prompts once and decodes with `decode_step`.
@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _prefill(graphdef, state, ids, mask, group_size, decode_steps, chunks):
    return nnx.merge(graphdef, state).prefill(ids, mask, group_size=group_size, decode_steps=decode_steps,
                                              chunks=chunks)


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=3)
def _decode(graphdef, state, tokens, cache, chunk):
    model = nnx.merge(graphdef, state)
    return model.decode_step(tokens, cache, chunk=chunk, weights=model.layer_weights())


def forward(model, ids, mask):
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))


def test_fp32_logits_match_transformers(hf_case):
    case, hf_model, path = hf_case
    ids, mask = left_padded_batch(hf_model.config.vocab_size, LENGTHS)
    ours = from_pretrained(path)
    assert_close(forward(ours, ids, mask), torch_logits(hf_model, ids, mask), mask)


def test_left_padding_does_not_change_a_row(hf_case):
    """A left-padded row gives the logits of the same prompt run alone."""
    _, hf_model, path = hf_case
    ids, mask = left_padded_batch(hf_model.config.vocab_size, LENGTHS)
    ours = from_pretrained(path)
    batch = forward(ours, ids, mask)
    n = LENGTHS[-1]
    alone = forward(ours, ids[-1:, -n:], mask[-1:, -n:])
    np.testing.assert_allclose(batch[-1, -n:], alone[0], atol=1e-5, rtol=1e-5)


def test_gemma_sliding_window_is_exercised(tmp_path):
    """The parity case would fail if the window were ignored: it changes the logits."""
    hf_model = build_hf_model("gemma3_text")
    hf_model.save_pretrained(tmp_path)
    ids, mask = left_padded_batch(hf_model.config.vocab_size, LENGTHS)
    ours = from_pretrained(tmp_path)
    windowed = forward(ours, ids, mask)
    ours.config = ours.config.replace(sliding_window=10_000)
    unwindowed = forward(ours, ids, mask)
    assert np.abs(windowed[0, -1] - unwindowed[0, -1]).max() > 1e-2


@pytest.mark.parametrize("group_size", [1, 2])
def test_kv_cache_decode_matches_full_pass(hf_case, group_size):
    """Prefill a left-padded batch once and decode 8 tokens per row through the sampler's cache (3
    chunks; with G = 2 the two rows of a prompt share its prompt block and feed different tokens):
    every step's logits equal the full pass over that row's prompt and tokens."""
    _, hf_model, path = hf_case
    ours = from_pretrained(path)
    V, G, steps = hf_model.config.vocab_size, group_size, 8
    prompt_ids, prompt_mask = left_padded_batch(V, [6, 4, 2], seed=1)
    N, P = prompt_ids.shape
    new = np.random.default_rng(2).integers(3, V, (N * G, steps)).astype(np.int32)
    row_ids, row_mask = np.repeat(prompt_ids, G, axis=0), np.repeat(prompt_mask, G, axis=0)
    full_mask = np.concatenate([row_mask, np.ones_like(new)], axis=1)
    full = forward(ours, np.concatenate([row_ids, new], axis=1), full_mask)

    graphdef, state = nnx.split(ours)
    logits, cache = _prefill(graphdef, state, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), G, steps, 3)
    assert (cache.rows, cache.group_size, cache.num_chunks, cache.chunk_size) == (N * G, G, 3, 3)
    assert cache.prompt_keys[0].shape[0] == N  # one copy of each prompt, whatever G
    assert_close(np.repeat(np.asarray(logits), G, axis=0), full[:, :P], row_mask, rel=1e-5)
    cached = []
    for t in range(steps):
        logits, cache = _decode(graphdef, state, jnp.asarray(new[:, t]), cache, cache.chunk_of(t))
        cached.append(np.asarray(logits))
    cached = np.stack(cached, axis=1)
    assert cached.shape == (N * G, steps, V)
    assert_close(cached, full[:, P:], np.ones_like(new), rel=1e-5)
    assert int(cache.length) == steps
    np.testing.assert_array_equal(np.asarray(cache.next_pos), full_mask.sum(1))
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, :P + steps], full_mask)


def test_bf16_compute_tracks_fp32(hf_case):
    """bf16 compute (bf16 or fp32 storage) stays close to the fp32 reference."""
    case, hf_model, path = hf_case
    ids, mask = left_padded_batch(hf_model.config.vocab_size, LENGTHS)
    ref = torch_logits(hf_model, ids, mask)
    for param_dtype in (jnp.bfloat16, jnp.float32):
        model = from_pretrained(path, dtype=jnp.bfloat16, param_dtype=param_dtype)
        assert model.embed[...].dtype == param_dtype
        out = forward(model, ids, mask)
        assert out.dtype == np.float32
        assert_close(out, ref, mask, rel=0.1)


def test_save_pretrained_roundtrip_through_transformers(hf_case, tmp_path):
    case, hf_model, path = hf_case
    ours = from_pretrained(path)
    save_pretrained(ours, tmp_path / "single")
    # A tiny shard limit forces the sharded layout with an index file.
    save_pretrained(ours, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1

    ids, mask = left_padded_batch(hf_model.config.vocab_size, LENGTHS)
    ref = torch_logits(hf_model, ids, mask)
    ref_state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    for sub in ("single", "sharded"):
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / sub, attn_implementation="eager", dtype=torch.float32).eval()
        assert type(reloaded) is type(hf_model)
        for k, v in reloaded.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), ref_state[k], err_msg=k)
        np.testing.assert_array_equal(torch_logits(reloaded, ids, mask), ref)
        assert load_config(tmp_path / sub) == ours.config
        assert_close(forward(from_pretrained(tmp_path / sub), ids, mask), ref, mask)


def _to_transformers4_layout(d: dict) -> dict:
    """Rewrite a transformers-5 config.json into the layout of transformers 4 (published checkpoints)."""
    d = copy.deepcopy(d)
    rope = d.pop("rope_parameters")
    if d["model_type"] == "gemma3_text":
        full, local = rope["full_attention"], rope["sliding_attention"]
        d["rope_theta"] = full.pop("rope_theta")
        d["rope_local_base_freq"] = local.pop("rope_theta")
        d["rope_scaling"] = None if full.get("rope_type", "default") == "default" else full
    else:
        d["rope_theta"] = rope.pop("rope_theta")
        d["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if d["model_type"] == "qwen3_moe":  # transformers 5 writes it under its alias num_local_experts
        d["num_experts"] = d.pop("num_local_experts")
    return d


def test_transformers4_and_5_config_layouts_give_the_same_model(hf_case):
    case, _, path = hf_case
    v5 = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in v5 and "rope_theta" not in v5
    v4 = _to_transformers4_layout(v5)
    assert config_from_hf(v4) == config_from_hf(v5)


def test_gemma_sliding_window_pattern_of_transformers4():
    """Old Gemma 3 configs give `sliding_window_pattern` instead of `layer_types`."""
    d = dict(model_type="gemma3_text", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=12,
             num_attention_heads=1, num_key_value_heads=1, head_dim=8, sliding_window=512,
             sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4)
    cfg = config_from_hf(d)
    expected = transformers.Gemma3TextConfig(**d).layer_types
    assert list(cfg.layer_types) == expected
    assert cfg.rope_of("sliding_attention").theta == 1e4
    assert cfg.rope_of("full_attention").theta == 1e6


def test_every_parameter_has_logical_axes(hf_case):
    _, _, path = hf_case
    allowed = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "router", "experts", "expert_mlp"}
    model = from_pretrained(path)
    params = nnx.state(model, nnx.Param)
    for key, var in nnx.to_flat_state(params):
        axes = var.get_metadata()["logical_axes"]
        assert len(axes) == var.ndim, key
        assert set(axes) <= allowed, key
        assert (axes[0] == "layers") == (key[0] == "layers"), key


def test_random_init_model_is_usable_and_config_validates():
    cfg = TransformerConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4)
    from grpo_jax.models import Transformer

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits = model(jnp.ones((2, 5), jnp.int32))
    assert logits.shape == (2, 5, 32) and bool(jnp.isfinite(logits).all())
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cfg.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        cfg.replace(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="activation"):
        cfg.replace(activation="relu")


@pytest.mark.parametrize("theta", [10_000.0, 100_000.0, 500_000.0, 1_000_000.0])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotary_frequencies_are_pytorchs_to_the_bit(theta, head_dim):
    """transformers' default rope frequencies (float32 pow in PyTorch); NumPy's float32 pow was 1 ulp off
    in up to 26 of 128, a 3e-3 logit difference by position 800 in Gemma 3 270M."""
    from grpo_jax.models.config import RopeConfig
    from grpo_jax.models.rope import inv_frequencies

    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    want = (1.0 / (theta**exponent)).numpy()
    got = inv_frequencies(RopeConfig(theta=theta), head_dim)
    assert got.dtype == np.float32
    ulps = np.abs(got.view(np.int32) - want.view(np.int32))
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 1, f"{(ulps > 0).sum()} entries differ"
