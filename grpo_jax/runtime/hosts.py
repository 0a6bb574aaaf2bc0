"""Multi-host runs: which rows each process owns, and moving rows between hosts and the mesh.

JAX's multi-controller model: every process runs the same program on its own devices; a global
`jax.Array` spans all of them and each process only holds (and can only read) its addressable
shards. The trainer keeps the data path per host:

- A batch of `total` rows is split over the mesh's batch axes (data, fsdp, expert). `row_share` says
  which contiguous block of those rows this process's devices hold. Processes whose devices hold
  the same block (a `tensor` axis that spans hosts) form one share and compute the same thing.
- Each host loads and formats only the prompts of its block (the data sampler is sharded by share,
  not by process), builds its rows, and `to_global` assembles the global array from every host's
  block without any host seeing the others' data.
- Rollouts come back with `local_rows`: the rows of this host's block, read from its addressable
  shards; rewards are computed there, on the host that owns the rows.
- Host-side results that must agree everywhere (reward statistics, counters, the dynamic
  sampling decision) go through `gather_rows` / `sum_over_shares` / `any_host`, which are plain
  copies in a single process and `multihost_utils.process_allgather` otherwise.

With one process every function here is the identity or a device_put, and the same code runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.runtime.sharding import BATCH, batch_sharding


def is_primary() -> bool:
    """Process 0: the one that writes logs, metrics files and plots."""
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


@dataclasses.dataclass(frozen=True)
class RowShare:
    """Rows [start, stop) of a `total`-row batch live on this process's devices; the batch is cut
    into `count` such blocks and this is block `index`."""

    start: int
    stop: int
    total: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def index(self) -> int:
        return self.start // self.size

    @property
    def count(self) -> int:
        return self.total // self.size

    def scaled(self, factor: int) -> "RowShare":
        """The same block of a batch with `factor` rows per item (prompts -> their G samples)."""
        return RowShare(self.start * factor, self.stop * factor, self.total * factor)


def row_share(mesh: Mesh, total: int, process: int | None = None) -> RowShare:
    """This process's block of a `total`-row batch whose rows are split over (data, fsdp, expert); or the
    block of process `process` (every host knows every device's process, so any block can be
    computed anywhere, and fake devices can stand in for a pod's)."""
    process = jax.process_index() if process is None else process
    sharding = NamedSharding(mesh, PartitionSpec(BATCH))
    spans = sorted({idx[0].indices(total)[:2] for device, idx in sharding.devices_indices_map((total,)).items()
                    if device.process_index == process})
    if not spans:
        raise ValueError(f"process {process} has no device in the mesh; a multi-host mesh must use "
                         "every process's devices (use -1 for one mesh axis)")
    start, stop = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    size = stop - start
    if covered != size or total % size or start % size:
        raise ValueError(f"process {process} holds rows {spans} of {total}: not one aligned contiguous "
                         "block. Build the mesh with sharding.make_mesh (its device order keeps each host's "
                         "devices adjacent along (data, fsdp, expert))")
    return RowShare(start, stop, total)


def whole(total: int) -> RowShare:
    return RowShare(0, total, total)


def to_global(tree, mesh: Mesh, share: RowShare):
    """Global arrays with rows split over (data, fsdp, expert) from this host's rows [share.start, share.stop).
    A leaf's leading axis is share.size, or share.size / f for values of groups of f rows (a
    prompt's). No host sends or sees another host's rows."""
    def one(x):
        x = np.asarray(x)
        own = share
        if x.shape[0] != share.size:  # one row per group of rows (per-prompt values of a batch of samples)
            f = share.size // max(x.shape[0], 1)
            if not x.shape[0] or share.size % x.shape[0] or share.start % f or share.total % f:
                raise ValueError(f"this host's block has {share.size} rows, got an array of {x.shape[0]}")
            own = RowShare(share.start // f, share.stop // f, share.total // f)

        def rows(index):
            a, b, _ = index[0].indices(own.total)
            return x[(slice(a - own.start, b - own.start), *index[1:])]

        return jax.make_array_from_callback((own.total, *x.shape[1:]), batch_sharding(mesh, x.ndim), rows)

    return jax.tree.map(one, tree)


def local_rows(tree, share: RowShare):
    """This host's rows [share.start, share.stop) of global arrays, as NumPy (from addressable shards)."""
    def one(x):
        if x.is_fully_addressable:
            return np.asarray(x)[share.start:share.stop]
        out = np.empty((share.size, *x.shape[1:]), x.dtype)
        filled = np.zeros(share.size, bool)
        for shard in x.addressable_shards:
            a, b, _ = shard.index[0].indices(x.shape[0])
            a, b = a - share.start, b - share.start
            if a < 0 or b > share.size:
                raise ValueError(f"a shard with rows {shard.index[0]} lies outside this host's block {share}")
            if not filled[a:b].all():
                out[a:b] = np.asarray(shard.data)
                filled[a:b] = True
        if not filled.all():
            raise ValueError(f"this host's shards do not cover its rows {share}")
        return out

    return jax.tree.map(one, tree)


def gather_rows(local: np.ndarray, share: RowShare) -> np.ndarray:
    """Every host's block put together: the whole [total, ...] array, the same on every host."""
    local = np.asarray(local)
    if not multi_process():
        return local
    blocks = multihost_utils.process_allgather(local)
    starts = multihost_utils.process_allgather(np.asarray(share.start))
    out = np.empty((share.total, *local.shape[1:]), local.dtype)
    for start, block in zip(starts.tolist(), blocks):
        out[start:start + share.size] = block  # hosts of one share wrote the same rows
    return out


def sum_over_shares(values: Mapping[str, float], share: RowShare) -> dict[str, float]:
    """Per-host counts summed over the shares (hosts of one share are counted once)."""
    keys = sorted(values)
    if not multi_process():
        return {k: float(values[k]) for k in keys}
    rows = multihost_utils.process_allgather(np.asarray([share.start] + [values[k] for k in keys], np.float64))
    _, first = np.unique(rows[:, 0], return_index=True)
    return {k: float(v) for k, v in zip(keys, rows[first, 1:].sum(axis=0))}


def any_host(flag: bool) -> bool:
    """True on every host if it is true on any (a decision all hosts must take together)."""
    if not multi_process():
        return bool(flag)
    return bool(multihost_utils.process_allgather(np.asarray(flag, np.int32)).any())


def any_hosts(*flags: bool) -> tuple[bool, ...]:
    """`any_host` of several flags in one collective."""
    if not multi_process():
        return tuple(bool(f) for f in flags)
    gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32))
    return tuple(bool(v) for v in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))


