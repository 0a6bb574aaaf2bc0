"""The static engine's key/value cache: built by `Transformer.prefill`, read and written by
`Transformer.decode_step`, carried by the sampler's lock-step decode loop (the paged engine's
cache, with per-slot blocks, is `models.slots.SlotCache`).

Slots. Row r's slot s holds the s-th input of that row, padding included: the P (left-padded)
prompt slots, then one slot per decode step. The slots live in separate buffers, one per layer and
block, so that a decode step writes one slot of one buffer in place and reads whole buffers only:
XLA:CPU copies a slice of a larger buffer (a layer of a stacked [L, ...] cache, say) before a matmul
reads it, and such copies were most of an older decode loop's time. The blocks:
- the prompt block, written once by the prefill. When G rows sample from one prompt (row i*G + j is
  sample j of prompt i) it holds one copy per prompt, N = R / G rows, and attention reads it once per
  group of G rows: prefill cost and prompt memory do not grow with G.
- `num_chunks` chunks of C generated slots, one copy per row. Decode step t (0-based) writes slot
  P + t overall, slot t - c*C of chunk c = t // C. A step in chunk c attends the prompt block and
  chunks 0..c only, so early steps do not pay for the whole capacity.

Shape letters: grpo_jax.shapes (here N is the prompt block's rows, one per prompt, and
S = P + num_chunks * C). Keys are stored [rows, K, D, slots] (slots minor, so one query's
scores are a batched matmul with no transpose), values [rows, K, slots, D]. Per row and slot,
`mask` says the slot holds a real token and `pos` is its rotary position (for sliding windows);
`next_pos` is the rotary position of the row's next token, so left padding never shifts positions.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


class ChunkedKeys:
    """Generated keys and values held as `keys`/`values` tuples of chunk buffers of C slots each
    (chunk c attends only once the decode reaches it): what the sampler's KVCache and the
    paged engine's per-slot SlotCache (grpo_jax.engine.slots) share."""

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    @property
    def chunk_size(self) -> int:
        """Generated slots per chunk buffer (C)."""
        return self.keys[0][0].shape[-1]

    @property
    def capacity(self) -> int:
        """Fed tokens (decode steps) a row can hold."""
        return self.num_chunks * self.chunk_size


