"""`IndexSampler`: the checkpointable, per-process order in which records are read."""

from __future__ import annotations

from typing import Any

from grpo_jax.data._rng import StableRandom

# State keys that describe the sampler itself: a checkpoint only fits a sampler that agrees on them.
_IDENTITY = ("num_records", "seed", "shuffle", "process_index", "process_count", "block", "drop_remainder")


class IndexSampler:
    """Record indices in a shuffled order, epoch after epoch, without end.

    Each epoch is a permutation of range(num_records) seeded by (seed, epoch), so an epoch's
    order depends on nothing else and a run restored from `state_dict()` reads exactly the
    indices an uninterrupted run would. With several processes the permutation is cut into
    blocks of `block` indices dealt out in turn: process p takes blocks p, p + process_count,
    p + 2 * process_count, ... The shards are disjoint and together cover the epoch. With
    `block` = each process's share of a batch, the batch the processes read together (process 0's
    block, then process 1's, ...) is exactly the one a single process reads, so a multi-host run
    sees the same prompts in the same rows as a one-host run. `block=1` deals single indices.
    `drop_remainder=True` drops the last `num_records % (process_count * block)` indices of each
    (reshuffled) epoch so that every process has the same epoch length and processes cross epoch
    boundaries together.

    process_index / process_count: explicit values (default: a single process); pass None to
    read `jax.process_index()` / `jax.process_count()`.
    """

    def __init__(
        self,
        num_records: int,
        *,
        seed: int,
        shuffle: bool = True,
        process_index: int | None = 0,
        process_count: int | None = 1,
        block: int = 1,
        drop_remainder: bool = True,
    ):
        if process_index is None or process_count is None:
            import jax  # only when asked to: the sampler itself has no use for JAX

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if num_records < 1:
            raise ValueError(f"num_records must be >= 1, got {num_records}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        if drop_remainder and num_records < process_count * block:
            raise ValueError(
                f"{num_records} records cannot give each of {process_count} processes a block of {block} "
                "with drop_remainder=True; use more records or drop_remainder=False"
            )
        self.num_records = int(num_records)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.block = int(block)
        self.drop_remainder = bool(drop_remainder)
        self.epoch = 0
        self.position = 0  # indices of the current epoch's shard already returned
        self._cached: tuple[int, list[int]] | None = None

    def epoch_indices(self, epoch: int) -> list[int]:
        """This process's indices for `epoch`, in reading order."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        order = list(range(self.num_records))
        if self.shuffle:
            StableRandom("IndexSampler", self.seed, epoch).shuffle(order)
        span, b = self.process_count * self.block, self.block
        if self.drop_remainder:
            order = order[: self.num_records - self.num_records % span]
        first = self.process_index * b
        shard = [i for k in range(0, len(order), span) for i in order[k + first : k + first + b]]
        self._cached = (epoch, shard)
        return shard

    @property
    def epoch_size(self) -> int:
        """Indices this process reads per epoch (the same every epoch)."""
        span = self.process_count * self.block
        full = self.num_records // span * self.block
        if self.drop_remainder:
            return full
        rest = self.num_records % span - self.process_index * self.block
        return full + min(max(rest, 0), self.block)

    def next(self, n: int) -> list[int]:
        """The next n indices, crossing into new (reshuffled) epochs as needed."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            shard = self.epoch_indices(self.epoch)
            take = shard[self.position : self.position + n - len(out)]
            out.extend(take)
            self.position += len(take)
            if self.position == len(shard):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools (JSON- and orbax-friendly)."""
        return {"epoch": self.epoch, "position": self.position, **{k: getattr(self, k) for k in _IDENTITY}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; it must come from a sampler with the same settings."""
        missing = [k for k in ("epoch", "position", *_IDENTITY) if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; got keys {sorted(state)}")
        different = {k: (state[k], getattr(self, k)) for k in _IDENTITY if state[k] != getattr(self, k)}
        if different:
            raise ValueError(
                "sampler state was saved by a sampler with other settings (saved, this one): "
                f"{different}; a resumed run must use the same dataset, seed and process layout"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.epoch_size:
            raise ValueError(
                f"invalid sampler position: epoch {epoch}, position {position} (epoch size {self.epoch_size})"
            )
        self.epoch, self.position = epoch, position
