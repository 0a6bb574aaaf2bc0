"""The device mesh, and the rules that map the model's logical axes onto it.

Mesh axes (always these four, in this order; size 1 is fine and goes through the same code):
- `data`: data parallelism. Batch rows are split; parameters are replicated along it.
- `fsdp`: fully sharded data parallelism (ZeRO-3). Batch rows are split along it too, and
  parameters are split along their `embed` dimension, gathered by XLA where a layer uses them.
- `expert`: expert parallelism (mixture-of-experts models). Expert parameters are split along
  `experts` (each device holds Ex / expert of them); batch rows are split along it too, so for the
  model's dense parts it is more fully sharded data parallelism: their `embed` dimension is split
  over fsdp x expert. The experts' layers exchange tokens over it (grpo_jax.models.experts). On a
  multi-host v5e, whose ICI routes a collective only along neighbours, two such axes of 8 (fsdp 8 x
  expert 8 on an 8x8 slice) give collectives XLA:TPU cannot route; `expert: -1` alone compiles.
- `tensor`: model (Megatron) parallelism. Parameters are split along `heads`, `kv_heads`, `mlp`,
  `expert_mlp` and `vocab`; activations follow. Last, so a row's `tensor` devices are neighbours
  (one host).

Axis types: Auto. Shardings are given at the jit boundary (in_shardings / out_shardings) and
GSPMD propagates them through the step; ops inside do not carry shardings in their types
(Explicit mode would ask every einsum in the model to agree on output shardings by hand, for no
gain at these boundaries).

A dimension that its mesh axis does not divide cannot be split; it is replicated instead and
`param_shardings` reports it in `Sharded.replicated`, so nothing is replicated silently.
The mesh is always passed explicitly; nothing here reads a global mesh. Its device order
(`mesh_device_grid`) gives each host one contiguous block of batch rows, which the per-host data
path relies on (grpo_jax.runtime.hosts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from grpo_jax.config import MeshConfig

AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")
BATCH = ("data", "fsdp", "expert")  # rows of every batch and rollout are split over all three

# Logical axis name -> mesh axis, or mesh axes split together (None = replicated).
RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "vocab": "tensor",
    # Every weight's embed axis is split over fsdp and, where a mixture of experts has one, over the
    # expert axis too (it splits rows as fsdp does), so the attention and embedding weights are not
    # whole on each of an expert group's chips; an expert weight, whose experts take the expert axis,
    # splits its embed axis over fsdp alone. One `expert` axis is then a whole layout (mesh.expert:
    # -1), which multi-host v5e slices need (the module docstring says why).
    "embed": ("fsdp", "expert"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "lora_rank": None,  # LoRA adapters: their other axes follow the weight they adapt
    "experts": "expert",  # a mixture-of-experts layer's experts (models.experts runs them where they are)
    "expert_mlp": "tensor",
    "router": None,
}


def mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, int, int, int]:
    """Sizes of (data, fsdp, expert, tensor) with -1 resolved to the remaining devices."""
    sizes = [config.data, config.fsdp, config.expert, config.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"mesh {tuple(sizes)}: {num_devices} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        named = " x ".join(f"{a}={n}" for a, n in zip(AXES, sizes))
        raise ValueError(f"mesh {named} = {math.prod(sizes)} devices, "
                         f"but {num_devices} are available; make the product match or use -1 for one axis")
    return tuple(sizes)


def mesh_devices(config: MeshConfig, pool: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices a mesh config asks for out of `pool` (default: every device): all of them when a
    size is -1, else the first data x fsdp x expert x tensor (a (1, 1, 1, 1) mesh on an 8-device
    host uses one device)."""
    sizes = (config.data, config.fsdp, config.expert, config.tensor)
    devices = list(jax.devices() if pool is None else pool)
    if -1 in sizes:
        return devices
    n = math.prod(sizes)
    if n > len(devices):
        raise ValueError(f"mesh {sizes} needs {n} devices, only {len(devices)} are available")
    return devices[:n]


