"""Mixture of experts: the experts' MLPs over routed tokens (`expert_mlp`), and how many tokens each
expert receives (`tokens_per_expert`). The router is the model's; its choices come in as arrays.

Token x goes to the Kx experts e = experts[x, k] with weights w[x, k], and its output is

    y[x] = sum_k w[x, k] * (act(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]

each expert a gated MLP like the dense one (grpo_jax.models.layers): w_gate, w_up [Ex, E, Fx],
w_down [Ex, Fx, E]. Matmuls run in the inputs' dtype (the compute dtype), as the dense MLP's
einsums do. Every implementation (`EXPERT_IMPLS`) is exact and dropless: no token is dropped,
however unevenly the router spreads them.

- "dense": every expert applied to every token, combined with the routing weights (zero for the
  experts a token did not choose): Ex / Kx times the FLOPs. The reference, for tests and tiny models.
- "ragged": the Nx = X x Kx (token, choice) pairs sorted by expert (stable), one grouped matmul per
  projection (`jax.lax.ragged_dot`, group sizes = pairs per expert), unsorted, weighted and summed
  over the choices. XLA:TPU runs ragged_dot natively (the pairs' FLOPs only); on CPU and GPU JAX
  lowers it to a product masked per expert, i.e. the dense FLOPs: correct, nothing saved there.
- "gmm": the same with the Pallas TPU kernel megablox `gmm` (and its own backward). Off TPU it runs
  in Pallas's interpreter: slow, for tests. A Mosaic kernel cannot be partitioned by jit, so on a
  mesh it runs per device under shard_map (below); without a mesh, on one device only.
- "auto": gmm on TPU with a mesh, ragged otherwise.

With a `mesh` (grpo_jax.runtime.sharding), "ragged" and "gmm" run per device under
`jax.shard_map`: token rows split over the batch axes (data, fsdp, expert; X must divide over
them), the experts over `expert` (Ex / mesh.expert each), Fx over `tensor` where it divides (a psum
over `tensor` then finishes the down projection), E whole: weights split over `fsdp` along E are
gathered by XLA at the shard_map's boundary, as a dense layer's are under fsdp (their gradients
are summed over the devices that shared them and split back by the step's out_shardings). "dense"
is left to the compiler's partitioner.

Expert parallelism (mesh.expert = Pe > 1): each device sorts its Nx local pairs by expert, sends
each pair's token row to the device holding its expert and gets the expert's output back, with two
`jax.lax.all_to_all`s. XLA:CPU has no ragged all-to-all (jax 0.10.2: "HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU"), so the exchange is padded: a device reserves Nx
rows for every peer, the worst case (all its pairs to one device), which is what makes it dropless.
Its cost per device and layer call: send and receive buffers of Pe x Nx x E each (and the returned
outputs the same), and the receiver's grouped matmuls over Pe x Nx rows of which Nx are real on
average: Pe times the memory of the pairs themselves, and Pe times the bytes on the wire. The
gmm kernel skips the padding rows' tiles; ragged_dot may not. A receive buffer of the worst case
(every peer's pairs to one device) is inherent to dropless routing with static shapes; a ragged
all-to-all (TPU) would save the send side and the wire bytes, not that (and v5e, whose ICI routes
only between neighbours, has none). So that the buffers stay bounded however many peers, a device
exchanges its tokens in chunks (`exchange_chunks`: a `lax.map` over them, each rematerialised in
the backward pass) whose Pe x Nx x E buffer holds at most `EXCHANGE_BYTES`: one 1280-token row
of Qwen3-30B-A3B (Kx 8, E 2048, bf16) over 64 peers needs 2.7 GB per buffer whole, 256 MiB in ten
chunks.

Shape letters: grpo_jax.shapes (the mixture-of-experts ones: Ex, Fx, Kx, Nx, Pe, Le, Cb, Mr, Rg).
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.models.activations import activation as apply_activation
from grpo_jax.models.config import ACTIVATIONS
from grpo_jax.runtime.sharding import BATCH

EXPERT_IMPLS = ("auto", "dense", "ragged", "gmm")

EXCHANGE_BYTES = 256 * 2 ** 20
"""The most one padded all-to-all buffer of expert parallelism may hold (module docstring)."""

GMM_TILING = (512, 1024, 1024)
"""The largest (rows, contraction, output) tiles of the gmm kernel (MaxText's default sizes),
taken smaller to suit the problem (`gmm_matmul`)."""


def expert_mlp(x_XE: jax.Array, experts_XKx: jax.Array, weights_XKx: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, *, activation: str = "silu", impl: str = "auto",
               mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """The routed experts' output y [X, E] (x's dtype) for tokens x [X, E] (compute dtype), their
    experts int [X, Kx] (ids 0..Ex-1; a token may repeat one) and routing weights [X, Kx]; w_gate
    and w_up [Ex, E, Fx], w_down [Ex, Fx, E] (cast to x's dtype). `activation`: a name of
    `grpo_jax.models.activations`. `impl`: one of `EXPERT_IMPLS` (module docstring). `mesh`: run
    per device on it, with expert parallelism over its `expert` axis (module docstring)."""
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"unknown expert implementation {impl!r}: one of {EXPERT_IMPLS}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: one of {ACTIVATIONS}")
    _check_shapes(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down)
    w_gate, w_up, w_down = (w.astype(x_XE.dtype) for w in (w_gate, w_up, w_down))
    weights_XKx = weights_XKx.astype(x_XE.dtype)
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if impl == "auto":
        impl = "gmm" if platform == "tpu" and mesh is not None else "ragged"
    if impl == "dense":
        return _dense(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down, activation)
    if impl == "gmm" and platform == "tpu":
        _check_kernel_precision(x_XE.dtype)
    matmul = (jax.lax.ragged_dot if impl == "ragged"
              else functools.partial(gmm_matmul, interpret=platform != "tpu"))
    ffn = functools.partial(grouped_ffn, activation=activation, matmul=matmul)
    args = (x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down)
    if mesh is None:
        return _one_device(*args, ffn=ffn)
    # check_vma off for the kernel: its pallas_call gives no varying-axes type for its output (jax 0.10.2 refuses
    # it under check_vma); the specs say what is split.
    return _on_mesh(*args, mesh=mesh, ffn=ffn, check_vma=impl != "gmm")


def tokens_per_expert(experts_XKx: jax.Array, real_X: jax.Array, num_experts: int) -> jax.Array:
    """float32 [Ex]: the (token, choice) pairs each expert receives, counting real tokens only
    (`real_X`: bool or 0/1 [X]); a token that chose an expert twice counts twice."""
    chex.assert_rank(experts_XKx, 2)
    chex.assert_shape(real_X, experts_XKx.shape[:1])
    counts = jnp.broadcast_to(real_X.astype(jnp.float32)[:, None], experts_XKx.shape)
    return jnp.zeros((num_experts,), jnp.float32).at[experts_XKx].add(counts)


def _check_shapes(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down) -> None:
    chex.assert_rank([x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down], [2, 2, 2, 3, 3, 3])
    X, E = x_XE.shape
    Ex, _, Fx = w_gate.shape
    chex.assert_shape([experts_XKx, weights_XKx], (X, experts_XKx.shape[1]))
    chex.assert_shape([w_gate, w_up], (Ex, E, Fx))
    chex.assert_shape(w_down, (Ex, Fx, E))
    if not jnp.issubdtype(experts_XKx.dtype, jnp.integer):
        raise ValueError(f"experts must be integer expert ids, got {experts_XKx.dtype}")


def _check_kernel_precision(dtype) -> None:
    """Mosaic refuses the gmm kernel's bfloat16 products under a process-wide matmul precision
    above the default ("Bad lhs type" for float32 / highest, NotImplementedError for high; XLA:TPU
    via libtpu 0.0.42). The kernel accumulates in float32 whatever the setting."""
    setting = jax.config.jax_default_matmul_precision
    if dtype == jnp.bfloat16 and setting not in (None, "default", "bfloat16", "fastest"):
        raise ValueError(f"the gmm expert kernel cannot run bfloat16 under jax_default_matmul_precision={setting!r} "
                         "(Mosaic refuses it); use the default precision around the model, or impl='ragged'")


def _dense(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down, activation: str) -> jax.Array:
    """Every expert on every token, combined by the routing weights (0 where not chosen)."""
    combine_XEx = jnp.einsum("xk,xkn->xn", weights_XKx,
                             jax.nn.one_hot(experts_XKx, w_gate.shape[0], dtype=weights_XKx.dtype))
    h_XExFx = (apply_activation(jnp.einsum("xe,nef->xnf", x_XE, w_gate), activation)
               * jnp.einsum("xe,nef->xnf", x_XE, w_up))
    return jnp.einsum("xn,xne->xe", combine_XEx, jnp.einsum("xnf,nfe->xne", h_XExFx, w_down))


def grouped_ffn(rows_RgE: jax.Array, sizes_Le: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, *, activation: str, matmul) -> jax.Array:
    """The experts' MLPs over rows [Rg, E] sorted by expert: rows [0, sizes[0]) go to expert 0 of
    w_* [Le, ...], the next sizes[1] to expert 1, and so on -> [Rg, E]. `matmul(lhs, rhs, sizes)` is
    the grouped matmul (`jax.lax.ragged_dot` or `gmm_matmul`). Rows past sum(sizes) come out 0
    (ragged_dot) or garbage (gmm): the caller must not read them. Their cotangents do not matter
    either: both backward passes read a group's rows only."""
    sizes_Le = sizes_Le.astype(jnp.int32)
    h_RgFx = (apply_activation(matmul(rows_RgE, w_gate, sizes_Le), activation)
              * matmul(rows_RgE, w_up, sizes_Le))
    return matmul(h_RgFx, w_down, sizes_Le)


def gmm_matmul(lhs_RgI: jax.Array, rhs_LeIO: jax.Array, sizes_Le: jax.Array, *, interpret: bool = False) -> jax.Array:
    """megablox `gmm` as a grouped matmul [Rg, I] x [Le, I, O] -> [Rg, O] in lhs's dtype (float32 or
    bfloat16; it accumulates in float32): rows padded to a whole row tile, tiles up to `GMM_TILING`
    (`_lane_tile`). Rows past sum(sizes) are left unwritten: garbage (NaN in the interpreter)."""
    Rg, I = lhs_RgI.shape
    O = rhs_LeIO.shape[2]
    tm = min(GMM_TILING[0], -(-Rg // 128) * 128)
    padded = -(-Rg // tm) * tm
    lhs = jnp.pad(lhs_RgI, ((0, padded - Rg), (0, 0)))
    tiling = (tm, *(_lane_tile(I, O, cap) for cap in GMM_TILING[1:]))
    # custom_vjp's non-differentiable arguments must be positional: dtype, tiling, group_offset,
    # existing_out, transpose_rhs, interpret.
    out = megablox.gmm(lhs, rhs_LeIO, sizes_Le.astype(jnp.int32), lhs_RgI.dtype, tiling, None, None, False, interpret)
    return out[:Rg]


def _lane_tile(I: int, O: int, cap: int) -> int:
    """A gmm tile along I or O. Its backward runs the kernel with I and O swapped under the same
    tiling, so a tile must suit both: Mosaic takes a block of a multiple of 128 lanes or of the
    whole dimension. The largest multiple of 128 (up to `cap`) that divides both, else the whole
    dimension when I == O, else 128 (the kernel masks a partial last tile: Fx / mesh.tensor = 192,
    say). All three compile for TPU v5e (checked with libtpu, no TPU)."""
    fits = [t for t in range(128, min(cap, I, O) + 1, 128) if I % t == 0 and O % t == 0]
    if fits:
        return fits[-1]
    return I if I == O and I <= cap else 128


def _inverse(order: jax.Array) -> jax.Array:
    """The inverse of a permutation: y[_inverse(order)] undoes y = x[order]."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _combine(y_NxE: jax.Array, weights_XKx: jax.Array) -> jax.Array:
    """Pair outputs [Nx, E] in (token, choice) order -> their weighted sum per token [X, E]."""
    X, Kx = weights_XKx.shape
    return jnp.einsum("xk,xke->xe", weights_XKx, y_NxE.reshape(X, Kx, -1))


def _one_device(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down, *, ffn) -> jax.Array:
    """The pairs sorted by expert, the grouped MLPs, the outputs unsorted and combined."""
    Kx = experts_XKx.shape[1]
    experts_Nx = experts_XKx.reshape(-1)
    order_Nx = jnp.argsort(experts_Nx, stable=True)
    sizes_Ex = jnp.bincount(experts_Nx, length=w_gate.shape[0])
    y_NxE = ffn(x_XE[order_Nx // Kx], sizes_Ex, w_gate, w_up, w_down)
    return _combine(y_NxE[_inverse(order_Nx)], weights_XKx)


def _on_mesh(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down, *, mesh, ffn, check_vma: bool) -> jax.Array:
    """`_one_device` or `_exchange` per device under shard_map (module docstring)."""
    if "expert" not in mesh.axis_names:
        raise ValueError(f"experts on a mesh need its axes {BATCH} and 'tensor' (grpo_jax.runtime.sharding."
                         f"make_mesh), got {mesh.axis_names}")
    X, Ex, Fx = x_XE.shape[0], w_gate.shape[0], w_gate.shape[2]
    shards, Pe, tensor = math.prod(mesh.shape[a] for a in BATCH), mesh.shape["expert"], mesh.shape["tensor"]
    if X % shards:
        raise ValueError(f"experts on a mesh: {X} token rows do not split over data x fsdp x expert = {shards} "
                         "shards; make the batch a multiple of it")
    if Ex % Pe:
        raise ValueError(f"{Ex} experts do not split over mesh.expert={Pe}: make mesh.expert divide the "
                         "number of experts")
    f = "tensor" if tensor > 1 and Fx % tensor == 0 else None
    rows, w_in, w_out = P(BATCH, None), P("expert", None, f), P("expert", f, None)
    specs = (rows, rows, rows, w_in, w_in, w_out)
    local = _exchange_in_chunks if Pe > 1 else _one_device

    def body(*args):
        y_XE = local(*args, ffn=ffn)
        return jax.lax.psum(y_XE, "tensor") if f else y_XE

    args = (x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down)
    if AxisType.Explicit in mesh.axis_types:  # sharding in the types: shard_map asks them to match its specs
        args = tuple(jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=check_vma)(*args)


def exchange_chunks(X: int, Kx: int, Pe: int, row_bytes: int, budget: int | None = None) -> int:
    """The fewest chunks of a device's X tokens (a divisor of X) whose padded all-to-all buffer,
    Pe x (X / chunks) x Kx rows of `row_bytes`, fits `budget` (default `EXCHANGE_BYTES`); X when
    none does (one token at a time)."""
    budget = EXCHANGE_BYTES if budget is None else budget
    return next((c for c in range(1, X + 1) if X % c == 0 and Pe * (X // c) * Kx * row_bytes <= budget), X)


def _exchange_in_chunks(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down, *, ffn) -> jax.Array:
    """`_exchange` over `exchange_chunks` chunks of the tokens in turn, each one's buffers made
    again in the backward pass rather than kept."""
    (X, Kx), E = experts_XKx.shape, x_XE.shape[1]
    c = exchange_chunks(X, Kx, jax.lax.axis_size("expert"), E * x_XE.dtype.itemsize)
    if c == 1:
        return _exchange(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down, ffn=ffn)

    @jax.checkpoint
    def chunk(args):
        return _exchange(*args, w_gate, w_up, w_down, ffn=ffn)

    parts = (x_XE.reshape(c, X // c, E), experts_XKx.reshape(c, X // c, Kx), weights_XKx.reshape(c, X // c, Kx))
    return jax.lax.map(chunk, parts).reshape(X, E)


def _exchange(x_XE, experts_XKx, weights_XKx, w_gate, w_up, w_down, *, ffn) -> jax.Array:
    """One device's part of expert parallelism (inside shard_map, local shapes; w_* hold this
    device's Le experts, global ids p*Le .. p*Le+Le-1 on peer p of the `expert` axis): its pairs
    sorted by expert go to their experts' peers in a padded all-to-all (slot c of peer p's block
    holds this device's c-th pair for p; Nx slots per peer, the worst case), the peers' rows are
    run by the local experts, and the outputs come back by the same route."""
    (X, Kx), Le, E = experts_XKx.shape, w_gate.shape[0], x_XE.shape[1]
    Nx, Pe = X * Kx, jax.lax.axis_size("expert")
    experts_Nx = experts_XKx.reshape(-1)
    order_Nx = jnp.argsort(experts_Nx, stable=True)
    sorted_Nx = experts_Nx[order_Nx]
    peer_Nx = sorted_Nx // Le
    count_Pe = jnp.bincount(peer_Nx, length=Pe)
    start_Pe = jnp.cumsum(count_Pe) - count_Pe
    slot_Cb = jnp.arange(Nx)
    real_PeCb = slot_Cb[None, :] < count_Pe[:, None]
    pair_PeCb = jnp.where(real_PeCb, start_Pe[:, None] + slot_Cb[None, :], 0)  # index into the sorted pairs
    send_PeCbE = jnp.where(real_PeCb[..., None], x_XE[order_Nx[pair_PeCb] // Kx], 0)
    # The receiver's expert index of each slot; Le marks padding.
    local_PeCb = jnp.where(real_PeCb, sorted_Nx[pair_PeCb] - Le * jnp.arange(Pe)[:, None], Le)
    recv_PeCbE = jax.lax.all_to_all(send_PeCbE, "expert", 0, 0)
    recv_local_PeCb = jax.lax.all_to_all(local_PeCb, "expert", 0, 0)
    out_MrE = _run_received(recv_PeCbE.reshape(Pe * Nx, E), recv_local_PeCb.reshape(-1), w_gate, w_up, w_down,
                            ffn=ffn)
    back_PeCbE = jax.lax.all_to_all(out_MrE.reshape(Pe, Nx, E), "expert", 0, 0)
    y_sorted_NxE = back_PeCbE[peer_Nx, jnp.arange(Nx) - start_Pe[peer_Nx]]
    return _combine(y_sorted_NxE[_inverse(order_Nx)], weights_XKx)


def _run_received(rows_MrE, local_Mr, w_gate, w_up, w_down, *, ffn) -> jax.Array:
    """The local experts over the received rows (expert index `local_Mr`, Le for padding), in the
    order they arrived; padding rows give garbage, which no one reads (`_exchange` gathers the
    real slots only)."""
    Le = w_gate.shape[0]
    order_Mr = jnp.argsort(local_Mr, stable=True)  # padding (Le) last, past every group
    sizes_Le = jnp.bincount(local_Mr, length=Le)  # padding is out of range: not counted
    out_MrE = ffn(rows_MrE[order_Mr], sizes_Le, w_gate, w_up, w_down)
    return out_MrE[_inverse(order_Mr)]
