"""One Flax NNX decoder-only transformer for every supported family.

Layers are stored stacked (a leading `layers` axis on every per-layer parameter). The plain pass and
`prefill` run them with one `lax.scan` (`scan_layers=True`, the default), so their compile time does
not grow with depth and per-layer differences (sliding window, rope base) are data, not code; with
`scan_layers=False` they are unrolled (`run_layers`): compile time grows with depth, but the scan's
per-layer weight slices and stacked residuals go away, which made the GRPO update 5-14% faster on
CPU for the 4-layer benchmark model (benchmarks/RESULTS.md, "What the update spends"). `decode_step` unrolls the layers over
per-layer weights and cache buffers instead: on CPU the scan's per-layer dynamic slices are copied
before every matmul, which made a decode step 11-16% slower (benchmarks/RESULTS.md, "Decode over
layers"); its compile time grows with depth. Inference is `prefill` + `decode_step` over the one
cache type, `cache.KVCache`. Every parameter carries logical axis names in its `logical_axes`
metadata; `grpo_jax.runtime.sharding` maps them to mesh axes.

Shape suffixes used throughout the models package: B batch, T new tokens, S key slots (cache
slots, or T in a plain pass), E embed, H query heads, K kv heads, G = H // K, D head_dim,
F mlp, V vocab, L layers, Y layer kinds (full / sliding attention), N rows and positions folded
into one axis (B*T) for the projections, M = G*T query rows per kv head in attention; when
decoding, R rows (a prompt's G samples are consecutive rows), P prompt slots, C chunk slots.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.models import lora, rope
from grpo_jax.models.cache import KVCache, write_slot
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
    """The stacked per-layer parameters; attribute names are those of `layer_param_specs`, plus
    LoRA adapters `<proj>_lora_a` / `<proj>_lora_b` when `models.lora.add_adapters` added them."""

    lora_scale: float | None = None  # alpha / rank, with adapters
    lora_dropout: float = 0.0  # the adapters' input dropout rate in a pass given a dropout key

    def __init__(self, params: dict[str, nnx.Param]):
        for name, param in params.items():
            setattr(self, name, param)

    def arrays(self, dropout_key: jax.Array | None = None) -> dict[str, jax.Array]:
        """Every stacked parameter by name; adapters' B comes scaled by alpha / rank. With adapter
        dropout and a `dropout_key`, also one key per layer (`lora_dropout_key`, raw uint32 words)
        and the keep probability (`lora_keep`), which the layers' adapter paths read."""
        out = {name: v[...] for name, v in vars(self).items() if isinstance(v, nnx.Param)}
        if self.lora_scale is not None:
            out.update({k: v * self.lora_scale for k, v in out.items() if k.endswith("_lora_b")})
            if dropout_key is not None and self.lora_dropout > 0:
                L = next(iter(out.values())).shape[0]
                out["lora_dropout_key"] = jax.random.key_data(jax.random.split(dropout_key, L))
                out["lora_keep"] = jnp.full((L,), 1.0 - self.lora_dropout, jnp.float32)
        return out


