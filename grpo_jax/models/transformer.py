"""One Flax NNX decoder-only transformer for every supported family.

Layers are stored stacked (a leading `layers` axis on every per-layer parameter) and run with one
`lax.scan`, so compile time does not grow with depth and per-layer differences (sliding window,
rope base) are data, not code. Every parameter carries logical axis names in its `logical_axes`
metadata; `grpo_jax.sharding` maps them to mesh axes.

Shape suffixes used throughout the models package: B batch, T new tokens, S key slots (cache
capacity, or T in a plain pass), E embed, H query heads, K kv heads, G = H // K, D head_dim,
F mlp, V vocab, L layers, N layer kinds (full / sliding attention).
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.models import rope
from grpo_jax.models.cache import KVCache
from grpo_jax.models.config import TransformerConfig

_NEG = float(np.finfo(np.float32).min)


def layer_param_specs(config: TransformerConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Per-layer parameters present for this config: name -> (shape without L, logical axes)."""
    E, H, K, D, F = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                     config.intermediate_size)
    specs = {
        "attn_norm": ((E,), ("embed",)),
        "q_proj": ((E, H, D), ("embed", "heads", "head_dim")),
        "k_proj": ((E, K, D), ("embed", "kv_heads", "head_dim")),
        "v_proj": ((E, K, D), ("embed", "kv_heads", "head_dim")),
        "o_proj": ((H, D, E), ("heads", "head_dim", "embed")),
        "mlp_norm": ((E,), ("embed",)),
        "gate_proj": ((E, F), ("embed", "mlp")),
        "up_proj": ((E, F), ("embed", "mlp")),
        "down_proj": ((F, E), ("mlp", "embed")),
    }
    if config.qkv_bias:
        specs["q_bias"] = ((H, D), ("heads", "head_dim"))
        specs["k_bias"] = ((K, D), ("kv_heads", "head_dim"))
        specs["v_bias"] = ((K, D), ("kv_heads", "head_dim"))
    if config.o_bias:
        specs["o_bias"] = ((E,), ("embed",))
    if config.mlp_bias:
        specs["gate_bias"] = ((F,), ("mlp",))
        specs["up_bias"] = ((F,), ("mlp",))
        specs["down_bias"] = ((E,), ("embed",))
    if config.qk_norm:
        specs["q_norm"] = ((D,), ("head_dim",))
        specs["k_norm"] = ((D,), ("head_dim",))
    if config.post_norms:
        specs["attn_post_norm"] = ((E,), ("embed",))
        specs["mlp_post_norm"] = ((E,), ("embed",))
    return specs


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


