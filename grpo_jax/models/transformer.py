"""One Flax NNX decoder-only transformer for every supported family.

Layers are stored stacked (a leading `layers` axis on every per-layer parameter) and run with one
`lax.scan`, so compile time does not grow with depth and per-layer differences (sliding window,
rope base) are data, not code. Every parameter carries logical axis names in its `logical_axes`
metadata; `grpo_jax.sharding` maps them to mesh axes.

Shape suffixes used throughout the models package: B batch, T new tokens, S key slots (cache
capacity, or T in a plain pass), E embed, H query heads, K kv heads, G = H // K, D head_dim,
F mlp, V vocab, L layers, Y layer kinds (full / sliding attention), N rows and positions folded
into one axis (B*T) for the projections, M = G*T query rows per kv head in attention.
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
# Attention with at most this many query rows per (row, kv head) counts as decoding (see _attention).
_DECODE_ROWS = 8


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
        h_BTE, _ = self._run(input_ids_BT, positions_BT, mask_BT, old=None, collect_kv=False)
        return h_BTE

    def logits(self, h_BTE: jax.Array) -> jax.Array:
        cfg = self.config
        B, T, E = h_BTE.shape
        # Rows and positions are folded into one axis: XLA:CPU lowers a singleton T (decoding) to slow dots.
        h_NE = h_BTE.reshape(B * T, E)
        if cfg.tie_word_embeddings:
            logits_NV = jnp.einsum("ne,ve->nv", h_NE, self.embed[...].astype(self.dtype),
                                   preferred_element_type=jnp.float32)
        else:
            logits_NV = jnp.einsum("ne,ev->nv", h_NE, self.lm_head[...].astype(self.dtype),
                                   preferred_element_type=jnp.float32)
        if cfg.final_logit_softcap is not None:
            cap = cfg.final_logit_softcap
            logits_NV = jnp.tanh(logits_NV / cap) * cap
        return logits_NV.reshape(B, T, -1)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache.init(self.config, batch, capacity, self.dtype)

    def prefill(self, input_ids_BT: jax.Array, attention_mask_BT: jax.Array | None = None, *, capacity: int,
                repeats: int = 1, last_only: bool = False) -> tuple[jax.Array, KVCache]:
        """Run a (left-padded) prompt batch and return (logits, a cache of `capacity` slots holding it).

        With `repeats` = G the cache has B*G rows, row b*G + g holding prompt b: the prompt is run
        once and its keys/values are copied to its G rows. `last_only` returns logits [B, 1, V] of
        the last position instead of [B, T, V] (the sampler needs no more).
        """
        chex.assert_rank(input_ids_BT, 2)
        B, T = input_ids_BT.shape
        if T > capacity:
            raise ValueError(f"a prompt of {T} tokens does not fit a cache of capacity {capacity}")
        mask_BT = _as_mask(attention_mask_BT, (B, T))
        positions_BT = _positions(mask_BT, jnp.zeros((B,), jnp.int32))
        h_BTE, (k_LBKTD, v_LBKTD) = self._run(input_ids_BT, positions_BT, mask_BT, old=None, collect_kv=True)
        if last_only:
            h_BTE = h_BTE[:, -1:]
        cache = KVCache.init(self.config, B * repeats, capacity, self.dtype)

        def fill(buf, x, batch_axis, slot_axis):
            x = jnp.repeat(x, repeats, axis=batch_axis) if repeats > 1 else x
            return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), 0, axis=slot_axis)

        cache = KVCache(k_LBKSD=fill(cache.k_LBKSD, k_LBKTD, 1, 3), v_LBKSD=fill(cache.v_LBKSD, v_LBKTD, 1, 3),
                        mask_BS=fill(cache.mask_BS, mask_BT, 0, 1), pos_BS=fill(cache.pos_BS, positions_BT, 0, 1),
                        next_pos_B=jnp.repeat(mask_BT.sum(axis=1, dtype=jnp.int32), repeats),
                        index=jnp.asarray(T, jnp.int32))
        return self.logits(h_BTE), cache

    def extend(self, input_ids_BT: jax.Array, cache: KVCache, attention_mask_BT: jax.Array | None = None, *,
               attend_buckets: tuple[int, ...] | None = None) -> tuple[jax.Array, KVCache]:
        """Append T tokens (a prompt chunk, or T=1 when decoding) to `cache` -> (logits [B,T,V], cache).

        `attend_buckets` (increasing slot counts, the last >= capacity) bounds attention to the
        cache's filled part: the new tokens attend over the first b slots, b the smallest bucket
        holding every filled slot, chosen at run time by `lax.switch` (one compiled attention per
        bucket, the rest of the layer compiled once). Without it attention covers all slots.

        Slots [index, index + T) must fit in the cache's capacity: writes past the end are clamped
        by XLA, so callers size the cache statically (prompt bucket + max_new_tokens). The cache is
        only read inside the layer scan and written once after it, so under a jitted loop with the
        cache as loop state XLA updates it in place.
        """
        chex.assert_rank(input_ids_BT, 2)
        B, T = input_ids_BT.shape
        if T > cache.capacity or B != cache.batch:
            raise ValueError(
                f"cannot extend a cache of batch {cache.batch}, capacity {cache.capacity} with input of shape {(B, T)}"
            )
        new_mask_BT = _as_mask(attention_mask_BT, (B, T))
        positions_BT = _positions(new_mask_BT, cache.next_pos_B)
        if attend_buckets is not None:
            attend_buckets = tuple(sorted(min(int(b), cache.capacity) for b in attend_buckets))
            if attend_buckets[-1] != cache.capacity:
                raise ValueError(f"attend_buckets {attend_buckets} must end at the cache capacity {cache.capacity}")
        h_BTE, (k_LBKTD, v_LBKTD) = self._run(input_ids_BT, positions_BT, new_mask_BT, old=cache, collect_kv=True,
                                              attend_buckets=attend_buckets)
        at = (0, 0, 0, cache.index, 0)
        new_cache = KVCache(
            k_LBKSD=jax.lax.dynamic_update_slice(cache.k_LBKSD, k_LBKTD.astype(cache.k_LBKSD.dtype), at),
            v_LBKSD=jax.lax.dynamic_update_slice(cache.v_LBKSD, v_LBKTD.astype(cache.v_LBKSD.dtype), at),
            mask_BS=jax.lax.dynamic_update_slice(cache.mask_BS, new_mask_BT, (0, cache.index)),
            pos_BS=jax.lax.dynamic_update_slice(cache.pos_BS, positions_BT, (0, cache.index)),
            next_pos_B=cache.next_pos_B + new_mask_BT.sum(axis=1, dtype=jnp.int32),
            index=cache.index + T)
        return self.logits(h_BTE), new_cache

    def decode_step(self, tok_B: jax.Array, keys, values, mask_BS: jax.Array, pos_BS: jax.Array,
                    next_pos_B: jax.Array, *, chunk: int, at: jax.Array, weights=None):
        """One decoding step over a chunked per-layer cache -> (logits [B, V], keys, values).

        `keys[l]` / `values[l]` are lists of chunks of layer l's cache: keys [B, K, D, S_c] (slots
        minor, so a single query's scores are one batched matmul with no transpose), values
        [B, K, S_c, D]. The new token's key/value is written at slot `at` of chunk `chunk` (static),
        then the token attends over chunks 0..chunk, i.e. the first sum(S_c) slots of `mask_BS` /
        `pos_BS`, which must already mark the new slot. Chunks are separate buffers, so under a
        jitted loop each write is in place and no step copies or slices the cache (a slice of one
        stacked cache is copied by XLA:CPU before every read). `weights`: per-layer parameter dicts
        (`layer_weights()`), sliced once outside the decode loop instead of once per step.
        """
        cfg, dtype = self.config, self.dtype
        B = tok_B.shape[0]
        weights = self.layer_weights() if weights is None else weights
        x = self._embed(tok_B[:, None])
        pos_B1 = next_pos_B[:, None]
        tables = {k: rope.cos_sin(jnp.asarray(rope.inv_frequencies(cfg.rope_of(k), cfg.head_dim)), pos_B1, dtype)
                  for k in cfg.kinds}
        n = sum(c.shape[2] for c in values[0][:chunk + 1])
        masks = {}
        for kind in cfg.kinds:
            m = mask_BS[:, :n]
            window = cfg.window_of(kind)
            if window is not None:
                m = m & (pos_B1 - pos_BS[:, :n] < window)
            masks[kind] = m
        keys, values = [list(k) for k in keys], [list(v) for v in values]
        for l, kind in enumerate(cfg.layer_types):
            p = weights[l]
            q, k, v = _qkv(x, p, cfg, *tables[kind])  # [B, 1, H, D], [B, 1, K, D]
            K, D = k.shape[2], k.shape[3]
            G = q.shape[2] // K
            kc, vc = keys[l], values[l]
            kc[chunk] = jax.lax.dynamic_update_slice(kc[chunk], k.reshape(B, K, D, 1).astype(kc[chunk].dtype),
                                                     (0, 0, 0, at))
            vc[chunk] = jax.lax.dynamic_update_slice(vc[chunk], v.reshape(B, K, 1, D).astype(vc[chunk].dtype),
                                                     (0, 0, at, 0))
            o_BKGD = _decode_attention(q.reshape(B, K, G, D), kc[:chunk + 1], vc[:chunk + 1], masks[kind], cfg, dtype)
            x = _finish_layer(x, o_BKGD.reshape(B, 1, K * G, D), p, cfg)
        return self.logits(_rms_norm(x, self.final_norm[...], cfg))[:, 0], keys, values

    def layer_weights(self) -> list[dict[str, jax.Array]]:
        """Per-layer parameter dicts in the compute dtype (for `decode_step`)."""
        arrays = self.layers.arrays()
        return [{n: a[l].astype(self.dtype) for n, a in arrays.items()} for l in range(self.config.num_layers)]

    def _embed(self, input_ids_BT):
        cfg, dtype = self.config, self.dtype
        x_BTE = self.embed[...].astype(dtype)[input_ids_BT]
        if cfg.scale_embeddings:
            # HF rounds sqrt(E) to the parameter dtype before the multiply.
            x_BTE = x_BTE * jnp.asarray(math.sqrt(cfg.hidden_size), self.param_dtype).astype(dtype)
        return x_BTE

    # ------------------------------------------------------------------ internals
    def _run(self, input_ids_BT, positions_BT, new_mask_BT, *, old: KVCache | None, collect_kv: bool,
             attend_buckets: tuple[int, ...] | None = None):
        """Embed, run the layers, final norm -> (h [B,T,E], (k, v) [L,B,K,T,D] of the new tokens or None).

        Attention of the new tokens covers two key blocks: the new tokens themselves (causal) and,
        with `old`, the cache's filled slots. The cache is never copied or written here.
        """
        cfg, dtype = self.config, self.dtype
        B, T = input_ids_BT.shape
        x_BTE = self._embed(input_ids_BT)

        # One rope table and one pair of masks per layer kind; the scan picks by the layer's kind index.
        cos_sin = [rope.cos_sin(jnp.asarray(rope.inv_frequencies(cfg.rope_of(k), cfg.head_dim)),
                                positions_BT, dtype) for k in cfg.kinds]
        cos_YBTD = jnp.stack([c for c, _ in cos_sin])
        sin_YBTD = jnp.stack([s for _, s in cos_sin])
        causal_TT = jnp.tril(jnp.ones((T, T), jnp.bool_))
        new_BTT = causal_TT[None] & new_mask_BT[:, None, :]
        new_masks, old_masks = [], []
        for kind in cfg.kinds:
            window = cfg.window_of(kind)
            m_new = new_BTT
            m_old = None if old is None else jnp.broadcast_to(old.mask_BS[:, None, :], (B, T, old.capacity))
            if window is not None:
                m_new = m_new & (positions_BT[:, :, None] - positions_BT[:, None, :] < window)
                if old is not None:
                    m_old = m_old & (positions_BT[:, :, None] - old.pos_BS[:, None, :] < window)
            new_masks.append(m_new)
            old_masks.append(m_old)
        new_YBTT = jnp.stack(new_masks)
        old_YBTS = None if old is None else jnp.stack(old_masks)
        kind_L = jnp.asarray([cfg.kinds.index(t) for t in cfg.layer_types], jnp.int32)
        if old is not None and attend_buckets is not None:
            # Slots [0, old.index) are filled: the smallest bucket that holds them all.
            bucket = jnp.minimum(jnp.sum(jnp.asarray(attend_buckets) < old.index), len(attend_buckets) - 1)

        def attend(q, k, v, kind, old_k, old_v):
            new_block = (k, v, new_YBTT[kind])
            if old is None:
                return _attention(q, [new_block], cfg)

            def upto(n, q, old_k, old_v, old_mask):
                return _attention(q, [new_block, (old_k[:, :, :n].astype(dtype), old_v[:, :, :n].astype(dtype),
                                                  old_mask[..., :n])], cfg)

            if attend_buckets is None:
                return upto(old.capacity, q, old_k, old_v, old_YBTS[kind])
            branches = [functools.partial(upto, n) for n in attend_buckets]
            return jax.lax.switch(bucket, branches, q, old_k, old_v, old_YBTS[kind])

        def body(x, xs):
            p, kind, old_k, old_v = xs
            p = {n: a.astype(dtype) for n, a in p.items()}
            q, k, v = _qkv(x, p, cfg, cos_YBTD[kind], sin_YBTD[kind])
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
            x = _finish_layer(x, attend(q, k, v, kind, old_k, old_v), p, cfg)
            return x, ((k, v) if collect_kv else None)

        if self.remat:
            body = jax.checkpoint(body, prevent_cse=False)
        old_kv = (None, None) if old is None else (old.k_LBKSD, old.v_LBKSD)
        x_BTE, kv = jax.lax.scan(body, x_BTE, (self.layers.arrays(), kind_L, *old_kv))
        return _rms_norm(x_BTE, self.final_norm[...], cfg), kv


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
    B, T, E = x_BTE.shape
    h_NE = _rms_norm(x_BTE, p["attn_norm"], cfg).reshape(B * T, E)
    q = jnp.einsum("ne,ehd->nhd", h_NE, p["q_proj"])
    k = jnp.einsum("ne,ekd->nkd", h_NE, p["k_proj"])
    v = jnp.einsum("ne,ekd->nkd", h_NE, p["v_proj"])
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q, k = _rms_norm(q, p["q_norm"], cfg), _rms_norm(k, p["k_norm"], cfg)
    q, k, v = (a.reshape(B, T, *a.shape[1:]) for a in (q, k, v))
    return rope.apply(q, cos_BTD, sin_BTD), rope.apply(k, cos_BTD, sin_BTD), v


def _attention(q_BTHD, blocks, cfg: TransformerConfig) -> jax.Array:
    """Softmax attention of q over the concatenation of key blocks [(k_BKSD, v_BKSD, mask_BTS), ...].

    The G query heads of a kv head and the T query positions are folded into one axis M, so every
    contraction is a plain batched matmul over (row, kv head); a singleton T (decoding) would
    otherwise lower to many tiny dots on CPU.
    """
    B, T, H, D = q_BTHD.shape
    K = blocks[0][0].shape[1]
    G = H // K
    q_BKMD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, D)
    scores = []
    for k_BKSD, _, mask_BTS in blocks:
        if G * T <= _DECODE_ROWS:
            # Decoding: a multiply-reduce that XLA fuses with the read of this layer's cache slice;
            # as a dot, the slice is first copied out of the stacked cache (15-25% of a CPU step).
            s_BKMS = jnp.sum(q_BKMD[:, :, :, None, :].astype(jnp.float32) * k_BKSD[:, :, None, :, :], axis=-1)
        else:
            s_BKMS = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKSD, preferred_element_type=jnp.float32)
        s_BKMS = s_BKMS * cfg.query_scale
        if cfg.attn_logit_softcap is not None:
            s_BKMS = jnp.tanh(s_BKMS / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
        s_BKGTS = s_BKMS.reshape(B, K, G, T, -1)
        scores.append(jnp.where(mask_BTS[:, None, None], s_BKGTS, _NEG))
    p_BKGTS = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out_BKMD, start = 0, 0
    for k_BKSD, v_BKSD, _ in blocks:
        S = k_BKSD.shape[2]
        p_BKMS = p_BKGTS[..., start:start + S].reshape(B, K, G * T, S).astype(v_BKSD.dtype)
        out_BKMD = out_BKMD + jnp.einsum("bkms,bksd->bkmd", p_BKMS, v_BKSD)
        start += S
    return out_BKMD.reshape(B, K, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _decode_attention(q_BKGD, k_chunks, v_chunks, mask_BS, cfg: TransformerConfig, dtype) -> jax.Array:
    """One query per row over a chunked cache (keys [B', K, D, S_c], values [B', K, S_c, D]) -> [B, K, G, D].

    A chunk may hold B' = B / r rows: the prompt chunk of a group sampler, shared by the r = G
    consecutive rows of each group. Its keys and values are then read once per group instead of
    being copied to every row (the prefill writes N rows whatever G is).
    """
    B = q_BKGD.shape[0]

    def scores(k):
        r = B // k.shape[0]
        if r == 1:
            return jnp.einsum("bkgd,bkds->bkgs", q_BKGD, k.astype(dtype), preferred_element_type=jnp.float32)
        q = q_BKGD.reshape(k.shape[0], r, *q_BKGD.shape[1:])
        s = jnp.einsum("nrkgd,nkds->nrkgs", q, k.astype(dtype), preferred_element_type=jnp.float32)
        return s.reshape(B, *s.shape[2:])

    def weighted(p_BKGS, v):
        r = B // v.shape[0]
        if r == 1:
            return jnp.einsum("bkgs,bksd->bkgd", p_BKGS, v.astype(dtype))
        p = p_BKGS.reshape(v.shape[0], r, *p_BKGS.shape[1:])
        return jnp.einsum("nrkgs,nksd->nrkgd", p, v.astype(dtype)).reshape(B, *p_BKGS.shape[1:3], v.shape[-1])

    s_BKGS = jnp.concatenate([scores(k) for k in k_chunks], axis=-1) * cfg.query_scale
    if cfg.attn_logit_softcap is not None:
        s_BKGS = jnp.tanh(s_BKGS / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    p_BKGS = jax.nn.softmax(jnp.where(mask_BS[:, None, None, :], s_BKGS, _NEG), axis=-1)
    out, start = 0, 0
    for v in v_chunks:
        S = v.shape[2]
        out = out + weighted(p_BKGS[..., start:start + S].astype(dtype), v)
        start += S
    return out


def _finish_layer(x_BTE, attn_BTHD, p, cfg: TransformerConfig):
    B, T, E = x_BTE.shape
    attn_NHD = attn_BTHD.reshape(B * T, *attn_BTHD.shape[2:])
    a = jnp.einsum("nhd,hde->ne", attn_NHD, p["o_proj"])
    if cfg.o_bias:
        a = a + p["o_bias"]
    if cfg.post_norms:
        a = _rms_norm(a, p["attn_post_norm"], cfg)
    x_NE = x_BTE.reshape(B * T, E) + a
    h = _rms_norm(x_NE, p["mlp_norm"], cfg)
    gate = jnp.einsum("ne,ef->nf", h, p["gate_proj"])
    up = jnp.einsum("ne,ef->nf", h, p["up_proj"])
    if cfg.mlp_bias:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    m = jnp.einsum("nf,fe->ne", _activation(gate, cfg.activation) * up, p["down_proj"])
    if cfg.mlp_bias:
        m = m + p["down_bias"]
    if cfg.post_norms:
        m = _rms_norm(m, p["mlp_post_norm"], cfg)
    return (x_NE + m).reshape(B, T, E)
