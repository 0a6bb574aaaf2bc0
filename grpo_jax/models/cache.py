"""The explicit key/value cache for incremental decoding.

Layout: slot s of row b holds the token that was the s-th input of that row, padding included, so a
left-padded prompt batch and all its decode steps share one write index. `mask_BS` says which
slots hold real tokens; `next_pos_B` is the rotary position the row's next real token gets, so left
padding never shifts positions.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from grpo_jax.models.config import TransformerConfig


@flax.struct.dataclass
class KVCache:
    k_LBKSD: jax.Array
    v_LBKSD: jax.Array
    mask_BS: jax.Array  # bool: the slot holds a real (non-padding) token
    pos_BS: jax.Array  # int32 rotary position of the slot's token (for sliding-window masks)
    next_pos_B: jax.Array  # int32
    index: jax.Array  # int32 scalar: the next slot to write

    @classmethod
    def init(cls, config: TransformerConfig, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
        """An empty cache for `batch` rows of up to `capacity` tokens (prompt + generated)."""
        # kv-head-major so that attention is a batched matmul over (row, kv head) with no transposes.
        shape = (config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim)
        return cls(
            k_LBKSD=jnp.zeros(shape, dtype),
            v_LBKSD=jnp.zeros(shape, dtype),
            mask_BS=jnp.zeros((batch, capacity), jnp.bool_),
            pos_BS=jnp.zeros((batch, capacity), jnp.int32),
            next_pos_B=jnp.zeros((batch,), jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.mask_BS.shape[1]

    @property
    def batch(self) -> int:
        return self.mask_BS.shape[0]
