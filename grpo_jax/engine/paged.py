"""The paged engine (`sampling.engine: paged`, and `continuous`: the production engine): a fixed
number of decode slots (`sampling.slots`), each refilled on device with the next waiting sequence
as soon as its own stops, over one of two cache layouts (grpo_jax.engine.layouts): a pool of cache
pages (grpo_jax.engine.pages; `sampling.kv_cache_bytes`), where a sequence holds pages for the keys
it has, not for max_new_tokens, so the same cache bytes hold more sequences at once on a
long-tailed workload; or, with 0 bytes, one max-length reservation per slot, contiguous and read in
place (grpo_jax.engine.slots), which never runs short.

One jitted program per call, all on device: the N prompts are prefilled once each (the G sequences
of a prompt read one copy of its keys), then one `lax.while_loop` whose step
1. draws the next token of every occupied slot (each sequence's own uniforms, `draw.sequence_uniforms`),
2. records it and marks the sequences that stopped; their pages go back to the pool,
3. takes a page for every continuing sequence whose next key starts a page (a new sequence's first
   page is a copy of its prompt's partial last page); when the pool is short, **preempts the
   youngest** sequences (most recently admitted) until it is not: their pages go back and they wait
   to be admitted again and recomputed from their first token (vLLM's recompute policy: the least
   work is lost and the oldest sequence always runs to its end, so the loop cannot livelock),
4. feeds the continuing slots' tokens (`engine.paged_decode.paged_decode_step`),
5. admits waiting sequences (lowest row first, so a preempted one goes before the new ones) into
   the free slots while the pool keeps a page for every admission and one for every running
   sequence: admitting never forces a preemption within the next page_size steps.
Stopping admission alone would deadlock once the running sequences outgrow the pool, unless each
reserved max_new_tokens up front (the per-slot layout); hence both. The drain: once every queue
is empty and no shard has more than half its slots busy, the sequences in flight move into half
the slots (`drain_widths`, `compact_paged`), so the last long sequences do not carry idle slots.

With a slot for every sequence and cache bytes for all of them at max_new_tokens (`lockstep_fits`),
nothing is paged: the call runs the lock-step loop (grpo_jax.engine.lockstep) with the same draws.

Exact: each sequence draws token t with the t-th of its own uniforms, whatever slot it runs in and
whenever, and a recomputed sequence re-draws with them, so it regenerates the same tokens (greedy:
identical; sampled: up to logit rounding) and a rollout does not depend on the cache's layout, the
number of pages, slots or preemptions, or the mesh. With temperature 0 it is the static engine's.

Shape letters: grpo_jax.shapes (Z row shards, J slots per shard, Np prompts, Rb sequences per
shard, M max new tokens, V vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.config import SamplingConfig
from grpo_jax.engine.draw import Rollout, draw_and_record, rollout_shardings, sequence_uniforms
from grpo_jax.engine.lockstep import every_sequence_at_once
from grpo_jax.engine.layouts import PoolPages, SlotPages, seat_pages
from grpo_jax.engine.pages import LAYOUT_OF, PagedCache, create_cache, page_bytes, pages_needed
from grpo_jax.engine.paged_decode import choose_attention, paged_decode_step
from grpo_jax.engine.slots import SlotCache, slot_decode_step
from grpo_jax.engine.routing import expert_buffer, fed_only, record, stored
from grpo_jax.engine.state import EngineLayout, engine_layout
from grpo_jax.runtime.sharding import BATCH, batch_sharding, replicated

STATS = ("steps", "slot_steps", "useful_slot_steps", "prefill_rows", "preemptions", "recomputed_tokens",
         "page_steps", "pages_peak", "pool_pages", "shards")


@flax.struct.dataclass
class PagedState:
    """The paged engine's loop state. Every array with a leading Z axis is split over the row shards."""

    seq: jax.Array  # int32 [Z, J]: the shard-local sequence each slot decodes, -1 = empty
    stamp: jax.Array  # int32 [Z, J]: when the slot's sequence was admitted (larger = younger)
    cache: PagedCache | SlotCache  # the pool, or one reservation per slot (engine.layouts)
    pending: jax.Array  # bool [Z, Rb]: waiting to be admitted (new, or preempted)
    started: jax.Array  # bool [Z, Rb]: admitted at least once
    prompt_logits: jax.Array  # float32 [Z, Np, V]
    logits: jax.Array  # float32 [Z, J, V]: what each slot draws its next token from
    uniforms: jax.Array | None  # float32 [Z, Rb, M]; None at temperature 0
    admissions: jax.Array  # int32 [Z]: admissions so far (the next stamp)
    done: jax.Array  # int32 [Z]: sequences of the shard finished
    tokens: jax.Array  # int32 [Z, Rb, M]
    logprobs: jax.Array  # float32 [Z, Rb, M]
    lengths: jax.Array  # int32 [Z, Rb]
    truncated: jax.Array  # bool [Z, Rb]
    counts: dict  # int32 scalars: steps, slot_steps, useful_slot_steps, preemptions, recomputed_tokens,
    #               page_steps (pool pages held, summed over steps and shards), pages_peak
    # A mixture-of-experts model (engine.routing; None for a dense one): each prompt's prefill experts
    # [Z, Np, P, L, Kx] and each sequence's fed tokens' experts [Z, Rb, M, L, Kx]. A
    # preempted sequence's recompute writes its experts again over what it recorded before: the
    # recompute's keys are the ones its later tokens attend, so its routing is the one that stands.
    prompt_experts: jax.Array | None = None
    experts: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PagedLoop:
    """What every step reads besides the state: the sequences' layout, the settings, the cache's
    layout (with the decode step bound to the model) and the mesh."""

    lay: EngineLayout
    config: SamplingConfig
    pages: PoolPages | SlotPages  # where the keys live and how decode reads them (engine.layouts)
    mesh: Mesh

    def hold(self, x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(BATCH)))