@flax.struct.dataclass
class KVCache(ChunkedKeys):
    """Keys/values of a prefilled prompt batch and its decode steps (layout in the module docstring).

    Build it with `Transformer.prefill` (or `from_prefill`); `Transformer.decode_step` writes one
    slot per call. A pytree: carry it through jit and `lax.while_loop`, and donate it.
    """

    prompt_keys: tuple[jax.Array, ...]  # L x [N, K, D, P]
    prompt_values: tuple[jax.Array, ...]  # L x [N, K, P, D]
    keys: tuple[tuple[jax.Array, ...], ...]  # num_chunks x L x [R, K, D, C]
    values: tuple[tuple[jax.Array, ...], ...]  # num_chunks x L x [R, K, C, D]
    mask: jax.Array  # bool [R, S]: the slot holds a real (non-padding) token
    pos: jax.Array  # int32 [R, S]: rotary position of the slot's token
    next_pos: jax.Array  # int32 [R]
    length: jax.Array  # int32 []: decode steps written so far

    @classmethod
    def from_prefill(cls, keys: jax.Array, values: jax.Array, attention_mask: jax.Array, positions: jax.Array, *,
                     group_size: int = 1, decode_steps: int, chunks: int = 1) -> KVCache:
        """The cache of a prefilled prompt batch, with room for `decode_steps` decode steps.

        keys, values: [L, N, K, P, D], the prefill's per-layer keys/values of N prompts;
        attention_mask: [N, P] (1 = real token); positions: int [N, P]. The cache has R = N *
        `group_size` rows (row i*G + j decodes from prompt i) and splits the generated slots into
        `chunks` chunks (fewer when there are fewer steps than chunks).
        """
        L, N, K, P, D = keys.shape
        if attention_mask.shape != (N, P) or positions.shape != (N, P) or values.shape != keys.shape:
            raise ValueError(f"prefill outputs disagree: keys {keys.shape}, values {values.shape}, "
                             f"mask {attention_mask.shape}, positions {positions.shape}")
        if group_size < 1 or decode_steps < 0 or chunks < 1:
            raise ValueError(f"need group_size >= 1, decode_steps >= 0, chunks >= 1; got {group_size}, "
                             f"{decode_steps}, {chunks}")
        chunks = max(1, min(chunks, decode_steps))
        C = max(1, -(-decode_steps // chunks))
        R = N * group_size
        mask_NP = attention_mask.astype(jnp.bool_)
        return cls(
            prompt_keys=tuple(keys[l].transpose(0, 1, 3, 2) for l in range(L)),
            prompt_values=tuple(values[l] for l in range(L)),
            keys=tuple(tuple(jnp.zeros((R, K, D, C), keys.dtype) for _ in range(L)) for _ in range(chunks)),
            values=tuple(tuple(jnp.zeros((R, K, C, D), values.dtype) for _ in range(L)) for _ in range(chunks)),
            mask=jnp.concatenate([jnp.repeat(mask_NP, group_size, axis=0), jnp.zeros((R, chunks * C), jnp.bool_)], 1),
            pos=jnp.concatenate([jnp.repeat(positions.astype(jnp.int32), group_size, axis=0),
                                 jnp.zeros((R, chunks * C), jnp.int32)], 1),
            next_pos=jnp.repeat(mask_NP.sum(axis=1, dtype=jnp.int32), group_size),
            length=jnp.zeros((), jnp.int32),
        )

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def group_size(self) -> int:
        """Rows per prompt-block row (G when the prompt block is shared by each group)."""
        return self.rows // self.prompt_keys[0].shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_keys[0].shape[-1]

    def chunk_of(self, step: int) -> int:
        """The chunk that decode step `step` (0-based) writes: static, since it bounds attention."""
        if not 0 <= step < self.capacity:
            raise ValueError(f"decode step {step} is outside this cache's {self.capacity} decode slots")
        return step // self.chunk_size

    def open_slot(self) -> KVCache:
        """Mark slot P + length as a real token at each row's next position (before attending it)."""
        slot = self.prompt_len + self.length
        ones = jnp.ones((self.rows, 1), jnp.bool_)
        return self.replace(mask=jax.lax.dynamic_update_slice(self.mask, ones, (0, slot)),
                            pos=jax.lax.dynamic_update_slice(self.pos, self.next_pos[:, None], (0, slot)))

    def slot_in_chunk(self, chunk: int) -> jax.Array:
        """Where the current step's key/value goes in chunk `chunk` (int32 scalar)."""
        return self.length - chunk * self.chunk_size

    def close_slot(self, chunk: int, keys: tuple[jax.Array, ...], values: tuple[jax.Array, ...]) -> KVCache:
        """The cache after a decode step that wrote `keys`/`values` (L buffers each) as chunk `chunk`'s."""
        return self.replace(keys=_set(self.keys, chunk, keys), values=_set(self.values, chunk, values),
                            next_pos=self.next_pos + 1, length=self.length + 1)


def write_slot(keys_RKDC: jax.Array, values_RKCD: jax.Array, slot: jax.Array, k_RKD: jax.Array,
               v_RKD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write one layer's new key/value [R, K, D] at slot `slot` of its chunk buffers (in place in a loop)."""
    R, K, D = k_RKD.shape
    keys_RKDC = jax.lax.dynamic_update_slice(keys_RKDC, k_RKD.reshape(R, K, D, 1).astype(keys_RKDC.dtype),
                                             (0, 0, 0, slot))
    values_RKCD = jax.lax.dynamic_update_slice(values_RKCD, v_RKD.reshape(R, K, 1, D).astype(values_RKCD.dtype),
                                               (0, 0, slot, 0))
    return keys_RKDC, values_RKCD


def _set(items: tuple, i: int, value) -> tuple:
    return items[:i] + (value,) + items[i + 1:]
