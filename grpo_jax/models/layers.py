"""The decoder's building blocks, shared by `transformer` (the plain pass, prefill and decode),
`grouped` (the shared-prompt training forward) and the reward model's backbone.

Each function is one step of a decoder layer over plain arrays: `p` is one layer's parameters by
the names of `transformer.layer_param_specs` (plus LoRA adapters as `Layers.arrays()` hands them
over), already in the compute dtype; `cfg` is the `TransformerConfig` whose switches pick the
family's variant (biases, q/k norms, sandwich norms, soft caps, activation).

Shape letters: grpo_jax.shapes.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import lora, rope
from grpo_jax.models.activations import activation as _activation
from grpo_jax.models.config import TransformerConfig
from grpo_jax.models.dispatch import model_need, pick, supports_parents
from grpo_jax.models.layer_scan import MixedMLP
from grpo_jax.models.moe import moe_mlp, no_routing
from grpo_jax.runtime.platform import interpret_kernels, platform_of

NEG = float(np.finfo(np.float32).min)
"""The score of a masked key: the float32 minimum, so a softmax gives it exactly 0 weight."""


def as_mask(attention_mask_BT: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
    """bool [B, T] of attention_mask [B, T] (1 = real token), checked against `shape`; None: all real."""
    if attention_mask_BT is None:
        return jnp.ones(shape, jnp.bool_)
    chex.assert_shape(attention_mask_BT, shape)
    return attention_mask_BT.astype(jnp.bool_)


def default_positions(mask_BT: jax.Array) -> jax.Array:
    """int32 [B, T] rotary positions of mask [B, T]: real tokens count up from 0; padding takes its
    neighbour's (it is masked anyway), so a left-padded row has its unpadded row's positions."""
    return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1, 0)


def rope_tables(cfg: TransformerConfig, positions_BT: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [Y, B, T, D] of positions int [B, T]: one rope table per layer kind (their bases may differ)."""
    tables = [rope.cos_sin(jnp.asarray(rope.inv_frequencies(cfg.rope_of(k), cfg.head_dim)), positions_BT, dtype)
              for k in cfg.kinds]
    return jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])


def rms_norm(x: jax.Array, w: jax.Array, cfg: TransformerConfig) -> jax.Array:
    """RMSNorm of x over its last axis ([..., E], or [..., D] for the q/k norms) with weight w of
    that width, in x's dtype; Gemma's weights store (scale - 1) (`cfg.norm_plus_one`)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    if cfg.norm_plus_one:
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w.astype(x.dtype) * y.astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap), Gemma's soft cap of attention scores and final logits; x itself when cap is None."""
    if cap is None:
        return x
    return jnp.tanh(x / cap) * cap