def mesh_device_grid(mesh_config: MeshConfig, devices: Sequence[jax.Device]) -> np.ndarray:
    """The order a run's mesh puts `devices` in: an object array [data, fsdp, expert, tensor] of them.

    Batch rows are split over (data, fsdp, expert), row shard `(d * fsdp + f) * expert + e`. With
    devices of several processes, each process's devices are one contiguous, equal-sized block of
    those row shards (processes in `process_index` order), with a row's `tensor` devices on one
    host; a `tensor` axis larger than a host spans consecutive processes, which then share a block.
    This is what `hosts.row_share` needs to give each host its own rows of every batch. Within a
    process (and with one process) the order is JAX's `create_device_mesh`: ICI neighbours by torus
    coordinates on TPU, the given order on CPU.

    `jax.make_mesh` alone orders a multi-host TPU slice by torus coordinates, which scatters each
    host's chips over the rows. Anything with JAX's device attributes (`id`, `process_index`,
    `platform`, `device_kind`; `coords`, `core_on_chip` on TPU) works, so fake devices can test
    a pod's layout.
    """
    devices = list(devices)
    shape = mesh_shape(mesh_config, len(devices))
    by_process: dict[int, list] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    if len(by_process) == 1:
        return _ici_grid(shape, devices)
    hosts = [by_process[p] for p in sorted(by_process)]
    local, tensor = len(hosts[0]), shape[3]
    if any(len(h) != local for h in hosts):
        raise ValueError(f"processes hold {sorted({len(h) for h in hosts})} devices each; a mesh over several "
                         "processes needs the same number of devices from every process")
    if local % tensor and tensor % local:
        raise ValueError(f"mesh.tensor={tensor} neither divides nor is a multiple of the {local} devices of each "
                         "process, so a host would hold parts of rows; make it one of those")
    # A host's devices fill whole rows (tensor <= local) or a run of one row's tensor axis.
    local_shape = (local // tensor, tensor) if tensor <= local else (1, local)
    blocks = [_ici_grid(local_shape, host).reshape(-1) for host in hosts]
    return np.concatenate(blocks).reshape(shape)


def _ici_grid(shape: Sequence[int], devices: Sequence[jax.Device]) -> np.ndarray:
    # Splitting a physical torus axis over two mesh axes is only tried when no whole-axis
    # assignment exists (e.g. one v5e host's 2x2 chips as a 4-device axis); jax.make_mesh allows it
    # on v5e only and otherwise fails.
    return mesh_utils.create_device_mesh(tuple(shape), devices, allow_split_physical_axes=True)


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over `devices` (default: all devices of all processes),
    in the host-aware order of `mesh_device_grid`."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(mesh_device_grid(config, devices), AXES, axis_types=(AxisType.Auto,) * len(AXES))


@functools.lru_cache(maxsize=None)
def one_device_mesh(device: jax.Device | None = None) -> Mesh:
    """The 1x1x1x1 mesh of one `device` (default: this process's first): a call without a mesh runs
    on it, through the same code as on any mesh."""
    return make_mesh(MeshConfig(data=1, fsdp=1, expert=1, tensor=1), [device or jax.local_devices()[0]])


def mesh_or_one_device(mesh: Mesh | None, tree) -> Mesh:
    """What a public entry's `mesh=None` means: `mesh` when given, else the 1x1x1x1 mesh of the one
    device `tree`'s arrays (a model's state) are on (this process's first when none is placed).
    Arrays on several devices were placed on a mesh: it must be passed."""
    if mesh is not None:
        return mesh
    devices = {d for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.devices()}
    if len(devices) > 1:
        raise ValueError(f"the model's arrays are on {len(devices)} devices but no mesh was given; "
                         "pass the mesh they were placed on (mesh=...)")
    return one_device_mesh(devices.pop() if devices else None)


def logical_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 rules: Mapping[str, str | None] = RULES) -> tuple[PartitionSpec, list[str]]:
    """The PartitionSpec of one array from its logical axes, and the logical axes that had to be
    replicated because their mesh axis does not divide them (or is already used)."""
    spec, skipped, used = [], [], set()
    for name, size in zip(axes, shape, strict=True):
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        rule = rules.get(name) if name is not None else None
        targets = (rule,) if isinstance(rule, str) else tuple(rule or ())
        # Several axes: those another dimension took are left out; a single axis is reported.
        free = [a for a in targets if mesh.shape[a] > 1 and (a not in used or len(targets) == 1)]
        while free and (size % math.prod(mesh.shape[a] for a in free) or used & set(free)):
            a = free.pop()
            skipped.append(f"{name}({size}) over {a}({mesh.shape[a]})")
        spec.append(None if not free else free[0] if len(free) == 1 else tuple(free))
        used.update(free)
    return PartitionSpec(*spec), skipped