def param_specs(config: TransformerConfig) -> dict[tuple[str, ...], tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every parameter of the model: state path -> (shape, logical axes)."""
    E, V = config.hidden_size, config.vocab_size
    specs = {("embed",): ((V, E), ("vocab", "embed"))}
    for name, (shape, axes) in layer_param_specs(config).items():
        specs[("layers", name)] = ((config.num_layers, *shape), ("layers", *axes))
    specs[("final_norm",)] = ((E,), ("embed",))
    if not config.tie_word_embeddings:
        specs[("lm_head",)] = ((E, V), ("embed", "vocab"))
    return specs


@functools.partial(jax.jit, static_argnums=(0, 2))
def _random_params(config: TransformerConfig, key: jax.Array, param_dtype) -> dict:
    """Initial values of every parameter, in one compiled program.

    Weight matrices are N(0, initializer_range) slices of a single draw: one random program to
    compile instead of one per shape, which on CPU is the difference between 0.5 s and 10 s.
    """
    specs = param_specs(config)
    weights = [k for k in specs if not (_is_norm(k[-1]) or k[-1].endswith("bias"))]
    sizes = [math.prod(specs[k][0]) for k in weights]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32) * config.initializer_range
    out, offset = {}, 0
    for k, n in zip(weights, sizes):
        out[k] = flat[offset:offset + n].reshape(specs[k][0]).astype(param_dtype)
        offset += n
    for k, (shape, _) in specs.items():
        if _is_norm(k[-1]):
            # Gemma stores (scale - 1), so its identity is 0; plain RMSNorm's identity is 1.
            out[k] = jnp.full(shape, 0.0 if config.norm_plus_one else 1.0, param_dtype)
        elif k[-1].endswith("bias"):
            out[k] = jnp.zeros(shape, param_dtype)
    return out


class Layers(nnx.Module):
    """The stacked per-layer parameters; attribute names are those of `layer_param_specs`."""

    def __init__(self, params: dict[str, nnx.Param]):
        for name, param in params.items():
            setattr(self, name, param)

    def arrays(self) -> dict[str, jax.Array]:
        return {name: v[...] for name, v in vars(self).items() if isinstance(v, nnx.Param)}


class Transformer(nnx.Module):
    """Decoder-only LM. `dtype` is the compute dtype, `param_dtype` the storage dtype.

    Logits are always returned in float32 (the lm-head matmul accumulates in float32), since
    GRPO's log-probabilities and ratios need that precision even when compute is bf16.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, remat: bool = False):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.remat = remat
        values = _random_params(config, rngs.params(), self.param_dtype)
        params = {k: nnx.Param(values[k], logical_axes=axes) for k, (_, axes) in param_specs(config).items()}
        self.embed = params[("embed",)]
        self.layers = Layers({k[1]: v for k, v in params.items() if k[0] == "layers"})
        self.final_norm = params[("final_norm",)]
        self.lm_head = params.get(("lm_head",))  # None when tied to the embedding

    # ------------------------------------------------------------------ public API
    def __call__(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None,
                 attention_mask_BT: jax.Array | None = None) -> jax.Array:
        """Plain causal pass -> float32 logits [B, T, V].

        With `attention_mask_BT` (1 = real token) and no positions, positions count real tokens
        only (cumsum of the mask - 1), so a left-padded row gives the logits of the unpadded row.
        """
        return self.logits(self.hidden_states(input_ids_BT, positions_BT, attention_mask_BT))

    def hidden_states(self, input_ids_BT, positions_BT=None, attention_mask_BT=None) -> jax.Array:
        """Final-normed hidden states [B, T, E] in the compute dtype (feed to `logits`)."""
        chex.assert_rank(input_ids_BT, 2)
        B, T = input_ids_BT.shape
        mask_BT = _as_mask(attention_mask_BT, (B, T))
        if positions_BT is None:
            positions_BT = _positions(mask_BT, jnp.zeros((B,), jnp.int32))
        chex.assert_shape(positions_BT, (B, T))
        slots_T = jnp.arange(T)
        h_BTE, _ = self._run(input_ids_BT, positions_BT, q_slots_T=slots_T, kv_slots_S=slots_T,
                             kv_mask_BS=mask_BT, kv_pos_BS=positions_BT, cache=None)
        return h_BTE

    def logits(self, h_BTE: jax.Array) -> jax.Array:
        cfg = self.config
        if cfg.tie_word_embeddings:
            logits = jnp.einsum("bte,ve->btv", h_BTE, self.embed[...].astype(self.dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bte,ev->btv", h_BTE, self.lm_head[...].astype(self.dtype),
                                preferred_element_type=jnp.float32)
        if cfg.final_logit_softcap is not None:
            cap = cfg.final_logit_softcap
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache.init(self.config, batch, capacity, self.dtype)

    def extend(self, input_ids_BT: jax.Array, cache: KVCache,
               attention_mask_BT: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Append T tokens (a prompt chunk, or T=1 when decoding) to `cache` -> (logits [B,T,V], cache).

        Slots [index, index + T) must fit in the cache's capacity: writes past the end are clamped
        by XLA, so callers size the cache statically (prompt bucket + max_new_tokens).
        """
        chex.assert_rank(input_ids_BT, 2)
        B, T = input_ids_BT.shape
        if T > cache.capacity or B != cache.batch:
            raise ValueError(
                f"cannot extend a cache of batch {cache.batch}, capacity {cache.capacity} with input of shape {(B, T)}"
            )
        new_mask_BT = _as_mask(attention_mask_BT, (B, T))
        positions_BT = _positions(new_mask_BT, cache.next_pos_B)
        pos_BS = jax.lax.dynamic_update_slice(cache.pos_BS, positions_BT, (0, cache.index))
        mask_BS = jax.lax.dynamic_update_slice(cache.mask_BS, new_mask_BT, (0, cache.index))
        h_BTE, (k, v) = self._run(input_ids_BT, positions_BT, q_slots_T=cache.index + jnp.arange(T),
                                  kv_slots_S=jnp.arange(cache.capacity), kv_mask_BS=mask_BS,
                                  kv_pos_BS=pos_BS, cache=cache)
        new_cache = KVCache(k_LBSKD=k, v_LBSKD=v, mask_BS=mask_BS, pos_BS=pos_BS,
                            next_pos_B=cache.next_pos_B + new_mask_BT.sum(axis=1, dtype=jnp.int32),
                            index=cache.index + T)
        return self.logits(h_BTE), new_cache

    # ------------------------------------------------------------------ internals
    def _run(self, input_ids_BT, positions_BT, *, q_slots_T, kv_slots_S, kv_mask_BS, kv_pos_BS,
             cache: KVCache | None):
        cfg, dtype = self.config, self.dtype
        x_BTE = self.embed[...].astype(dtype)[input_ids_BT]
        if cfg.scale_embeddings:
            # HF rounds sqrt(E) to the parameter dtype before the multiply.
            x_BTE = x_BTE * jnp.asarray(math.sqrt(cfg.hidden_size), self.param_dtype).astype(dtype)

        # One rope table and one mask per layer kind; the scan picks by the layer's kind index.
        cos_sin = [rope.cos_sin(jnp.asarray(rope.inv_frequencies(cfg.rope_of(k), cfg.head_dim)),
                                positions_BT, dtype) for k in cfg.kinds]
        cos_NBTD = jnp.stack([c for c, _ in cos_sin])
        sin_NBTD = jnp.stack([s for _, s in cos_sin])
        causal_BTS = (kv_slots_S[None, :] <= q_slots_T[:, None])[None] & kv_mask_BS[:, None, :]
        masks = []
        for kind in cfg.kinds:
            window = cfg.window_of(kind)
            m = causal_BTS
            if window is not None:
                m = m & (positions_BT[:, :, None] - kv_pos_BS[:, None, :] < window)
            masks.append(m)
        mask_NBTS = jnp.stack(masks)
        kind_L = jnp.asarray([cfg.kinds.index(t) for t in cfg.layer_types], jnp.int32)

        def body(carry, xs):
            x, k_cache, v_cache = carry
            p, kind, i = xs
            p = {n: a.astype(dtype) for n, a in p.items()}
            q, k, v = _qkv(x, p, cfg, cos_NBTD[kind], sin_NBTD[kind])
            if k_cache is not None:
                k_cache = jax.lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), (i, 0, cache.index, 0, 0))
                v_cache = jax.lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), (i, 0, cache.index, 0, 0))
                k = jax.lax.dynamic_index_in_dim(k_cache, i, keepdims=False).astype(dtype)
                v = jax.lax.dynamic_index_in_dim(v_cache, i, keepdims=False).astype(dtype)
            x = _finish_layer(x, q, k, v, mask_NBTS[kind], p, cfg)
            return (x, k_cache, v_cache), None

        if self.remat:
            body = jax.checkpoint(body, prevent_cse=False)
        init = (x_BTE, None, None) if cache is None else (x_BTE, cache.k_LBSKD, cache.v_LBSKD)
        (x_BTE, k_cache, v_cache), _ = jax.lax.scan(
            body, init, (self.layers.arrays(), kind_L, jnp.arange(cfg.num_layers)))
        h_BTE = _rms_norm(x_BTE, self.final_norm[...], cfg)
        return h_BTE, (k_cache, v_cache)


def _as_mask(attention_mask_BT, shape) -> jax.Array:
    if attention_mask_BT is None:
        return jnp.ones(shape, jnp.bool_)
    chex.assert_shape(attention_mask_BT, shape)
    return attention_mask_BT.astype(jnp.bool_)


def _positions(mask_BT: jax.Array, start_B: jax.Array) -> jax.Array:
    """Rotary positions of new tokens: real tokens count up from the row's next position."""
    counted_BT = jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1
    return start_B[:, None] + jnp.maximum(counted_BT, 0)


def _rms_norm(x: jax.Array, w: jax.Array, cfg: TransformerConfig) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    if cfg.norm_plus_one:
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w.astype(x.dtype) * y.astype(x.dtype)


def _activation(x: jax.Array, name: str) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.gelu(x, approximate=False)


def _qkv(x_BTE, p, cfg: TransformerConfig, cos_BTD, sin_BTD):
    h = _rms_norm(x_BTE, p["attn_norm"], cfg)
    q = jnp.einsum("bte,ehd->bthd", h, p["q_proj"])
    k = jnp.einsum("bte,ekd->btkd", h, p["k_proj"])
    v = jnp.einsum("bte,ekd->btkd", h, p["v_proj"])
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q, k = _rms_norm(q, p["q_norm"], cfg), _rms_norm(k, p["k_norm"], cfg)
    return rope.apply(q, cos_BTD, sin_BTD), rope.apply(k, cos_BTD, sin_BTD), v


def _attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS, cfg: TransformerConfig) -> jax.Array:
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                         preferred_element_type=jnp.float32) * cfg.query_scale
    if cfg.attn_logit_softcap is not None:
        s_BKGTS = jnp.tanh(s_BKGTS / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, _NEG)
    p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1).astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", p_BKGTS, v_BSKD)
    return out_BTKGD.reshape(B, T, H, D)


def _finish_layer(x_BTE, q, k, v, mask_BTS, p, cfg: TransformerConfig):
    a = jnp.einsum("bthd,hde->bte", _attention(q, k, v, mask_BTS, cfg), p["o_proj"])
    if cfg.o_bias:
        a = a + p["o_bias"]
    if cfg.post_norms:
        a = _rms_norm(a, p["attn_post_norm"], cfg)
    x_BTE = x_BTE + a
    h = _rms_norm(x_BTE, p["mlp_norm"], cfg)
    gate = jnp.einsum("bte,ef->btf", h, p["gate_proj"])
    up = jnp.einsum("bte,ef->btf", h, p["up_proj"])
    if cfg.mlp_bias:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    m = jnp.einsum("btf,fe->bte", _activation(gate, cfg.activation) * up, p["down_proj"])
    if cfg.mlp_bias:
        m = m + p["down_bias"]
    if cfg.post_norms:
        m = _rms_norm(m, p["mlp_post_norm"], cfg)
    return x_BTE + m