@functools.lru_cache(maxsize=64)
def paged_program(graphdef, config: SamplingConfig, mesh: Mesh):
    """The jitted paged engine: `(model state, ids [N, P], mask [N, P], key) -> (Rollout, stats)`
    with stats `STATS` (int32 scalars), rows split over the mesh's (data, fsdp, expert)."""
    rows = batch_sharding(mesh, 2)
    stats = {k: replicated(mesh) for k in STATS}
    return jax.jit(functools.partial(_engine, graphdef, config=config, mesh=mesh),
                   in_shardings=(None, rows, rows, replicated(mesh)), out_shardings=(rollout_shardings(mesh), stats))


def pool_pages(model_config, dtype, config: SamplingConfig, *, prompt_slots: int, prompts: int, slots: int) -> int:
    """Page ids per row shard for `sampling.kv_cache_bytes` (0: every slot can hold a max-length
    sequence, the per-slot reservation). Raises ValueError below one max-length sequence."""
    Tp, most = pages_needed(prompt_slots, config.max_new_tokens, config.page_size)
    fixed = 1 + prompts * Tp
    if not config.kv_bytes:
        return fixed + slots * most
    each = page_bytes(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, config.page_size,
                      jnp.dtype(dtype).itemsize)
    pages = config.kv_bytes // each
    if pages < fixed + most:
        raise ValueError(f"sampling.kv_cache_bytes={config.kv_bytes} holds {pages} pages of {each} bytes per row "
                         f"shard; the prompts take {fixed} and one sequence of max_new_tokens="
                         f"{config.max_new_tokens} up to {most}: raise it to at least {(fixed + most) * each}")
    return pages


def lockstep_fits(model, config: SamplingConfig, *, prompt_slots: int, lay: EngineLayout) -> bool:
    """Whether `sampling.kv_cache_bytes` (0: yes) holds what the lock-step loop keeps per row shard:
    every prompt's block and every sequence's max_new_tokens - 1 fed tokens (in whole attention
    phases), the per-slot reservation's cache with a slot per sequence."""
    if not config.kv_bytes:
        return True
    mc = model.config
    M1 = max(config.max_new_tokens - 1, 1)
    phases = max(1, min(config.attend_phases, M1))
    fed = -(-M1 // phases) * phases
    per_token = page_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, 1, jnp.dtype(model.dtype).itemsize)
    return config.kv_bytes >= per_token * (lay.prompts * prompt_slots + lay.sequences * fed)