class Transformer(nnx.Module):
    """Decoder-only LM. `dtype` is the compute dtype, `param_dtype` the storage dtype.

    Logits are always returned in float32 (the lm-head matmul accumulates in float32), since
    GRPO's log-probabilities and ratios need that precision even when compute is bf16.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, remat: bool = False, scan_layers: bool = True):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.remat = remat
        self.scan_layers = scan_layers
        values = _random_params(config, rngs.params(), self.param_dtype)
        params = {k: nnx.Param(values[k], logical_axes=axes) for k, (_, axes) in param_specs(config).items()}
        self.embed = params[("embed",)]
        self.layers = Layers({k[1]: v for k, v in params.items() if k[0] == "layers"})
        self.final_norm = params[("final_norm",)]
        self.lm_head = params.get(("lm_head",))  # None when tied to the embedding

    # ------------------------------------------------------------------ public API
    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        """Plain causal pass over input_ids int [B, T] -> float32 logits [B, T, V].

        attention_mask [B, T] (1 = real token; default all real); positions int [B, T] (default:
        real tokens count up from 0 and padding repeats its neighbour's position, so a left-padded
        row gives the logits of the unpadded row).
        """
        return self.logits(self.hidden_states(input_ids, positions, attention_mask))

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                      attention_mask: jax.Array | None = None, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states [B, T, E] in the compute dtype (feed to `logits`); arguments as
        `__call__`. `dropout_key`: apply the LoRA adapters' input dropout (the training pass)."""
        chex.assert_rank(input_ids, 2)
        B, T = input_ids.shape
        mask_BT = _as_mask(attention_mask, (B, T))
        if positions is None:
            positions = _positions(mask_BT)
        chex.assert_shape(positions, (B, T))
        h_BTE, _ = self._run(input_ids, positions, mask_BT, collect_kv=False, dropout_key=dropout_key)
        return h_BTE

    def logits(self, h_BTE: jax.Array) -> jax.Array:
        """float32 logits [B, T, V] of hidden states [B, T, E]."""
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

    def prefill(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *, decode_steps: int,
                group_size: int = 1, chunks: int = 1, last_only: bool = False) -> tuple[jax.Array, KVCache]:
        """Run N (left-padded) prompts, input_ids int [N, P] and attention_mask [N, P], once ->
        (float32 logits [N, P, V], or [N, 1, V] of the last position with `last_only`; a `KVCache`).

        The cache holds the prompts' keys/values once per prompt, has N * `group_size` rows (row
        i*G + j decodes from prompt i) and room for `decode_steps` decode steps in `chunks` chunks.
        """
        chex.assert_rank(input_ids, 2)
        mask_BT = _as_mask(attention_mask, input_ids.shape)
        positions_BT = _positions(mask_BT)
        h_BTE, (k_LBKTD, v_LBKTD) = self._run(input_ids, positions_BT, mask_BT, collect_kv=True)
        if last_only:
            h_BTE = h_BTE[:, -1:]
        cache = KVCache.from_prefill(k_LBKTD, v_LBKTD, mask_BT, positions_BT, group_size=group_size,
                                     decode_steps=decode_steps, chunks=chunks)
        return self.logits(h_BTE), cache

    def decode_step(self, input_ids: jax.Array, cache: KVCache, *, chunk: int | None = None,
                    weights: list[dict[str, jax.Array]] | None = None) -> tuple[jax.Array, KVCache]:
        """Feed one token per row, input_ids int [R] -> (float32 logits [R, V] of the next token, cache).

        The token goes to the cache's next decode slot, which must lie in chunk `chunk`; the step
        attends the prompt block and chunks 0..chunk only. `chunk` is static (it fixes the attended
        shapes), so a jitted caller passes it (`cache.chunk_of(step)`); None reads it from a
        concrete `cache.length`. `weights`: `layer_weights()`, hoisted out of a decode loop so the
        per-layer slicing and the cast to the compute dtype are not repeated every step.

        Layers are unrolled here, not scanned (see the module docstring for why).
        """
        cfg, dtype = self.config, self.dtype
        chex.assert_shape(input_ids, (cache.rows,))
        if chunk is None:
            if isinstance(cache.length, jax.core.Tracer):
                raise ValueError("decode_step under jit needs a static chunk: pass chunk=cache.chunk_of(step)")
            chunk = cache.chunk_of(int(cache.length))
        weights = self.layer_weights() if weights is None else weights
        cache = cache.open_slot()
        R, K, D = cache.rows, cfg.num_kv_heads, cfg.head_dim
        pos_R1 = cache.next_pos[:, None]
        cos_YR1D, sin_YR1D = _rope_tables(cfg, pos_R1, dtype)
        n = cache.prompt_len + (chunk + 1) * cache.chunk_size  # slots attended
        masks = {}
        for kind in cfg.kinds:
            window = cfg.window_of(kind)
            in_window = True if window is None else pos_R1 - cache.pos[:, :n] < window
            masks[kind] = cache.mask[:, :n] & in_window
        at = cache.slot_in_chunk(chunk)
        x_R1E = self._embed(input_ids[:, None])
        keys, values = [], []
        for l, kind in enumerate(cfg.layer_types):
            y = cfg.kinds.index(kind)
            q, k, v = _qkv(x_R1E, weights[l], cfg, cos_YR1D[y], sin_YR1D[y])  # [R, 1, H, D], [R, 1, K, D]
            k_RKDC, v_RKCD = write_slot(cache.keys[chunk][l], cache.values[chunk][l], at, k[:, 0], v[:, 0])
            keys.append(k_RKDC)
            values.append(v_RKCD)
            earlier = range(chunk)
            o_RKGD = _decode_attention(
                q.reshape(R, K, -1, D), [cache.prompt_keys[l], *(cache.keys[c][l] for c in earlier), k_RKDC],
                [cache.prompt_values[l], *(cache.values[c][l] for c in earlier), v_RKCD], masks[kind], cfg, dtype)
            x_R1E = _finish_layer(x_R1E, o_RKGD.reshape(R, 1, -1, D), weights[l], cfg)
        logits_RV = self.logits(_rms_norm(x_R1E, self.final_norm[...], cfg))[:, 0]
        return logits_RV, cache.close_slot(chunk, tuple(keys), tuple(values))

    def layer_weights(self) -> list[dict[str, jax.Array]]:
        """Per-layer parameter dicts in the compute dtype (for `decode_step`): L separate buffers each."""
        arrays = self.layers.arrays()
        # Adapters are folded into their weights once here, outside the decode loop.
        return [{n: a.astype(self.dtype) for n, a in lora.merged({n: a[l] for n, a in arrays.items()}).items()}
                for l in range(self.config.num_layers)]

    def _embed(self, input_ids_BT):
        cfg, dtype = self.config, self.dtype
        x_BTE = self.embed[...].astype(dtype)[input_ids_BT]
        if cfg.scale_embeddings:
            # HF rounds sqrt(E) to the parameter dtype before the multiply.
            x_BTE = x_BTE * jnp.asarray(math.sqrt(cfg.hidden_size), self.param_dtype).astype(dtype)
        return x_BTE

    # ------------------------------------------------------------------ internals
    def _run(self, input_ids_BT, positions_BT, mask_BT, *, collect_kv: bool, dropout_key=None):
        """Embed, run the layers (one scan), final norm -> (h [B,T,E], (k, v) [L,B,K,T,D] or None)."""
        cfg, dtype = self.config, self.dtype
        T = input_ids_BT.shape[1]
        cos_YBTD, sin_YBTD = _rope_tables(cfg, positions_BT, dtype)
        # One causal mask per layer kind; the scan picks by the layer's kind index.
        causal_BTT = jnp.tril(jnp.ones((T, T), jnp.bool_))[None] & mask_BT[:, None, :]
        masks = []
        for kind in cfg.kinds:
            window = cfg.window_of(kind)
            in_window = True if window is None else positions_BT[:, :, None] - positions_BT[:, None, :] < window
            masks.append(causal_BTT & in_window)
        mask_YBTT = jnp.stack(masks)

        def body(x, xs):
            p, kind = xs
            p = compute_dtype(p, dtype)
            q, k, v = _qkv(x, p, cfg, cos_YBTD[kind], sin_YBTD[kind])
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
            x = _finish_layer(x, _attention(q, k, v, mask_YBTT[kind], cfg), p, cfg)
            return x, ((k, v) if collect_kv else None)

        x_BTE, kv = run_layers(self, body, self._embed(input_ids_BT), dropout_key=dropout_key)
        return _rms_norm(x_BTE, self.final_norm[...], cfg), kv


