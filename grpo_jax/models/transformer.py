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

The layers' math is `layers`. Shape letters: grpo_jax.shapes.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from grpo_jax.config import ATTENTIONS
from grpo_jax.models import lora
from grpo_jax.models.attention import IMPLS
from grpo_jax.models.cache import KVCache, write_slot
from grpo_jax.models.config import TransformerConfig
from grpo_jax.models.layer_scan import REMAT_POLICIES, compute_dtype, layer_params, run_layers, stack_size
from grpo_jax.models.moe import replay_per_layer, stack_layers
from grpo_jax.models.layers import (as_mask, attention, attention_impl, decode_attention, default_positions,
                                    finish_layer, qkv, rms_norm, rope_tables, segment_positions, softcap)

# The names of model.dtype / model.param_dtype (and reward models' dtype) as JAX dtypes.
JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

assert ATTENTIONS == ("auto", *IMPLS), "one implementation per model.attention choice"


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
    }
    if config.is_moe:
        Ex, Fx = config.num_experts, config.moe_intermediate_size
        specs["router"] = ((E, Ex), ("embed", "router"))
        specs["expert_gate"] = ((Ex, E, Fx), ("experts", "embed", "expert_mlp"))
        specs["expert_up"] = ((Ex, E, Fx), ("experts", "embed", "expert_mlp"))
        specs["expert_down"] = ((Ex, Fx, E), ("experts", "expert_mlp", "embed"))
    if not config.is_moe or config.mixed:
        specs["gate_proj"] = ((E, F), ("embed", "mlp"))
        specs["up_proj"] = ((E, F), ("embed", "mlp"))
        specs["down_proj"] = ((F, E), ("mlp", "embed"))
    if config.qkv_bias:
        specs["q_bias"] = ((H, D), ("heads", "head_dim"))
        specs["k_bias"] = ((K, D), ("kv_heads", "head_dim"))
        specs["v_bias"] = ((K, D), ("kv_heads", "head_dim"))
    if config.o_bias:
        specs["o_bias"] = ((E,), ("embed",))
    if config.mlp_bias and not config.is_moe:
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
        specs[("layers", name)] = ((stack_size(config, name), *shape), ("layers", *axes))
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
    `remat` (a `model.remat` choice, `REMAT_POLICIES`): what each layer keeps for a backward pass;
    passes without gradients (sampling, reference log-probs) run the same either way.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, remat: str = "none", scan_layers: bool = True, attention: str = "auto"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r} is not one of {list(REMAT_POLICIES)}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r} is not one of {list(ATTENTIONS)}")
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.remat = remat
        self.scan_layers = scan_layers
        self.attention = attention
        values = _random_params(config, rngs.params(), self.param_dtype)
        params = {k: nnx.Param(values[k], logical_axes=axes) for k, (_, axes) in param_specs(config).items()}
        self.embed = params[("embed",)]
        self.layers = Layers({k[1]: v for k, v in params.items() if k[0] == "layers"})
        self.final_norm = params[("final_norm",)]
        self.lm_head = params.get(("lm_head",))  # None when tied to the embedding

    # ------------------------------------------------------------------ public API
    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None, *,
                 routing: jax.Array | None = None) -> jax.Array:
        """Plain causal pass over input_ids int [B, T] -> float32 logits [B, T, V].

        attention_mask [B, T] (1 = real token; default all real); segment_ids int32 [B, T] (a packed
        row: a token attends only to earlier tokens of the same id, 0 is padding; default: one
        sequence, the attention mask's real tokens); positions int [B, T] (default: real tokens
        count up from 0 and padding repeats its neighbour's position, so a left-padded row gives the
        logits of the unpadded row; with segment_ids, each segment counts up from 0). A packed row
        gives each of its sequences the logits of that sequence's own pass.
        `routing` int [B, T, L, Kx] (a mixture-of-experts model): route every token to these experts
        instead of the router's choice (routing replay; `models.moe`).
        """
        return self.logits(self.hidden_states(input_ids, positions, attention_mask, segment_ids, routing=routing))

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                      attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None, *,
                      parent_ids: jax.Array | None = None, dropout_key: jax.Array | None = None,
                      row_sharding=None, routing: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states [B, T, E] in the compute dtype (feed to `logits`); arguments as
        `__call__`. `parent_ids` int32 [B, T]: a token also attends the earlier tokens whose segment
        id is its parent id (a packed completion's shared prompt; `learner.packing`).
        `dropout_key`: apply the LoRA adapters' input dropout (the training pass); `row_sharding`:
        see `run_layers`."""
        return self.routed_hidden_states(input_ids, positions, attention_mask, segment_ids, parent_ids=parent_ids,
                                         dropout_key=dropout_key, row_sharding=row_sharding, routing=routing)[0]

    def routed_hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                             attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None, *,
                             parent_ids: jax.Array | None = None, dropout_key: jax.Array | None = None,
                             row_sharding=None, routing: jax.Array | None = None, replay: bool = True,
                             counted: jax.Array | None = None):
        """`hidden_states` and what the routers did: (h [B, T, E], `moe.Routing`, None for a dense
        model). `replay` False: `routing` is only compared with the routers' own choice
        (`Routing.mismatch`), not followed. `counted` [B, T]: the tokens its statistics count
        (default the real ones: padding is routed but not counted)."""
        chex.assert_rank(input_ids, 2)
        B, T = input_ids.shape
        mask_BT = as_mask(attention_mask, (B, T))
        if segment_ids is not None:
            chex.assert_shape(segment_ids, (B, T))
        segments_BT = jnp.where(mask_BT, 1 if segment_ids is None else segment_ids, 0).astype(jnp.int32)
        if positions is None:
            positions = default_positions(mask_BT) if segment_ids is None else segment_positions(segments_BT)
        chex.assert_shape(positions, (B, T))
        counted_BT = segments_BT > 0 if counted is None else as_mask(counted, (B, T))
        h_BTE, _, routed = self._run(input_ids, positions, segments_BT, parent_ids, collect_kv=False,
                                     dropout_key=dropout_key, row_sharding=row_sharding, routing=routing,
                                     replay=replay, counted=counted_BT)
        return h_BTE, routed

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [B, T, V] of hidden states [B, T, E]."""
        cfg = self.config
        B, T, E = hidden.shape
        # Rows and positions are folded into one axis: XLA:CPU lowers a singleton T (decoding) to slow dots.
        h_XE = hidden.reshape(B * T, E)
        if cfg.tie_word_embeddings:
            logits_XV = jnp.einsum("xe,ve->xv", h_XE, self.embed[...].astype(self.dtype),
                                   preferred_element_type=jnp.float32)
        else:
            logits_XV = jnp.einsum("xe,ev->xv", h_XE, self.lm_head[...].astype(self.dtype),
                                   preferred_element_type=jnp.float32)
        return softcap(logits_XV, cfg.final_logit_softcap).reshape(B, T, -1)

    def prefill(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *, decode_steps: int,
                group_size: int = 1, chunks: int = 1, last_only: bool = False, with_routing: bool = False,
                row_sharding=None):
        """Run N (left-padded) prompts, input_ids int [N, P] and attention_mask [N, P], once ->
        (float32 logits [N, P, V], or [N, 1, V] of the last position with `last_only`; a `KVCache`).

        The cache holds the prompts' keys/values once per prompt, has N * `group_size` rows (row
        i*G + j decodes from prompt i) and room for `decode_steps` decode steps in `chunks` chunks.
        `with_routing` (a mixture-of-experts model): also the prompts' experts int32 [N, P, L, Kx].
        `row_sharding`: the prompts' rows' split, which every layer keeps (`layer_scan.run_layers`; the
        engines pass theirs, else XLA splits each prompt's hidden states by the table's embed axis).
        """
        chex.assert_rank(input_ids, 2)
        mask_BT = as_mask(attention_mask, input_ids.shape)
        positions_BT = default_positions(mask_BT)
        h_BTE, (k_LBKTD, v_LBKTD), routed = self._run(input_ids, positions_BT, mask_BT.astype(jnp.int32), None,
                                                      collect_kv=True, row_sharding=row_sharding)
        if last_only:
            h_BTE = h_BTE[:, -1:]
        cache = KVCache.from_prefill(k_LBKTD, v_LBKTD, mask_BT, positions_BT, group_size=group_size,
                                     decode_steps=decode_steps, chunks=chunks)
        if with_routing:
            return self.logits(h_BTE), cache, _experts_of(routed)
        return self.logits(h_BTE), cache

    def prefill_kv(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                   with_routing: bool = False, row_sharding=None) -> tuple[jax.Array, ...]:
        """The prompts' pass for a cache laid out by the caller (the paged engine's
        `models.slots.SlotCache`): input_ids int [N, P], attention_mask [N, P] -> (float32 logits
        [N, V] of the last position, keys and values [L, N, K, P, D], mask bool [N, P], rotary
        positions int32 [N, P]), and with `with_routing` the prompts' experts int32 [N, P, L, Kx].
        `row_sharding`: as `prefill`'s."""
        chex.assert_rank(input_ids, 2)
        mask_BT = as_mask(attention_mask, input_ids.shape)
        positions_BT = default_positions(mask_BT)
        h_BTE, (k_LBKTD, v_LBKTD), routed = self._run(input_ids, positions_BT, mask_BT.astype(jnp.int32), None,
                                                      collect_kv=True, row_sharding=row_sharding)
        out = (self.logits(h_BTE[:, -1:])[:, 0], k_LBKTD, v_LBKTD, mask_BT, positions_BT)
        return (*out, _experts_of(routed)) if with_routing else out

    def decode_step(self, input_ids: jax.Array, cache: KVCache, *, chunk: int | None = None,
                    weights: list[dict[str, jax.Array]] | None = None, with_routing: bool = False, mesh=None):
        """Feed one token per row, input_ids int [R] -> (float32 logits [R, V] of the next token, cache).

        The token goes to the cache's next decode slot, which must lie in chunk `chunk`; the step
        attends the prompt block and chunks 0..chunk only. `chunk` is static (it fixes the attended
        shapes), so a jitted caller passes it (`cache.chunk_of(step)`); None reads it from a
        concrete `cache.length`. `weights`: `layer_weights()`, hoisted out of a decode loop so the
        per-layer slicing and the cast to the compute dtype are not repeated every step.

        `with_routing` (a mixture-of-experts model): also the experts each row's token went to, int32
        [R, L, Kx]; `mesh`: where its experts run (`models.experts`; the engines pass theirs). Layers
        are unrolled here, not scanned (see the module docstring for why).
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
        cos_YR1D, sin_YR1D = rope_tables(cfg, pos_R1, dtype)
        n = cache.prompt_len + (chunk + 1) * cache.chunk_size  # slots attended
        masks = {}
        for kind in cfg.kinds:
            window = cfg.window_of(kind)
            in_window = True if window is None else pos_R1 - cache.pos[:, :n] < window
            masks[kind] = cache.mask[:, :n] & in_window
        at = cache.slot_in_chunk(chunk)
        x_R1E = self.embed_tokens(input_ids[:, None])
        keys, values, experts = [], [], []
        for l, kind in enumerate(cfg.layer_types):
            y = cfg.kinds.index(kind)
            q, k, v = qkv(x_R1E, weights[l], cfg, cos_YR1D[y], sin_YR1D[y])  # [R, 1, H, D], [R, 1, K, D]
            k_RKDC, v_RKCD = write_slot(cache.keys[chunk][l], cache.values[chunk][l], at, k[:, 0], v[:, 0])
            keys.append(k_RKDC)
            values.append(v_RKCD)
            earlier = range(chunk)
            o_RKQD = decode_attention(
                q.reshape(R, K, -1, D), [cache.prompt_keys[l], *(cache.keys[c][l] for c in earlier), k_RKDC],
                [cache.prompt_values[l], *(cache.values[c][l] for c in earlier), v_RKCD], masks[kind], cfg, dtype)
            x_R1E, routed = finish_layer(x_R1E, o_RKQD.reshape(R, 1, -1, D), weights[l], cfg, mesh=mesh)
            experts.append(None if routed is None else routed.experts)
        logits_RV = self.logits(rms_norm(x_R1E, self.final_norm[...], cfg))[:, 0]
        cache = cache.close_slot(chunk, tuple(keys), tuple(values))
        if with_routing:
            return logits_RV, cache, (jnp.stack(experts, axis=1) if cfg.is_moe else None)
        return logits_RV, cache

    def layer_weights(self) -> list[dict[str, jax.Array]]:
        """Per-layer parameter dicts in the compute dtype (for `decode_step`): L separate buffers each."""
        arrays = self.layers.arrays()
        # Adapters are folded into their weights once here, outside the decode loop.
        return [{n: a.astype(self.dtype) for n, a in lora.merged(layer_params(self.config, arrays, l)).items()}
                for l in range(self.config.num_layers)]

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        """Input embeddings [B, T, E] of input_ids int [B, T], in the compute dtype (scaled by sqrt(E)
        where the family does; the embedding table itself is the parameter `embed`)."""
        cfg, dtype = self.config, self.dtype
        x_BTE = self.embed[...].astype(dtype)[input_ids]
        if cfg.scale_embeddings:
            # HF rounds sqrt(E) to the parameter dtype before the multiply.
            x_BTE = x_BTE * jnp.asarray(math.sqrt(cfg.hidden_size), self.param_dtype).astype(dtype)
        return x_BTE

    # ------------------------------------------------------------------ internals
    def _run(self, input_ids_BT, positions_BT, segments_BT, parents_BT, *, collect_kv: bool, dropout_key=None,
             row_sharding=None, routing=None, replay=True, counted=None):
        """Embed, run the layers (one scan), final norm -> (h [B,T,E], (k, v) [L,B,K,T,D] or None,
        `moe.Routing` or None). segments_BT int32 [B, T] (0 = padding), parents_BT int32 [B, T] or
        None: see `layers.attention`; routing: replayed experts int [B, T, L, Kx] or None (only compared
        with replay=False); counted bool [B, T]: the tokens the routers' statistics count (the real ones)."""
        cfg, dtype = self.config, self.dtype
        B, T = input_ids_BT.shape
        replay_LXK = replay_per_layer(routing, cfg, (B, T)) if cfg.is_moe else _no_replay(routing)
        real_X = (segments_BT > 0 if counted is None else counted).reshape(-1)
        cos_YBTD, sin_YBTD = rope_tables(cfg, positions_BT, dtype)
        mesh = None if row_sharding is None else row_sharding.mesh
        impl = attention_impl(self.attention, cfg, keys=T, mesh=mesh,
                              pass_name="plain" if parents_BT is None else "packed")

        def body(x, xs):
            p, kind, replay_XK = xs
            p = compute_dtype(p, dtype)
            q, k, v = qkv(x, p, cfg, cos_YBTD[kind], sin_YBTD[kind])  # [B, T, H, D], [B, T, K, D] x 2
            q, k, v = (checkpoint_name(a, "qkv") for a in (q, k, v))
            out = attention(q, k, v, q_segment_ids=segments_BT, kv_segment_ids=segments_BT, q_positions=positions_BT,
                            kv_positions=positions_BT, q_parent_ids=parents_BT, kind=kind, cfg=cfg, impl=impl,
                            mesh=mesh)
            x, routed = finish_layer(x, checkpoint_name(out, "attention"), p, cfg, replay_XK=replay_XK, real_X=real_X,
                                     follow=replay, mesh=mesh)
            return x, ((k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) if collect_kv else None, routed)

        x_BTE, (kv, routed) = run_layers(self, body, self.embed_tokens(input_ids_BT), dropout_key=dropout_key,
                                         row_sharding=row_sharding, extra=replay_LXK)
        routed = None if routed is None else stack_layers(routed, (B, T))
        return rms_norm(x_BTE, self.final_norm[...], cfg), kv, routed


def _experts_of(routed) -> jax.Array | None:
    return None if routed is None else routed.experts


def _no_replay(routing) -> None:
    if routing is not None:
        raise ValueError("routing replay was given to a dense model (it has no experts)")
    return None