def resume_paged(model, config: SamplingConfig, mesh: Mesh, st: PagedState) -> PagedLoop:
    """The loop's constants for a state started in an earlier call (`start_paged`), for a segment
    of the loop run in its own call (over-sampling's stream, episodes)."""
    lay = engine_layout(st.prompt_logits.shape[0] * st.prompt_logits.shape[1], config, mesh)
    return paged_loop(model, config, mesh, lay, st.cache)


def start_paged(model, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh: Mesh) -> tuple[PagedLoop, PagedState]:
    """Prefill the N prompts once each and admit each shard's first sequences. The cache: a page
    pool, or with `sampling.kv_cache_bytes: 0` and the gather path one max-length reservation per
    slot read in place (`engine.layouts.SlotPages`)."""
    M = config.max_new_tokens
    lay = engine_layout(ids_NP.shape[0], config, mesh)
    Z, Np, Rb, J = lay.shards, lay.prompts, lay.sequences, lay.slots
    P = ids_NP.shape[1]
    impl = choose_attention(config.paged_attention, model.config, model.dtype, config.page_size, mesh)
    last_NV, k_LNKPD, v_LNKPD, pmask_NP, ppos_NP, experts_NPLK = model.prefill_kv(ids_NP, mask_NP, with_routing=True,
        row_sharding=batch_sharding(mesh, 1))
    if not config.kv_bytes and impl == "gather":
        cache = SlotCache.create(k_LNKPD, v_LNKPD, pmask_NP, ppos_NP, shards=Z, slots=J, decode_steps=max(M - 1, 1),
                                 phases=config.attend_phases)
    else:
        pages = pool_pages(model.config, model.dtype, config, prompt_slots=P, prompts=Np, slots=J)
        cache = create_cache(k_LNKPD, v_LNKPD, pmask_NP, shards=Z, slots=J, pages=pages, page_size=config.page_size,
                             max_new_tokens=M, layout=LAYOUT_OF[impl])
    loop = paged_loop(model, config, mesh, lay, cache)
    hold = loop.hold
    rows_ZR = jnp.arange(Z * Rb, dtype=jnp.int32).reshape(Z, Rb)
    counts = {k: jnp.int32(0) for k in STATS if k not in ("prefill_rows", "pool_pages", "shards")}
    st = PagedState(seq=hold(jnp.full((Z, J), -1, jnp.int32)), stamp=hold(jnp.zeros((Z, J), jnp.int32)),
                    cache=jax.tree.map(hold, cache), pending=hold(jnp.ones((Z, Rb), jnp.bool_)),
                    started=hold(jnp.zeros((Z, Rb), jnp.bool_)),
                    prompt_logits=hold(last_NV.reshape(Z, Np, -1)),
                    logits=hold(jnp.zeros((Z, J, last_NV.shape[-1]), jnp.float32)),
                    uniforms=hold(sequence_uniforms(rng, rows_ZR, M)) if config.temperature > 0 else None,
                    admissions=jnp.zeros((Z,), jnp.int32), done=jnp.zeros((Z,), jnp.int32),
                    tokens=hold(jnp.full((Z, Rb, M), config.pad_id, jnp.int32)),
                    logprobs=hold(jnp.zeros((Z, Rb, M), jnp.float32)),
                    lengths=hold(jnp.zeros((Z, Rb), jnp.int32)), truncated=hold(jnp.zeros((Z, Rb), jnp.bool_)),
                    counts=counts, prompt_experts=jax.tree.map(lambda x: hold(x.reshape(Z, Np, *x.shape[1:])),
                                                               stored(experts_NPLK, model.config)),
                    experts=jax.tree.map(hold, expert_buffer(model.config, (Z, Rb, M))))
    return loop, admit(loop, st)