def compute_dtype(p: dict[str, jax.Array], dtype) -> dict[str, jax.Array]:
    """One layer's arrays with the floating ones cast to the compute dtype (dropout keys stay as they are)."""
    return {n: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a for n, a in p.items()}


def run_layers(model: Transformer, body, x0, *, dropout_key: jax.Array | None = None):
    """Run `body(x, (layer params, kind index)) -> (x, y)` over the model's layers -> (x, ys stacked
    on a leading layers axis, or None), rematerialised per layer when `model.remat`: one `lax.scan`
    when `model.scan_layers`, else unrolled over per-layer weights (split from the stacked arrays
    with `jnp.split`, whose gradient is one concatenation rather than a padded sum per layer).
    `dropout_key`: see `Layers.arrays`."""
    if model.remat:
        body = jax.checkpoint(body, prevent_cse=False)
    cfg, arrays = model.config, model.layers.arrays(dropout_key)
    if model.scan_layers:
        return jax.lax.scan(body, x0, (arrays, _kind_index(cfg)))
    per_layer = {n: jnp.split(a, cfg.num_layers) for n, a in arrays.items()}
    x, ys = x0, []
    for l, kind in enumerate(cfg.layer_types):
        x, y = body(x, ({n: a[l][0] for n, a in per_layer.items()}, cfg.kinds.index(kind)))
        ys.append(y)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys[0] is not None else None


def _kind_index(cfg: TransformerConfig) -> jax.Array:
    """int32 [L]: each layer's index into `cfg.kinds` (its attention kind: full / sliding)."""
    return jnp.asarray([cfg.kinds.index(t) for t in cfg.layer_types], jnp.int32)


