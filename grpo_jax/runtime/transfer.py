"""Arrays from one set of devices to another, device to device: the learner's parameters to the
sampler's devices when they are two meshes (`rollout.sampler_devices`).

One process: `jax.device_put` to the target sharding copies between devices.

Several processes (multi-controller JAX, no Pathways): JAX refuses a reshard between different
device sets ("For a cross-host reshard in multi-controller JAX, input and target sharding should
have the same set of devices"; jax 0.10.2), and a jitted identity with the target as its output
sharding is refused too (incompatible devices). What works (2 processes x 4 CPU devices, gloo): one
array over both device sets. The target's current copy (the sampler's old parameters) and the
source, laid out like the target, are stacked into one array of shape [2, ...] on a mesh (role, *the
target mesh's axes) whose role 0 is the target's devices and role 1 the source's; a jitted
broadcast of role 1 over both roles makes XLA move the data with its collectives, and the target's
shards of the result are the copy (no host copy, no second buffer on the target kept).
The two meshes must then have the same shape and axis names.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def copy_to(tree, shardings, into=None):
    """`tree`'s arrays with `shardings` (a matching tree of NamedShardings on the target mesh).
    `into`: the target's current arrays of the same shapes (with several processes; zeros are
    made there when it is None or not on the target's devices yet)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, target, old):
        if old is None or old.sharding.device_set != target.device_set:
            old = _zeros(x.shape, x.dtype, target)
        return _stacked_copy(x, target, old)

    return jax.tree.map(one, tree, shardings, tree if into is None else into)


def _zeros(shape, dtype, sharding: NamedSharding) -> jax.Array:
    return _zeros_program(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=256)
def _zeros_program(shape: tuple, dtype, sharding: NamedSharding):
    """Zeros laid out by `sharding`, made on its devices (one compile per layout)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _stacked_copy(x: jax.Array, target: NamedSharding, old: jax.Array) -> jax.Array:
    src_mesh = x.sharding.mesh
    dst_mesh = target.mesh
    if src_mesh.axis_names != dst_mesh.axis_names or src_mesh.devices.shape != dst_mesh.devices.shape:
        raise ValueError(f"copy_to across processes needs two meshes of one shape: {dict(src_mesh.shape)} -> "
                         f"{dict(dst_mesh.shape)}")
    # Laid out like the target, on the source's own devices (a reshard within one device set).
    x = jax.device_put(x, NamedSharding(src_mesh, target.spec))
    both = Mesh(np.stack([dst_mesh.devices, src_mesh.devices]), ("role", *dst_mesh.axis_names))
    spec = PartitionSpec("role", *target.spec)
    device_rank = {d: i for i, d in enumerate(both.devices.flat)}
    shards = [s.data[None] for s in (*old.addressable_shards, *x.addressable_shards)]
    shards.sort(key=lambda a: device_rank[next(iter(a.devices()))])
    stacked = jax.make_array_from_single_device_arrays((2, *x.shape), NamedSharding(both, spec), shards)
    out = _broadcaster(NamedSharding(both, spec))(stacked)
    targets = set(dst_mesh.devices.flat)
    mine = [s.data[0] for s in out.addressable_shards if next(iter(s.data.devices())) in targets]
    return jax.make_array_from_single_device_arrays(x.shape, target, mine)


def _source_everywhere(stacked: jax.Array) -> jax.Array:
    return jnp.broadcast_to(stacked[1], stacked.shape)


@functools.lru_cache(maxsize=256)
def _broadcaster(sharding: NamedSharding):
    """The jitted broadcast of role 1 over both roles, once per layout."""
    return jax.jit(_source_everywhere, out_shardings=sharding)