def paged_loop(model, config: SamplingConfig, mesh: Mesh, lay: EngineLayout, cache) -> PagedLoop:
    """The loop's constants for `cache`: a SlotCache is read in place (`SlotPages`); a page pool's
    layout says the attention (engine.pages.LAYOUT_OF)."""
    weights = model.layer_weights()
    if isinstance(cache, SlotCache):
        pages = SlotPages(decode=functools.partial(slot_decode_step, model, weights=weights, mesh=mesh))
    else:
        phases = max(1, min(config.attend_phases, cache.columns))
        columns = tuple(-(-cache.columns * (i + 1) // phases) for i in range(phases))
        impl = {layout: impl for impl, layout in LAYOUT_OF.items()}[cache.layout]
        pages = PoolPages(decode=functools.partial(paged_decode_step, model, weights=weights, phase_columns=columns,
                                                   impl=impl, mesh=mesh), phase_columns=columns)
    return PagedLoop(lay=lay, config=config, pages=pages, mesh=mesh)


def _engine(graphdef, state, ids_NP, mask_NP, rng, *, config: SamplingConfig, mesh: Mesh):
    model = nnx.merge(graphdef, state)
    lay = engine_layout(ids_NP.shape[0], config, mesh)
    if lay.slots >= lay.sequences and lockstep_fits(model, config, prompt_slots=ids_NP.shape[1], lay=lay):
        # Every sequence has a slot and the bytes hold the lock-step loop's cache (each sequence's
        # max_new_tokens): nothing to page, nothing to wait for. The lock-step loop draws the same
        # rollout, faster (it reads each prompt once per group). It has no pages: pool_pages 0.
        rollout, stats = every_sequence_at_once(model, ids_NP, mask_NP, rng, config=config, mesh=mesh)
        none = {k: jnp.int32(0) for k in ("preemptions", "recomputed_tokens", "page_steps", "pages_peak",
                                          "pool_pages")}
        return rollout, {**stats, **none, "shards": jnp.int32(lay.shards)}
    loop, st = start_paged(model, ids_NP, mask_NP, rng, config=config, mesh=mesh)
    st = drain_loop(loop, st)
    return paged_rollout(st, ids_NP, mask_NP)


def drain_loop(loop: PagedLoop, st: PagedState) -> PagedState:
    """The engine's loop to its end: `paged_step` while `_running`, at each width of `drain_widths`
    in turn, `compact_paged` moving the sequences in flight into the narrower slots between them."""
    widths = drain_widths(loop.lay.slots)
    for i, width in enumerate(widths):
        if width < loop.lay.slots:
            loop, st = compact_paged(loop, st, width)
        narrower = widths[i + 1] if i + 1 < len(widths) else 0
        st = jax.lax.while_loop(functools.partial(_running, loop, narrower), functools.partial(paged_step, loop), st)
    return st


DRAIN_HALVINGS, DRAIN_MIN_SLOTS = 1, 8


def drain_widths(slots: int) -> tuple[int, ...]:
    """The slots per shard the loop runs with, in turn: all of them, then (from `DRAIN_MIN_SLOTS`
    slots up, at most `DRAIN_HALVINGS` times) half as many, rounded up, once every queue is empty
    and no shard has more sequences in flight than that (`compact`): the drain at the end of a
    call, when the last long sequences run nearly alone, does not pay for the idle slots. Each
    width compiles its own decode step (SmolLM2's compile: 14 s without the drain, 28 s with one
    halving), so one halving only: a second one took utilisation on the long-tailed benchmark from
    91.5% to 94.9% but SmolLM2's compile to 55 s; below 8 slots the drain is too short to pay for a
    compile (benchmarks/RESULTS.md)."""
    widths = [slots]
    while slots >= DRAIN_MIN_SLOTS and len(widths) <= DRAIN_HALVINGS:
        widths.append(-(-widths[-1] // 2))
    return tuple(widths)


def _running(loop: PagedLoop, narrower: int, st: PagedState) -> jax.Array:
    """Go on at this width: sequences are left, and (when a `narrower` width follows) some are still
    waiting or some shard has more than `narrower` in flight (`drain_widths`)."""
    left = jnp.any(st.done < loop.lay.sequences)
    if not narrower:
        return left
    return left & (jnp.any(st.pending) | (jnp.max(jnp.sum(st.seq >= 0, axis=1)) > narrower))


def compact_paged(loop: PagedLoop, st: PagedState, width: int) -> tuple[PagedLoop, PagedState]:
    """The drain: every shard's sequences in flight (at most `width`) into its first `width` slots
    (`pages.compact`: a pool's table rows, or a reservation's blocks)."""
    keep_Zw = jnp.argsort(st.seq < 0, axis=1, stable=True)[:, :width]  # busy slots first, in order

    def take(x_ZJ):
        return jax.vmap(lambda a, i: a[i])(x_ZJ, keep_Zw)

    cache = jax.tree.map(loop.hold, loop.pages.compact(st.cache, take))
    loop = dataclasses.replace(loop, lay=dataclasses.replace(loop.lay, slots=width))
    hold = loop.hold
    return loop, st.replace(seq=hold(take(st.seq)), stamp=hold(take(st.stamp)), cache=cache,
                            logits=hold(take(st.logits)))


def rollout_experts(st) -> dict:
    """A loop state's experts as the Rollout's fields:
    prompt_experts [N, P, L, Kx], experts [R, M, L, Kx] (0 where no token was fed); {} for a dense model."""
    if st.experts is None:
        return {}
    Z, Rb, M = st.tokens.shape
    p = st.prompt_experts
    return {"prompt_experts": p.reshape(-1, *p.shape[2:]),
            "experts": fed_only(st.experts.reshape(Z * Rb, M, *st.experts.shape[3:]), st.lengths.reshape(Z * Rb))}


def pool_of(cache: PagedCache | SlotCache) -> int:
    """Pages a cache's pool has per shard (0: one reservation per slot)."""
    return 0 if isinstance(cache, SlotCache) else cache.pool


def paged_rollout(st: PagedState, ids_NP, mask_NP) -> tuple[Rollout, dict]:
    """The loop state's outputs as a Rollout (row r = sequence r of the call) and the stats."""
    Z, Rb, M = st.tokens.shape
    lengths_R = st.lengths.reshape(Z * Rb)
    mask_RM = (jnp.arange(M)[None] < lengths_R[:, None]).astype(jnp.int32)
    rollout = Rollout(tokens=st.tokens.reshape(-1, M), logprobs=st.logprobs.reshape(-1, M), mask=mask_RM,
                      lengths=lengths_R, truncated=st.truncated.reshape(-1), prompt_ids=ids_NP, prompt_mask=mask_NP,
                      **rollout_experts(st))
    return rollout, {**st.counts, "prefill_rows": jnp.int32(ids_NP.shape[0]), "pool_pages": jnp.int32(pool_of(st.cache)),
                     "shards": jnp.int32(Z)}


def paged_step(loop: PagedLoop, st: PagedState) -> PagedState:
    """One step: draw, record, free the finished sequences' pages, take pages (preempting when
    short), decode the continuing slots, admit waiting sequences."""
    hold, Rb = loop.hold, loop.lay.sequences
    seq_ZJ = st.seq
    z_Z1 = jnp.arange(seq_ZJ.shape[0], dtype=jnp.int32)[:, None]
    active_ZJ, t_ZJ = seq_ZJ >= 0, st.cache.slot_t
    tok_ZJ, finished_ZJ, (tokens, logprobs, lengths, truncated) = draw_and_record(loop, st)

    pages = loop.pages
    cache = pages.free(st.cache, finished_ZJ)
    going_ZJ = active_ZJ & ~finished_ZJ
    cache, write_ZJ, preempted_ZJ = pages.take(st.stamp, cache, going_ZJ, going_ZJ)
    going_ZJ = going_ZJ & ~preempted_ZJ
    logits_ZJV, cache, experts_ZJLK = pages.feed(tok_ZJ, cache, going_ZJ, write_ZJ)
    cache = cache.replace(slot_t=jnp.where(going_ZJ, cache.slot_t, 0))

    requeue_ZJ = jnp.where(preempted_ZJ, seq_ZJ, Rb)
    counts = count_step(st.counts, pages.held(cache), active_ZJ, active_ZJ, preempted_ZJ, t_ZJ + 1)
    st = st.replace(seq=hold(jnp.where(going_ZJ, seq_ZJ, -1)), cache=jax.tree.map(hold, cache),
                    pending=hold(st.pending.at[z_Z1, requeue_ZJ].set(True, mode="drop")),
                    logits=hold(logits_ZJV), done=st.done + finished_ZJ.sum(axis=1, dtype=jnp.int32),
                    tokens=hold(tokens), logprobs=hold(logprobs), lengths=hold(lengths), truncated=hold(truncated),
                    counts=counts, experts=record(st.experts, experts_ZJLK, seq_ZJ, t_ZJ, going_ZJ))
    return admit(loop, st)


def count_step(c: dict, held: jax.Array, active_ZJ, useful_ZJ, preempted_ZJ, lost_ZJ) -> dict:
    """The stats after a step: `held` pages per shard (`pages.held`); `useful` slots drew a token;
    `lost`: tokens a preempted slot's sequence will recompute."""
    return {**c, "steps": c["steps"] + 1, "slot_steps": c["slot_steps"] + active_ZJ.size,
            "useful_slot_steps": c["useful_slot_steps"] + useful_ZJ.sum(dtype=jnp.int32),
            "preemptions": c["preemptions"] + preempted_ZJ.sum(dtype=jnp.int32),
            "recomputed_tokens": c["recomputed_tokens"] + jnp.where(preempted_ZJ, lost_ZJ, 0).sum(dtype=jnp.int32),
            "page_steps": c["page_steps"] + held.sum(dtype=jnp.int32),
            "pages_peak": jnp.maximum(c["pages_peak"], held.max())}


def admit(loop: PagedLoop, st: PagedState, blocked_ZR=None) -> PagedState:
    """Fill the free slots with waiting sequences, lowest row first, while the pool keeps a page for
    each admission (its first page at the next step) and one for each running sequence (at most
    what it takes in the next page_size steps): admission does not run the pool dry at once, so
    fewer sequences are preempted and recomputed than with a bare one-step reserve. `blocked_ZR`
    (bool [Z, Rb]): waiting rows not admitted now (episodes waiting on their environment)."""
    hold, Rb = loop.hold, loop.lay.sequences
    Z, J = st.seq.shape
    z_Z1 = jnp.arange(Z, dtype=jnp.int32)[:, None]
    running_ZJ = st.seq >= 0
    ready_ZR = st.pending if blocked_ZR is None else st.pending & ~blocked_ZR
    allowed_Z = jnp.minimum(loop.pages.room(st.cache, running_ZJ.sum(axis=1)), ready_ZR.sum(axis=1))
    rank_ZJ = jnp.cumsum(~running_ZJ, axis=1, dtype=jnp.int32) - 1
    take_ZJ = ~running_ZJ & (rank_ZJ < allowed_Z[:, None])
    if loop.pages.preempts or blocked_ZR is not None:
        order_ZR = jnp.argsort(~ready_ZR, axis=1, stable=True)  # waiting rows first, in row order
        row_ZJ = jnp.take_along_axis(order_ZR, jnp.clip(rank_ZJ, 0, Rb - 1), axis=1)
    else:  # nothing is ever preempted: the rows wait in order, and the k-th admission is row k
        row_ZJ = jnp.minimum(st.admissions[:, None] + rank_ZJ, Rb - 1)
    st = seat(st, take_ZJ, row_ZJ, loop.config.group_size)
    at_ZJ = jnp.where(take_ZJ, row_ZJ, Rb)
    st = st.replace(pending=st.pending.at[z_Z1, at_ZJ].set(False, mode="drop"),
                    started=st.started.at[z_Z1, at_ZJ].set(True, mode="drop"))
    return st.replace(seq=hold(st.seq), stamp=hold(st.stamp), cache=jax.tree.map(hold, st.cache),
                      pending=hold(st.pending), started=hold(st.started), logits=hold(st.logits))


def seat(st: PagedState, take_ZJ, row_ZJ, group_size: int) -> PagedState:
    """Slots `take_ZJ` (empty) start sequence `row_ZJ` from its first token: its prompt's pages in
    its table (a pool), its prompt's logits to draw from, a new (youngest) stamp."""
    prompt_ZJ = jnp.where(take_ZJ, row_ZJ // group_size, st.cache.slot_prompt)
    cache = seat_pages(st.cache, take_ZJ, prompt_ZJ)
    first_ZJV = jax.vmap(lambda a, i: a[i])(st.prompt_logits, prompt_ZJ)
    stamp_ZJ = st.admissions[:, None] + jnp.cumsum(take_ZJ, axis=1, dtype=jnp.int32) - 1
    return st.replace(seq=jnp.where(take_ZJ, row_ZJ, st.seq), stamp=jnp.where(take_ZJ, stamp_ZJ, st.stamp),
                      cache=cache, logits=jnp.where(take_ZJ[..., None], first_ZJV, st.logits),
                      admissions=st.admissions + take_ZJ.sum(axis=1, dtype=jnp.int32))