def _rope_tables(cfg: TransformerConfig, positions_BT: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [Y, B, T, D]: one rope table per layer kind (their bases may differ)."""
    tables = [rope.cos_sin(jnp.asarray(rope.inv_frequencies(cfg.rope_of(k), cfg.head_dim)), positions_BT, dtype)
              for k in cfg.kinds]
    return jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])


def _as_mask(attention_mask_BT, shape) -> jax.Array:
    if attention_mask_BT is None:
        return jnp.ones(shape, jnp.bool_)
    chex.assert_shape(attention_mask_BT, shape)
    return attention_mask_BT.astype(jnp.bool_)


def _positions(mask_BT: jax.Array) -> jax.Array:
    """Rotary positions: real tokens count up from 0; padding takes its neighbour's (it is masked anyway)."""
    return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1, 0)


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
    q = _adapted(h_NE, p, "q_proj", jnp.einsum("ne,ehd->nhd", h_NE, p["q_proj"]))
    k = _adapted(h_NE, p, "k_proj", jnp.einsum("ne,ekd->nkd", h_NE, p["k_proj"]))
    v = _adapted(h_NE, p, "v_proj", jnp.einsum("ne,ekd->nkd", h_NE, p["v_proj"]))
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q, k = _rms_norm(q, p["q_norm"], cfg), _rms_norm(k, p["k_norm"], cfg)
    q, k, v = (a.reshape(B, T, *a.shape[1:]) for a in (q, k, v))
    return rope.apply(q, cos_BTD, sin_BTD), rope.apply(k, cos_BTD, sin_BTD), v


def _attention(q_BTHD, k_BKTD, v_BKTD, mask_BTT, cfg: TransformerConfig) -> jax.Array:
    """Masked softmax attention of T queries over T keys -> [B, T, H, D].

    The G query heads of a kv head and the T positions are folded into one axis M, so every
    contraction is a plain batched matmul over (row, kv head).
    """
    B, T, H, D = q_BTHD.shape
    K = k_BKTD.shape[1]
    G = H // K
    q_BKMD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, D)
    s_BKMS = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKTD, preferred_element_type=jnp.float32) * cfg.query_scale
    if cfg.attn_logit_softcap is not None:
        s_BKMS = jnp.tanh(s_BKMS / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    s_BKGTS = jnp.where(mask_BTT[:, None, None], s_BKMS.reshape(B, K, G, T, T), _NEG)
    p_BKMS = jax.nn.softmax(s_BKGTS, axis=-1).reshape(B, K, G * T, T).astype(v_BKTD.dtype)
    out_BKMD = jnp.einsum("bkms,bksd->bkmd", p_BKMS, v_BKTD)
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


def _adapted(x_NI: jax.Array, p: dict[str, jax.Array], name: str, y: jax.Array) -> jax.Array:
    """`y` = x W of projection `name`, plus its LoRA path (x A) B when the layer has an adapter."""
    if f"{name}_lora_a" not in p:
        return y
    a, b = p[f"{name}_lora_a"], p[f"{name}_lora_b"]
    if "lora_dropout_key" in p:
        x_NI = lora.dropped(x_NI, p["lora_dropout_key"], p["lora_keep"], name)
    delta = lora.low_rank(x_NI, a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1))
    return y + delta.reshape(y.shape).astype(y.dtype)


def _finish_layer(x_BTE, attn_BTHD, p, cfg: TransformerConfig):
    B, T, E = x_BTE.shape
    # One plain matmul over (heads x head_dim): contracting two axes, XLA:CPU chose to transpose the
    # o_proj weight into (head_dim, heads) order, a copy of it per layer and decode step inside a scan.
    attn_NF = attn_BTHD.reshape(B * T, -1)
    a = _adapted(attn_NF, p, "o_proj", jnp.einsum("nf,fe->ne", attn_NF, p["o_proj"].reshape(attn_NF.shape[1], E)))
    if cfg.o_bias:
        a = a + p["o_bias"]
    if cfg.post_norms:
        a = _rms_norm(a, p["attn_post_norm"], cfg)
    x_NE = x_BTE.reshape(B * T, E) + a
    h = _rms_norm(x_NE, p["mlp_norm"], cfg)
    gate = _adapted(h, p, "gate_proj", jnp.einsum("ne,ef->nf", h, p["gate_proj"]))
    up = _adapted(h, p, "up_proj", jnp.einsum("ne,ef->nf", h, p["up_proj"]))
    if cfg.mlp_bias:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    act = _activation(gate, cfg.activation) * up
    m = _adapted(act, p, "down_proj", jnp.einsum("nf,fe->ne", act, p["down_proj"]))
    if cfg.mlp_bias:
        m = m + p["down_bias"]
    if cfg.post_norms:
        m = _rms_norm(m, p["mlp_post_norm"], cfg)
    return (x_NE + m).reshape(B, T, E)
