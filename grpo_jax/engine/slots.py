"""The paged engine's per-slot layout (`sampling.kv_cache_bytes: 0`, grpo_jax.engine.layouts'
`SlotPages`): decode slots with their own generated blocks, one max-length reservation each, and the
prompts' blocks shared through an indirection (grpo_jax.engine.paged runs the loop).

Layout. The engine's rows are split into Z shards (the mesh's data x fsdp x expert row shards; 1 without a
mesh), each with its own J decode slots and its own Np prompts, so every index below is local to a
shard and no lookup crosses devices. Per layer:
- the prompt block [Z, Np, K, D, P] (keys) / [Z, Np, K, P, D] (values), written once by the prefill
  of each prompt. A slot reads its prompt's block through `slot_prompt` [Z, J]: the G samples of a
  prompt read one copy wherever and whenever they run, so prefill cost and prompt memory do not
  grow with G (or with the number of slots).
- each slot's generated block, in `phases` chunk buffers of C slots each, [Z*J, K, D, C] (keys) /
  [Z*J, K, C, D] (values): Mc = phases x C fed tokens of the sequence the slot holds now.
  `slot_t` [Z, J] counts them; the next fed token goes to chunk slot_t // C at slot_t % C (a
  per-slot scatter into each chunk, the slots whose token is elsewhere dropped; in place in the
  loop). A refilled slot starts at slot_t = 0: what the previous sequence left above it is
  masked, then overwritten. Separate chunk buffers, not one of Mc: XLA:CPU copies a slice of a
  buffer before a matmul reads it, and slicing the first (c + 1) x C slots of one buffer every
  step cost a third of a decode step.

Why per-slot blocks and not pages: every slot's capacity is the same (max_new_tokens), so a page
table would add a gather per step and buy nothing but finer-grained memory; the prompt is the one
part that is shared, and the indirection shares it without copying.

Attention of phase c (static: it fixes the shapes) reads the prompt block and chunks 0..c; the engine picks the phase from the longest sequence in flight (`lax.switch` per
layer, around attention only), so steps while every sequence is short do not pay for the whole
capacity.

Shape letters: grpo_jax.shapes (Z row shards, J decode slots per shard, Np prompts per shard).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from grpo_jax.engine.routing import layer_experts
from grpo_jax.models.cache import ChunkedKeys
from grpo_jax.models.layers import NEG, finish_layer, qkv, rms_norm, rope_tables, softcap


@flax.struct.dataclass
class SlotCache(ChunkedKeys):
    """A chunk is an attention phase here; `capacity` is a slot's fed tokens (Mc)."""

    prompt_keys: tuple[jax.Array, ...]  # L x [Z, Np, K, D, P]
    prompt_values: tuple[jax.Array, ...]  # L x [Z, Np, K, P, D]
    prompt_mask: jax.Array  # bool [Z, Np, P]: the prompt slot holds a real token
    prompt_pos: jax.Array  # int32 [Z, Np, P]: its rotary position
    prompt_next: jax.Array  # int32 [Z, Np]: the rotary position of the first generated token
    keys: tuple[tuple[jax.Array, ...], ...]  # phases x L x [Z*J, K, D, C]
    values: tuple[tuple[jax.Array, ...], ...]  # phases x L x [Z*J, K, C, D]
    slot_prompt: jax.Array  # int32 [Z, J]: the (shard-local) prompt each slot decodes from
    slot_t: jax.Array  # int32 [Z, J]: tokens fed to the slot's sequence so far

    @classmethod
    def create(cls, keys_LNKPD: jax.Array, values_LNKPD: jax.Array, mask_NP: jax.Array, pos_NP: jax.Array, *,
               shards: int, slots: int, decode_steps: int, phases: int) -> SlotCache:
        """The cache of N prefilled prompts (keys/values [L, N, K, P, D], mask and positions [N, P];
        N = shards x Np, shard z holding prompts z*Np ..), with `slots` decode slots per shard and
        room for `decode_steps` fed tokens per slot in `phases` attention phases."""
        L, N, K, P, D = keys_LNKPD.shape
        Z, J = shards, slots
        if N % Z:
            raise ValueError(f"{N} prompts do not split into {Z} row shards")
        phases = max(1, min(phases, decode_steps))
        C = max(1, -(-decode_steps // phases))

        def per_shard(x):
            return x.reshape(Z, N // Z, *x.shape[1:])

        return cls(
            prompt_keys=tuple(per_shard(keys_LNKPD[l].transpose(0, 1, 3, 2)) for l in range(L)),
            prompt_values=tuple(per_shard(values_LNKPD[l]) for l in range(L)),
            prompt_mask=per_shard(mask_NP.astype(jnp.bool_)),
            prompt_pos=per_shard(pos_NP.astype(jnp.int32)),
            prompt_next=per_shard(mask_NP.astype(jnp.int32).sum(axis=1)),
            keys=tuple(tuple(jnp.zeros((Z * J, K, D, C), keys_LNKPD.dtype) for _ in range(L)) for _ in range(phases)),
            values=tuple(tuple(jnp.zeros((Z * J, K, C, D), values_LNKPD.dtype) for _ in range(L))
                         for _ in range(phases)),
            slot_prompt=jnp.zeros((Z, J), jnp.int32),
            slot_t=jnp.zeros((Z, J), jnp.int32),
        )

    def per_slot(self, x_ZN):
        """A per-prompt array [Z, Np, ...] read for each slot's prompt -> [Z, J, ...]."""
        return jax.vmap(lambda a, i: a[i])(x_ZN, self.slot_prompt)


def slot_decode_step(model, tokens_ZJ: jax.Array, cache: SlotCache, *, phase: jax.Array | int,
                     weights: list[dict[str, jax.Array]], mesh=None) -> tuple[jax.Array, SlotCache, jax.Array | None]:
    """Feed each slot's token, tokens int [Z, J], at its position -> (float32 logits [Z, J, V] of
    each slot's next token, the cache with the token's keys/values written at `slot_t` and
    `slot_t` + 1, and for a mixture-of-experts model the experts the token went to, int32
    [Z, J, L, Kx]; None for a dense one). `phase` (an int32 scalar, may be traced): attention reads chunks 0..phase
    (every slot's `slot_t` must lie below (phase + 1) x C); each layer picks its attention program
    with `lax.switch`, which reads the cache but does not carry it, so no buffer is copied in or
    out. `weights`: `model.layer_weights()`, hoisted. `mesh`: where a mixture of experts runs its
    experts (`models.experts`: by all-to-all over its expert axis; None: where XLA puts them)."""
    cfg, dtype = model.config, model.dtype
    Z, J = tokens_ZJ.shape
    X, C = Z * J, cache.chunk_size
    t_X = cache.slot_t.reshape(X)
    pos_X1 = (cache.per_slot(cache.prompt_next) + cache.slot_t).reshape(X, 1)
    cos_YX1D, sin_YX1D = rope_tables(cfg, pos_X1, dtype)
    pmask_XP = cache.per_slot(cache.prompt_mask).reshape(X, -1)
    ppos_XP = cache.per_slot(cache.prompt_pos).reshape(X, -1)
    j_C = jnp.arange(cache.capacity, dtype=jnp.int32)
    gen_XC = j_C[None] <= t_X[:, None]  # the slot's fed tokens, this one included
    masks = {}
    for kind in cfg.kinds:
        window = cfg.window_of(kind)
        if window is None:
            masks[kind] = (pmask_XP, gen_XC)
        else:
            masks[kind] = (pmask_XP & (pos_X1 - ppos_XP < window), gen_XC & (t_X[:, None] - j_C[None] < window))
    programs = [functools.partial(_attend, chunks=c + 1, cfg=cfg, dtype=dtype) for c in range(cache.num_chunks)]
    rows = jnp.arange(X)
    # Where the token goes in each chunk: its slot there, or C (outside: the write is dropped).
    at = [jnp.where(t_X // C == c, t_X % C, C) for c in range(cache.num_chunks)]
    x_X1E = model.embed_tokens(tokens_ZJ.reshape(X, 1))
    keys, values = [list(chunk) for chunk in cache.keys], [list(chunk) for chunk in cache.values]
    experts = []
    for l, kind in enumerate(cfg.layer_types):
        y = cfg.kinds.index(kind)
        q, k, v = qkv(x_X1E, weights[l], cfg, cos_YX1D[y], sin_YX1D[y])  # [X, 1, H, D], [X, 1, K, D]
        for c in range(cache.num_chunks):
            keys[c][l] = keys[c][l].at[rows, :, :, at[c]].set(k[:, 0].astype(keys[c][l].dtype), mode="drop")
            values[c][l] = values[c][l].at[rows, :, at[c], :].set(v[:, 0].astype(values[c][l].dtype), mode="drop")
        K, D = k.shape[2], k.shape[3]
        pk_XKDP = cache.per_slot(cache.prompt_keys[l]).reshape(X, K, D, -1)
        pv_XKPD = cache.per_slot(cache.prompt_values[l]).reshape(X, K, -1, D)
        o_XKQD = jax.lax.switch(phase, programs, q.reshape(X, K, -1, D), pk_XKDP, pv_XKPD,
                                tuple(chunk[l] for chunk in keys), tuple(chunk[l] for chunk in values), *masks[kind])
        x_X1E, routed = finish_layer(x_X1E, o_XKQD.reshape(X, 1, -1, D), weights[l], cfg, mesh=mesh)
        experts.append(routed)
    logits_XV = model.logits(rms_norm(x_X1E, model.final_norm[...], cfg))[:, 0]
    cache = cache.replace(keys=tuple(map(tuple, keys)), values=tuple(map(tuple, values)), slot_t=cache.slot_t + 1)
    return logits_XV.reshape(Z, J, -1), cache, layer_experts(experts, (Z, J))


def _attend(q_XKQD, pk_XKDP, pv_XKPD, k_chunks, v_chunks, pmask_XP, gmask_XC, *, chunks: int, cfg,
            dtype) -> jax.Array:
    """One query per slot over its prompt's slots and its first `chunks` chunks -> [X, K, Q, D]."""
    def scores(k):
        return jnp.einsum("xkqd,xkds->xkqs", q_XKQD, k.astype(dtype), preferred_element_type=jnp.float32)

    s_XKQS = jnp.concatenate([scores(pk_XKDP)] + [scores(k) for k in k_chunks[:chunks]], axis=-1)
    s_XKQS = softcap(s_XKQS * cfg.query_scale, cfg.attn_logit_softcap)
    n = chunks * k_chunks[0].shape[-1]
    mask_XS = jnp.concatenate([pmask_XP, gmask_XC[:, :n]], axis=1)
    p_XKQS = jax.nn.softmax(jnp.where(mask_XS[:, None, None, :], s_XKQS, NEG), axis=-1).astype(dtype)
    out, start = 0, 0
    for v in (pv_XKPD, *v_chunks[:chunks]):
        S = v.shape[2]
        out = out + jnp.einsum("xkqs,xksd->xkqd", p_XKQS[..., start:start + S], v.astype(dtype))
        start += S
    return out