def qkv(x_BTE: jax.Array, p: dict[str, jax.Array], cfg: TransformerConfig, cos_BTD: jax.Array,
        sin_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's attention inputs of x [B, T, E]: the pre-attention norm, the q/k/v projections (with
    their biases, LoRA paths and q/k norms) and rope on q and k (tables [B, T, D] of this layer's
    kind) -> q [B, T, H, D], k [B, T, K, D], v [B, T, K, D]."""
    B, T, E = x_BTE.shape
    h_XE = rms_norm(x_BTE, p["attn_norm"], cfg).reshape(B * T, E)
    q = _adapted(h_XE, p, "q_proj", jnp.einsum("xe,ehd->xhd", h_XE, p["q_proj"]))
    k = _adapted(h_XE, p, "k_proj", jnp.einsum("xe,ekd->xkd", h_XE, p["k_proj"]))
    v = _adapted(h_XE, p, "v_proj", jnp.einsum("xe,ekd->xkd", h_XE, p["v_proj"]))
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg), rms_norm(k, p["k_norm"], cfg)
    q, k, v = (a.reshape(B, T, *a.shape[1:]) for a in (q, k, v))
    return rope.apply(q, cos_BTD, sin_BTD), rope.apply(k, cos_BTD, sin_BTD), v


def segment_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """int32 [B, T] rotary positions of a packed row's segment ids [B, T]: each run of one id counts
    up from 0 (a packed sequence's positions restart where it starts); padding (0) counts too, and
    is masked anyway."""
    T = segment_ids_BT.shape[1]
    index_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids_BT.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], jnp.bool_),
                              segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    return index_BT - jax.lax.cummax(jnp.where(starts, index_BT, 0), axis=1)


CHUNK_BLOCK = 256
"""The chunked path's query and key block: the fastest of 256 / 512 on CPU from 512 tokens up
(benchmarks/results/attention/cpu.json)."""


def attention_impl(choice: str, cfg: TransformerConfig, *, keys: int, mesh=None, pass_name: str = "plain") -> str:
    """The attention implementation pass `pass_name` ("plain", "shared_prompt" or "packed";
    grpo_jax.models.dispatch) over `keys` key slots runs: `choice` itself (a `model.attention`
    name other than "auto": a run's start refuses one that cannot run its passes), or for "auto"
    the fastest implementation that supports the pass on the platform of the devices it runs on
    (`mesh`'s, else JAX's default backend; `dispatch.auto_order`). A Pallas kernel runs per device
    under shard_map over the mesh, so a pass not given its mesh runs a pure-JAX path."""
    if choice != "auto":
        return choice
    return pick("auto", model_need(pass_name, cfg, platform_of(mesh), keys=keys, mesh=mesh is not None))


def parents_supported(choice: str, cfg: TransformerConfig, mesh=None) -> bool:
    """Whether `model.attention`'s implementation for a plain pass on `mesh`'s platform sees parent
    segments (a packed completion's shared prompt): the XLA and chunked paths do; the Pallas kernels
    compare segment ids only, so packing lays a prompt copy before each completion there."""
    return supports_parents(choice, model_need("plain", cfg, platform_of(mesh), mesh=mesh is not None))


def attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *, q_segment_ids: jax.Array,
              kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array,
              q_parent_ids: jax.Array | None = None, kind: jax.Array | int, cfg: TransformerConfig, impl: str,
              mesh=None) -> jax.Array:
    """A layer's causal attention of queries [B, T, H, D] over keys and values [B, S, K, D] (S >= T:
    the queries are the last T of the key axis) -> [B, T, H, D], with `grpo_jax.models.attention`'s
    implementation `impl` (`attention_impl` chooses it) and visibility rule: same segment id (0 =
    padding), or the query's parent id (a packed completion's shared prompt), causal, within the
    sliding window of this layer's kind (`kind`: an index into `cfg.kinds`, traced in a layer scan).

    Masks come from the segment ids and positions, never a materialised [B, T, S] array; a model
    whose layers have two kinds (Gemma 3's full and sliding layers) picks the kind's attention with
    `lax.switch`, so one scanned layer body serves both.
    """
    from grpo_jax.models.attention import attend

    interpret = impl in ("splash", "gpu") and interpret_kernels(mesh)  # a kernel on CPU devices (a faked platform)

    def one(window):
        def run(q, k, v):
            return attend(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          q_positions=q_positions, kv_positions=kv_positions, q_parent_ids=q_parent_ids, causal=True,
                          window=window, softcap=cfg.attn_logit_softcap, scale=cfg.query_scale, impl=impl, mesh=mesh,
                          block_q=CHUNK_BLOCK, block_k=CHUNK_BLOCK, interpret=interpret)
        return run

    branches = [one(cfg.window_of(k)) for k in cfg.kinds]
    if len(branches) == 1:
        return branches[0](q_BTHD, k_BSKD, v_BSKD)
    if isinstance(kind, int):
        return branches[kind](q_BTHD, k_BSKD, v_BSKD)
    return jax.lax.switch(kind, branches, q_BTHD, k_BSKD, v_BSKD)


def decode_attention(q_BKQD: jax.Array, k_chunks: list[jax.Array], v_chunks: list[jax.Array], mask_BS: jax.Array,
                     cfg: TransformerConfig, dtype) -> jax.Array:
    """One query per row, q [B, K, Q, D], over a chunked cache -> [B, K, Q, D]: per chunk, keys
    [B', K, D, C] and values [B', K, C, D] (C: that chunk's slots, P for the prompt block); mask
    bool [B, S] over all the chunks' slots in order.

    A chunk may hold B' = B / G rows: the prompt chunk of a group sampler, shared by the G
    consecutive rows of each group. Its keys and values are then read once per group instead of
    being copied to every row (the prefill writes N rows whatever G is).
    """
    B = q_BKQD.shape[0]

    def scores(k):
        r = B // k.shape[0]
        if r == 1:
            return jnp.einsum("bkqd,bkds->bkqs", q_BKQD, k.astype(dtype), preferred_element_type=jnp.float32)
        q = q_BKQD.reshape(k.shape[0], r, *q_BKQD.shape[1:])
        s = jnp.einsum("nrkqd,nkds->nrkqs", q, k.astype(dtype), preferred_element_type=jnp.float32)
        return s.reshape(B, *s.shape[2:])

    def weighted(p_BKQS, v):
        r = B // v.shape[0]
        if r == 1:
            return jnp.einsum("bkqs,bksd->bkqd", p_BKQS, v.astype(dtype))
        p = p_BKQS.reshape(v.shape[0], r, *p_BKQS.shape[1:])
        return jnp.einsum("nrkqs,nksd->nrkqd", p, v.astype(dtype)).reshape(B, *p_BKQS.shape[1:3], v.shape[-1])

    s_BKQS = jnp.concatenate([scores(k) for k in k_chunks], axis=-1) * cfg.query_scale
    s_BKQS = softcap(s_BKQS, cfg.attn_logit_softcap)
    p_BKQS = jax.nn.softmax(jnp.where(mask_BS[:, None, None, :], s_BKQS, NEG), axis=-1)
    out, start = 0, 0
    for v in v_chunks:
        S = v.shape[2]
        out = out + weighted(p_BKQS[..., start:start + S].astype(dtype), v)
        start += S
    return out


def finish_layer(x_BTE: jax.Array, attn_BTHD: jax.Array, p: dict[str, jax.Array], cfg: TransformerConfig, *,
                 replay_XK: jax.Array | None = None, real_X: jax.Array | None = None, follow: bool = True,
                 mesh=None):
    """The rest of a layer after attention: the output projection of attn [B, T, H, D] added to the
    residual x [B, T, E], then the MLP block -> (the layer's output [B, T, E], its `moe.Routing`
    with experts [X, Kx], or None for a dense MLP). `replay_XK`, `real_X` (X = B*T), `follow`: see
    `moe.route`; `mesh`: where expert parallelism runs (`models.experts`)."""
    B, T, E = x_BTE.shape
    # One plain matmul over (heads x head_dim): contracting two axes, XLA:CPU chose to transpose the
    # o_proj weight into (head_dim, heads) order, a copy of it per layer and decode step inside a scan.
    attn_XI = attn_BTHD.reshape(B * T, -1)
    a = _adapted(attn_XI, p, "o_proj", jnp.einsum("xi,ie->xe", attn_XI, p["o_proj"].reshape(attn_XI.shape[1], E)))
    if cfg.o_bias:
        a = a + p["o_bias"]
    if cfg.post_norms:
        a = rms_norm(a, p["attn_post_norm"], cfg)
    x_BTE = x_BTE + a.reshape(B, T, E)

    def sparse(x_BTE, p):
        m_XE, routing = moe_mlp(rms_norm(x_BTE.reshape(B * T, E), p["mlp_norm"], cfg), p, cfg, replay_XK=replay_XK,
                                real_X=real_X, follow=follow, mesh=mesh)
        return m_XE.reshape(B, T, E), routing

    mixed = p.get("mlp")
    if isinstance(mixed, MixedMLP):  # a scanned layer of a mixed stack: its MLP's kind is traced
        def sliced(stack):
            return {**p, **{n: jax.lax.dynamic_index_in_dim(a, mixed.slot, keepdims=False).astype(x_BTE.dtype)
                            for n, a in stack.items()}}

        zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda x: sparse(x, sliced(mixed.experts))[1], x_BTE))
        m_BTE, routing = jax.lax.cond(mixed.sparse, lambda x: sparse(x, sliced(mixed.experts)),
                                      lambda x: (mlp_block(x, sliced(mixed.dense), cfg), zero), x_BTE)
        return x_BTE + m_BTE, routing
    if "router" in p:
        m_BTE, routing = sparse(x_BTE, p)
        return x_BTE + m_BTE, routing
    m_BTE = mlp_block(x_BTE, p, cfg)
    if cfg.is_moe:  # a dense layer of a mixed stack: no routing (zeros, as the scan's dense layers give)
        return x_BTE + m_BTE, no_routing(cfg, B * T)
    return x_BTE + m_BTE, None


# A layer's MLP over more than this many tokens of sequence runs in chunks of it (`mlp_block`).
MLP_CHUNK = 4096


def mlp_block(x_BTE: jax.Array, p: dict[str, jax.Array], cfg: TransformerConfig) -> jax.Array:
    """The MLP block's output (norm, gated MLP, post-norm) on x [B, T, E], to be added to x.

    Over more than `MLP_CHUNK` tokens of sequence it runs in rematerialised
    chunks of the T axis (rows keep their sharding): a backward pass then holds one chunk's
    [B, chunk, F] intermediates, not [B, T, F] (at 16k tokens of Qwen3-0.6B that is 8 rows x 16k x
    3,072 x 2 bytes = 768 MiB per array, several of them), for one more forward of the MLP. The
    result is the unchunked one's: each token's MLP reads only that token. A LoRA adapter with
    dropout runs unchunked (its dropout mask is drawn over the whole call)."""
    B, T, E = x_BTE.shape
    chunk = MLP_CHUNK
    if T <= chunk or "lora_dropout_key" in p:
        return _mlp(x_BTE.reshape(B * T, E), p, cfg).reshape(B, T, E)
    n = -(-T // chunk)
    x_BCE = jnp.pad(x_BTE, ((0, 0), (0, n * chunk - T), (0, 0))) if n * chunk != T else x_BTE
    x_NBCE = jnp.moveaxis(x_BCE.reshape(B, n, chunk, E), 1, 0)
    one = jax.checkpoint(lambda x, w: _mlp(x.reshape(B * chunk, E), w, cfg).reshape(B, chunk, E), prevent_cse=False)
    m_NBCE = jax.lax.map(lambda x: one(x, p), x_NBCE)
    return jnp.moveaxis(m_NBCE, 0, 1).reshape(B, n * chunk, E)[:, :T]


def _mlp(x_XE: jax.Array, p: dict[str, jax.Array], cfg: TransformerConfig) -> jax.Array:
    h = rms_norm(x_XE, p["mlp_norm"], cfg)
    gate = _adapted(h, p, "gate_proj", jnp.einsum("xe,ef->xf", h, p["gate_proj"]))
    up = _adapted(h, p, "up_proj", jnp.einsum("xe,ef->xf", h, p["up_proj"]))
    if cfg.mlp_bias:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    act = _activation(gate, cfg.activation) * up
    m = _adapted(act, p, "down_proj", jnp.einsum("xf,fe->xe", act, p["down_proj"]))
    if cfg.mlp_bias:
        m = m + p["down_bias"]
    if cfg.post_norms:
        m = rms_norm(m, p["mlp_post_norm"], cfg)
    return m


def _adapted(x_XI: jax.Array, p: dict[str, jax.Array], name: str, y: jax.Array) -> jax.Array:
    """`y` = x W of projection `name`, plus its LoRA path (x A) B when the layer has an adapter."""
    if f"{name}_lora_a" not in p:
        return y
    a, b = p[f"{name}_lora_a"], p[f"{name}_lora_b"]
    if "lora_dropout_key" in p:
        x_XI = lora.dropped(x_XI, p["lora_dropout_key"], p["lora_keep"], name)
    delta = lora.low_rank(x_XI, a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1))
    return y + delta.reshape(y.shape).astype(y.dtype)