def max_over_hosts(value: int) -> int:
    if not multi_process():
        return int(value)
    return int(multihost_utils.process_allgather(np.asarray(value, np.int64)).max())


def common_bucket(prompts: Sequence[Sequence[int]], buckets: Sequence[int]) -> tuple[int, ...]:
    """The one prompt bucket that fits every host's longest prompt (all hosts must pad alike)."""
    longest = max_over_hosts(max(len(p) for p in prompts))
    return tuple(b for b in sorted(buckets) if b >= longest)[:1] or tuple(buckets)


def gather_json(obj) -> list:
    """One JSON-able object per process, in process order, on every process."""
    if not multi_process():
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = max_over_hosts(data.size)
    padded = np.zeros(n, np.uint8)
    padded[:data.size] = data
    lengths = multihost_utils.process_allgather(np.asarray(data.size, np.int64))
    blocks = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(b[:k]).decode()) for b, k in zip(blocks, lengths.tolist())]


def replicated_key(key: jax.Array, mesh: Mesh) -> jax.Array:
    """A PRNG key replicated over the mesh. (`jax.device_put` of a host-local key array onto a
    sharding that spans processes is refused; its raw key data is placed instead.)"""
    data = np.asarray(jax.random.key_data(key))
    return jax.random.wrap_key_data(jax.device_put(data, NamedSharding(mesh, PartitionSpec())),
                                    impl=jax.random.key_impl(key))
