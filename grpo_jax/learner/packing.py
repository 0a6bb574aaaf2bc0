"""Sequence packing for the learner's passes (`train.packing`): a step's rows, each a prompt and a
completion of its own length, laid end to end in fixed-length bins instead of each padded to the
longest, so the passes' tokens are the batch's real tokens (plus a bin's tail).

The plan is made on the host (`plan_packing`, first-fit decreasing per micro-batch and device) and
travels with the batch as four int32 numbers per row (`PackRows`): which bin, where its prompt and
its completion start, how long the completion is. On device, inside the step, `packed_logprobs`
scatters the rows' tokens into their bins, runs the model once over the bins with segment ids and
positions that restart per sequence (`Transformer.hidden_states(segment_ids=, parent_ids=)`), and
gathers each completion token's log-prob and entropy back to the batch's [R, M] layout, so the
loss, advantages, KL and every metric are computed per original sequence by the unchanged code.

Shared prompts: with `shared` (the batch's groups share their prompt, `train.shared_prompt`, and
the attention implementation can express it), a group's prompt is laid once per bin that holds
any of its completions; each completion is its own segment whose parent is its prompt's
(`models.layers.attention`: it sees its prompt and its own earlier tokens, not its siblings').
Splash attention compares segment ids only, so under it every completion carries its own copy.

Bin layout (one bin): for each group in order of first placement, its prompt's real tokens (once
when shared) and then its completions' tokens; a sequence's segment id is its first token's offset
+ 1 (unique in the bin; 0 marks the unused tail).

Shape letters: grpo_jax.shapes (R rows, P prompt slots, M completion tokens; a packed pass's B bins
of T tokens each).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.learner.logprobs import chunked_logprobs


@flax.struct.dataclass
class PackRows:
    """Where each of a batch's R rows sits in its micro-batch's bins (`plan_packing`); a row whose
    completion is empty is not placed (bin -1: its log-probs are 0, and its mask is 0)."""

    bin: jax.Array  # int32 [R]: the bin, among its micro-batch's `bins`
    prompt_start: jax.Array  # int32 [R]: the offset of its prompt's first real token in the bin
    completion_start: jax.Array  # int32 [R]: the offset of its completion's first token
    completion_len: jax.Array  # int32 [R]: its completion's tokens (through the last one the mask counts)
    bins: int = flax.struct.field(pytree_node=False, default=1)  # bins per micro-batch, as the pass sees them
    length: int = flax.struct.field(pytree_node=False, default=1)  # tokens per bin (train.pack_length)
    shared: bool = flax.struct.field(pytree_node=False, default=False)  # a group's prompt once per bin


@dataclasses.dataclass(frozen=True)
class Plan:
    """A host-side packing plan: the rows' `PackRows` fields as NumPy arrays, and how full the bins are."""

    rows: PackRows
    tokens: int  # the tokens the bins hold (prompts once per bin when shared)
    capacity: int  # bins x length over every micro-batch and shard

    @property
    def fill(self) -> float:
        return self.tokens / max(self.capacity, 1)