@dataclasses.dataclass
class Sharded:
    shardings: nnx.State  # a NamedSharding per parameter, same structure as the params
    replicated: list[str]  # "path: axis(size) over mesh_axis(n)" for each dimension left whole


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(params: nnx.State, mesh: Mesh, rules: Mapping[str, str | None] = RULES) -> Sharded:
    """NamedShardings for an `nnx.State` of parameters from their `logical_axes` metadata."""
    replicated: list[str] = []

    def one(path, var):
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical_axes metadata")
        spec, skipped = logical_spec(axes, var.shape, mesh, rules)
        replicated.extend(f"{jax.tree_util.keystr(path)}: {s}" for s in skipped)
        return var.replace(NamedSharding(mesh, spec))

    shardings = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_var)
    return Sharded(shardings=shardings, replicated=replicated)


def placed_shapes(params: nnx.State, mesh: Mesh, rules: Mapping[str, str | None] = RULES) -> nnx.State:
    """An abstract model's parameters (jax.ShapeDtypeStructs, `nnx.eval_shape`) carrying the
    shardings `place_model` would give them: what a program lowered on them expects."""
    shardings = param_shardings(params, mesh, rules).shardings
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)


def host_to_mesh(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host (NumPy) array placed by `sharding`: each device receives only its own slice, cut on
    the host, so no device holds more than it shards and no host's copy is compared with another's
    (`jax.device_put` of a host array onto a mesh spanning several processes gathers every copy to
    check they agree)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def place_array(x, sharding: NamedSharding) -> jax.Array:
    """`x` placed by `sharding`. An array already spread over devices is resharded by XLA on the
    devices; a host array, or one on a single device of this process (a freshly built model, still
    uncommitted on the default device), goes through the host (`host_to_mesh`)."""
    if getattr(x, "sharding", None) == sharding:
        return x
    if isinstance(x, jax.Array) and (not x.is_fully_addressable or len(x.sharding.device_set) > 1):
        return jax.device_put(x, sharding)
    return host_to_mesh(np.asarray(x), sharding)


def place_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str | None] = RULES) -> list[str]:
    """Move an NNX model's parameters onto the mesh by the rules, in place (`place_array`: nothing is
    gathered across hosts); returns the dimensions that had to be replicated (see `param_shardings`)."""
    params = nnx.state(model, nnx.Param)
    sharded = param_shardings(params, mesh, rules)
    nnx.update(model, jax.tree.map(place_array, params, sharded.shardings))
    return sharded.replicated


def init_on_host(make: Callable[[], nnx.Module]) -> nnx.Module:
    """The module `make()` builds, drawn by JAX's CPU backend and kept as NumPy arrays in host
    memory, for `place_model` to cut onto a mesh: no accelerator ever holds it whole (a draw on the
    default device would put the whole model on chip 0), and every host draws the same values,
    which are also the values a CPU-only run draws. Without a CPU backend (`JAX_PLATFORMS` leaving
    it out), it is drawn on the default device and then copied to the host."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        cpu = None
    if cpu is None:
        module = make()
    else:
        with jax.default_device(cpu):
            module = make()
    params = nnx.state(module, nnx.Param)
    nnx.update(module, jax.tree.map(np.array, params))  # copies: np.asarray would keep the CPU buffers alive
    return module


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Rows split over (data, fsdp, expert); the other dimensions whole."""
    return NamedSharding(mesh, PartitionSpec(BATCH, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def rows_per_shard(mesh: Mesh) -> int:
    """The row shards a batch is split into: data x fsdp x expert."""
    return math.prod(mesh.shape[a] for a in BATCH)


def round_to_row_shards(rows: int, mesh: Mesh | None) -> int:
    """`rows` rounded up to a multiple of the mesh's row shards (data x fsdp x expert), so a batch
    splits evenly; without a mesh, `rows` itself."""
    n = 1 if mesh is None else rows_per_shard(mesh)
    return -(-rows // n) * n


def pow2_bucket(length: int, minimum: int = 1) -> int:
    """The power of two at or above `length` (at least `minimum`): padding lengths to these buckets
    bounds the number of compiled shapes."""
    return max(minimum, 1 << max(0, (max(length, 1) - 1).bit_length()))


def shard_rows(tree, mesh: Mesh):
    """Place host arrays (leading axis = rows) on the mesh, rows split over (data, fsdp, expert)."""
    n = rows_per_shard(mesh)

    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.shape[0] % n:
            raise ValueError(f"{x.shape[0]} rows do not split over data x fsdp x expert = {n} devices; "
                             "make the batch (prompts x group size) a multiple of it")
        return jax.device_put(x, batch_sharding(mesh, x.ndim))

    return jax.tree.map(put, tree)


def sharded_jit(fn, *, in_shardings, out_shardings, donate: tuple[str, ...] = (), static: tuple[str, ...] = ()):
    """The one way a step is jitted: explicit input and output shardings (a pytree prefix of the
    arguments / results), the named arguments in `donate` donated, `static` ones static."""
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnames=donate,
                   static_argnames=static)


def on_mesh(tree, mesh: Mesh):
    """`tree` with every array not yet placed on a mesh (an optimizer's step count, a fresh scalar)
    put on `mesh` replicated, so a step's inputs all share one device assignment and keep one
    sharding from call to call; arrays placed by the rules keep theirs."""
    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else jax.device_put(x, replicated(mesh)), tree)


def tree_shardings(tree):
    """The shardings a placed pytree of arrays has now (for jit in/out_shardings)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def train_state_shardings(state, mesh: Mesh, rules: Mapping[str, str | None] = RULES):
    """Where a TrainState goes on the mesh: params by the rules, optimizer moments like their params
    (any subtree shaped like the params, such as Adam's mu and nu), everything else replicated.
    Reads shapes and logical axes only, so an abstract state (`jax.eval_shape`) works too.
    Returns (the shardings, a pytree like the state; the dimensions that had to be replicated)."""
    sharded = param_shardings(state.params, mesh, rules)
    whole = replicated(mesh)
    # PPO's critic: its head is small (replicated); a separate critic model (`ppo.critic: model`,
    # an nnx.State under "model") is sharded by the same rules as the policy.
    critic = jax.tree.map(lambda _: whole, state.critic)
    models = [(state.params, sharded.shardings)]
    left_whole = list(sharded.replicated)
    if isinstance(state.critic, dict) and "model" in state.critic:
        own = param_shardings(state.critic["model"], mesh, rules)
        critic = {**critic, "model": own.shardings}
        models.append((state.critic["model"], own.shardings))
        left_whole += [f"critic {line}" for line in own.replicated]
    layouts = [(_layout(params), shardings) for params, shardings in models]

    def opt_node(x):
        # Optimizer moments are pytrees shaped like the params (or the critic model): shard them the same way.
        if isinstance(x, nnx.State):
            for layout, shardings in layouts:
                if _layout(x) == layout:
                    return shardings
        return jax.tree.map(lambda _: whole, x)

    opt_state = jax.tree.map(opt_node, state.opt_state, is_leaf=lambda x: isinstance(x, nnx.State))
    shardings = state.replace(params=sharded.shardings, opt_state=opt_state, step=whole, skipped_total=whole,
                              skipped_streak=whole, critic=critic)
    return shardings, left_whole


def _layout(tree) -> tuple:
    """A pytree's structure and leaf shapes: two trees with the same layout shard the same way."""
    return jax.tree.structure(tree), tuple(tuple(x.shape) for x in jax.tree.leaves(tree))


def place_train_state(state, mesh: Mesh, rules: Mapping[str, str | None] = RULES):
    """A TrainState on the mesh (`train_state_shardings`). Returns (state, its shardings, the
    dimensions that had to be replicated)."""
    shardings, left_whole = train_state_shardings(state, mesh, rules)
    state = jax.device_put(state, shardings)
    return state, tree_shardings(state), left_whole


# --- pmap mode (pure data parallelism, the state replicated on every local device) -------------

def replicate(tree, devices: Sequence[jax.Device] | None = None):
    """Copies of `tree` on each device, stacked on a new leading axis (pmap's layout)."""
    devices = list(jax.local_devices() if devices is None else devices)
    stacked = NamedSharding(Mesh(np.asarray(devices), ("devices",)), PartitionSpec("devices"))
    return jax.tree.map(lambda x: jax.device_put(np.broadcast_to(np.asarray(x), (len(devices), *np.shape(x))), stacked),
                        tree)


def split_rows(tree, n: int):
    """[R, ...] -> [n, R / n, ...] for pmap: device i gets rows i*R/n ... (whole groups when
    R / n is a multiple of the group size)."""
    def one(x):
        if x.shape[0] % n:
            raise ValueError(f"{x.shape[0]} rows do not split over {n} devices")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree.map(one, tree)


def unreplicate(tree):
    """Device 0's copy of a replicated pytree."""
    return jax.tree.map(lambda x: x[0], tree)