def row_lengths(prompt_mask: np.ndarray, completion_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens [R], completion tokens [R]) of a batch's masks: a prompt's real tokens (it is
    left-padded); a completion's tokens through the last one its mask counts (an episode's
    environment tokens in between are tokens of the row, masked out of the loss)."""
    prompt_mask, completion_mask = np.asarray(prompt_mask), np.asarray(completion_mask)
    M = completion_mask.shape[1]
    any_ = completion_mask.any(axis=1)
    last = M - np.argmax(completion_mask[:, ::-1] != 0, axis=1)
    return prompt_mask.sum(axis=1).astype(np.int64), np.where(any_, last, 0).astype(np.int64)


def plan_packing(prompt_len: np.ndarray, completion_len: np.ndarray, *, length: int, shards: int = 1,
                 micro_batches: int = 1, unit: int = 1, group_size: int = 1, shared: bool = False,
                 local_bins: bool = False) -> Plan:
    """First-fit-decreasing bins of `length` tokens for each (micro-batch, shard) of R rows.

    The rows a pass sees together are those of one micro-batch on one shard: the batch's rows are
    split over `shards` in contiguous blocks (the mesh's data x fsdp x expert, or pmap's devices), and each
    block into `micro_batches` interleaved runs of `unit` rows (`micro_batches.split_micro_batches`).
    Each such set is packed on its own into the same number of bins (the most any set needs, rounded
    up to a sixteenth of its rows to bound the compiled shapes): under jit a micro-batch's bins are those of
    all its shards, shard-major (a row's bin is shard x bins + its own), under pmap
    (`local_bins`) each device's alone. `shared`: rows i*G .. i*G+G-1 (G = `group_size`) share one
    prompt, laid once per bin. A sequence longer than a bin is refused, never truncated."""
    prompt_len, completion_len = np.asarray(prompt_len, np.int64), np.asarray(completion_len, np.int64)
    R = len(prompt_len)
    if R % (shards * micro_batches * unit):
        raise ValueError(f"{R} rows do not split into {shards} shards x train.micro_batches={micro_batches} "
                         f"x runs of {unit}")
    too_long = np.flatnonzero(prompt_len + completion_len > length)
    if too_long.size:
        r = int(too_long[np.argmax((prompt_len + completion_len)[too_long])])
        raise ValueError(f"row {r} has {prompt_len[r]} prompt + {completion_len[r]} completion tokens = "
                         f"{prompt_len[r] + completion_len[r]}, more than a bin holds (train.pack_length={length}); "
                         f"raise train.pack_length to at least {prompt_len[r] + completion_len[r]} (sequences are "
                         "never truncated)")
    share = shared and group_size > 1
    per_shard = R // shards
    placed: list[tuple[int, list[tuple[int, int, int]]]] = []  # per (m, d): bins of (row, prompt, completion)
    tokens = 0
    for m in range(micro_batches):
        for d in range(shards):
            local = np.arange(per_shard)
            rows = d * per_shard + local[(local // unit) % micro_batches == m]
            bins, used = _first_fit(rows, prompt_len, completion_len, length, group_size, share)
            placed.append((len(bins), bins))
            tokens += sum(used)
    need = max((n for n, _ in placed), default=1)
    per_set = max(per_shard // micro_batches, 1)
    # Rounded up to a sixteenth of the rows: at most 16 compiled shapes, at most 1/16 of them idle.
    step = -(-per_set // 16)
    bins_per_set = min(max(-(-need // step) * step, 1), per_set)
    fields = {k: np.full(R, -1 if k == "bin" else 0, np.int32)
              for k in ("bin", "prompt_start", "completion_start", "completion_len")}
    for i, (_, bins) in enumerate(placed):
        d = i % shards
        for b, layout in enumerate(bins):
            for row, p0, c0 in layout:
                fields["bin"][row] = b if local_bins else d * bins_per_set + b
                fields["prompt_start"][row], fields["completion_start"][row] = p0, c0
                fields["completion_len"][row] = completion_len[row]
    bins = bins_per_set if local_bins else shards * bins_per_set
    return Plan(rows=PackRows(**fields, bins=bins, length=length, shared=share), tokens=int(tokens),
                capacity=micro_batches * shards * bins_per_set * length)


def _first_fit(rows, prompt_len, completion_len, length: int, group_size: int, share: bool):
    """Rows (longest completion first, ties by row) into bins, each into the first bin that holds
    its group's prompt and has room for the completion, else the first with room for both (shared
    prompts), else a new bin -> (per bin: (row, prompt start, completion start) for its rows, the
    tokens each bin holds)."""
    order = sorted((int(r) for r in rows if completion_len[r] > 0), key=lambda r: (-completion_len[r], r))
    contents: list[list[int]] = []
    used: list[int] = []
    groups: list[set[int]] = []
    for r in order:
        g = r // group_size
        # A bin that already holds the group's prompt first (the completion alone), then any bin.
        fits = [b for b in range(len(contents)) if share and g in groups[b]
                and used[b] + completion_len[r] <= length]
        fits += [b for b in range(len(contents)) if used[b] + completion_len[r] + prompt_len[r] <= length]
        if fits:
            b = fits[0]
            cost = completion_len[r] + (0 if share and g in groups[b] else prompt_len[r])
        else:
            contents.append([])
            used.append(0)
            groups.append(set())
            b, cost = len(contents) - 1, completion_len[r] + prompt_len[r]
        contents[b].append(r)
        used[b] += int(cost)
        groups[b].add(g)
    return [_lay_out(c, prompt_len, completion_len, group_size, share) for c in contents], used


def _lay_out(rows: list[int], prompt_len, completion_len, group_size: int, share: bool):
    """One bin's offsets: per group in order of first placement, its prompt (once when shared) and
    its completions; without sharing each row is its prompt then its completion."""
    out, at = [], 0
    if not share:
        for r in rows:
            out.append((r, at, at + int(prompt_len[r])))
            at += int(prompt_len[r] + completion_len[r])
        return out
    by_group: dict[int, list[int]] = {}
    for r in rows:
        by_group.setdefault(r // group_size, []).append(r)
    for members in by_group.values():
        p0 = at
        at += int(prompt_len[members[0]])
        for r in members:
            out.append((r, p0, at))
            at += int(completion_len[r])
    return out


def pack_batch(batch, *, length: int, shards: int, micro_batches: int, unit: int, group_size: int, shared: bool,
               local_bins: bool = False, place=None):
    """`batch` (a train_step.Batch) with its packing plan (`Batch.packing`), made from its masks on
    the host -> (batch, the plan's fill: the share of the bins' tokens that are real). `place`: puts
    the plan's arrays where the batch's rows live (jit: split over the mesh's rows)."""
    prompt_len, completion_len = row_lengths(batch.prompt_mask, batch.completion_mask)
    plan = plan_packing(prompt_len, completion_len, length=length, shards=shards, micro_batches=micro_batches,
                        unit=unit, group_size=group_size, shared=shared, local_bins=local_bins)
    rows = plan.rows if place is None else place(plan.rows)
    return batch.replace(packing=rows), plan.fill


def _bin_layout(pack: PackRows, prompt_ids, prompt_mask, completion_ids):
    """The bins' tokens, segment ids, parent ids (None without sharing) and positions, int32 [B, T],
    scattered from the rows' prompts [R, P] (left-padded) and completions [R, M]."""
    B, T = pack.bins, pack.length
    R, P = prompt_ids.shape
    M = completion_ids.shape[1]
    plen_R = prompt_mask.astype(jnp.int32).sum(axis=1)
    placed_R = pack.bin >= 0
    base_R = jnp.where(placed_R, pack.bin, 0) * T
    drop = B * T  # an index past the end: `mode="drop"` writes nothing there
    j_P = jnp.arange(P, dtype=jnp.int32)
    prompt_pos_RP = j_P[None] - (P - plen_R)[:, None]  # the real tokens' positions 0 .. len - 1
    prompt_at_RP = jnp.where((prompt_pos_RP >= 0) & placed_R[:, None],
                             base_R[:, None] + pack.prompt_start[:, None] + prompt_pos_RP, drop)
    t_M = jnp.arange(M, dtype=jnp.int32)
    comp_at_RM = jnp.where((t_M[None] < pack.completion_len[:, None]) & placed_R[:, None],
                           base_R[:, None] + pack.completion_start[:, None] + t_M[None], drop)
    prompt_seg_R = pack.prompt_start + 1
    comp_seg_R = pack.completion_start + 1 if pack.shared else prompt_seg_R

    def scatter(prompt_vals, comp_vals):
        flat = jnp.zeros((B * T,), jnp.int32)
        flat = flat.at[prompt_at_RP.reshape(-1)].set(prompt_vals.reshape(-1).astype(jnp.int32), mode="drop")
        flat = flat.at[comp_at_RM.reshape(-1)].set(comp_vals.reshape(-1).astype(jnp.int32), mode="drop")
        return flat.reshape(B, T)

    ids_BT = scatter(prompt_ids, completion_ids)
    seg_BT = scatter(jnp.broadcast_to(prompt_seg_R[:, None], (R, P)), jnp.broadcast_to(comp_seg_R[:, None], (R, M)))
    pos_BT = scatter(prompt_pos_RP, plen_R[:, None] + t_M[None])
    parent_BT = None
    if pack.shared:
        parent_BT = scatter(jnp.zeros((R, P), jnp.int32), jnp.broadcast_to(prompt_seg_R[:, None], (R, M)))
    return ids_BT, seg_BT, parent_BT, pos_BT, plen_R


def packed_logprobs(model, pack: PackRows, prompt_ids: jax.Array, prompt_mask: jax.Array, completion_ids: jax.Array,
                    *, chunk: int = 128, temperature: float = 1.0, dropout_key: jax.Array | None = None,
                    row_sharding=None) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies float32 [R, M] of each completion token (int [R, M]) given its prompt
    (int [R, P], left-padded, prompt_mask [R, P]) and the tokens before it, computed over the rows'
    bins (`pack`); what `logprobs.completion_logprobs` gives unpacked, up to float rounding. A token
    past a row's completion gets 0. `dropout_key`, `row_sharding`: as `completion_states`'."""
    B, T = pack.bins, pack.length
    ids_BT, seg_BT, parent_BT, pos_BT, plen_R = _bin_layout(pack, prompt_ids, prompt_mask, completion_ids)
    h_BTE = model.hidden_states(ids_BT, positions=pos_BT, segment_ids=seg_BT, parent_ids=parent_BT,
                                dropout_key=dropout_key, row_sharding=row_sharding)
    R, M = completion_ids.shape
    placed_R = pack.bin >= 0
    base_R = jnp.where(placed_R, pack.bin, 0) * T
    # Token t >= 1 is predicted at the bin position before it; its target is laid there.
    t_M = jnp.arange(M, dtype=jnp.int32)
    next_ok_RM = (t_M[None] >= 1) & (t_M[None] < pack.completion_len[:, None]) & placed_R[:, None]
    pred_at_RM = base_R[:, None] + pack.completion_start[:, None] + t_M[None] - 1
    targets = jnp.zeros((B * T,), jnp.int32).at[jnp.where(next_ok_RM, pred_at_RM, B * T).reshape(-1)].set(
        completion_ids.reshape(-1).astype(jnp.int32), mode="drop").reshape(B, T)
    logp_BT, ent_BT = chunked_logprobs(h_BTE, targets, model.logits, chunk=chunk, temperature=temperature)
    # Token 0 is predicted at its prompt's last position, which a shared prompt's siblings share:
    # those R states are scored on their own.
    last_R = base_R + pack.prompt_start + jnp.maximum(plen_R, 1) - 1
    h_R1E = h_BTE.reshape(B * T, -1)[last_R][:, None]
    logp0_R1, ent0_R1 = chunked_logprobs(h_R1E, completion_ids[:, :1], model.logits, chunk=1, temperature=temperature)
    at_RM = jnp.where(next_ok_RM, pred_at_RM, 0)
    first_RM = (t_M[None] == 0) & (pack.completion_len[:, None] > 0) & placed_R[:, None]

    def unpack(x_BT, x0_R1):
        x_RM = x_BT.reshape(-1)[at_RM]
        return jnp.where(first_RM, x0_R1, jnp.where(next_ok_RM, x_RM, 0.0))

    return unpack(logp_BT, logp0_R1), unpack(ent_BT, ent0_R1)
