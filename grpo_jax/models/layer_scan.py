"""The decoder layers run as one scan (or unrolled), each under `model.remat`'s checkpoint policy:
what a layer keeps for its backward pass, and the names the policies refer to ("qkv" and "attention"
from the layer bodies, "layer_input" from `run_layers` itself). Used by the plain pass
(`Transformer._run`) and the shared-prompt pass (`models.grouped`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from grpo_jax.config import REMATS
from grpo_jax.models.config import DENSE_MLP, EXPERT_PARAMS, TransformerConfig

# model.remat -> what a layer keeps for its backward pass (a jax.checkpoint policy; "none": no
# checkpoint at all). `dots_with_no_batch_dims_saveable` keeps the weight matmuls' outputs (the
# projections and the MLP) and not attention's score and probability products, which are batched
# over heads: those are recomputed, and they are the [B, H, T, T] arrays that grow with T^2.
# "attention" keeps q/k/v and attention's output (named in `_run`) and recomputes norms and the MLP:
# the backward pass never reruns attention, the part of a long sequence's layer that grows with T.
REMAT_POLICIES = {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "attention": jax.checkpoint_policies.save_only_these_names("qkv", "attention"),
                  "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
                      names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
                      offload_src="device", offload_dst="pinned_host")}
assert tuple(REMAT_POLICIES) == REMATS, "one policy per model.remat choice"


class MixedMLP(NamedTuple):
    """A scanned layer's MLP in a mixed dense/MoE stack: whether it is experts (a traced bool),
    its index in that MLP's stack, and both stacks whole ([Lm, ...] and [Ld, ...]); the layer
    slices the one it runs (`layers.finish_layer`), in the compute dtype."""

    sparse: jax.Array
    slot: jax.Array
    experts: dict
    dense: dict


def compute_dtype(p: dict, dtype) -> dict:
    """One layer's arrays with the floating ones cast to the compute dtype (dropout keys stay as
    they are; a mixed stack's `MixedMLP` is cast where it is sliced)."""
    return {n: a.astype(dtype) if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating) else a
            for n, a in p.items()}


def mlp_stack(cfg: TransformerConfig, name: str) -> str:
    """Which stack a layer parameter (or LoRA adapter) `name` of a mixed model is in: "experts",
    "dense" (the MLP's of those layers) or "layers" (every layer's)."""
    base = name.split("_lora_")[0]
    if cfg.mixed and base in EXPERT_PARAMS:
        return "experts"
    if cfg.mixed and base in DENSE_MLP:
        return "dense"
    return "layers"


def stack_size(config: TransformerConfig, name: str) -> int:
    """How many layers parameter `name` (a `layer_param_specs` name, or a LoRA adapter's) is stacked
    over: every layer, or in a mixed stack its MLP's layers (the sparse or the dense ones)."""
    stack = mlp_stack(config, name)
    return {"layers": config.num_layers, "experts": len(config.sparse_layers),
            "dense": len(config.dense_layers)}[stack]


def layer_params(cfg: TransformerConfig, arrays: dict, layer: int) -> dict:
    """Layer `layer`'s parameters from the stacked `arrays`: every layer's slice, and in a mixed
    stack the slice of its own MLP's stack (the other MLP's parameters are not its)."""
    out = {}
    for name, a in arrays.items():
        stack = mlp_stack(cfg, name)
        if stack == "layers":
            out[name] = a[layer]
        elif (stack == "experts") == cfg.layer_is_sparse(layer):
            out[name] = a[cfg.mlp_slot(layer)]
    return out


def run_layers(model, body, x0, *, dropout_key: jax.Array | None = None, row_sharding=None, extra=None):
    """Run `body(x, (layer params, kind index, extra's slice)) -> (x, y)` over the model's layers -> (x, ys stacked
    on a leading layers axis, or None), each layer under `model.remat`'s checkpoint policy (what its
    backward pass recomputes; `REMAT_POLICIES`): one `lax.scan` when `model.scan_layers`, else
    unrolled over per-layer weights (split from the stacked arrays with `jnp.split`, whose gradient
    is one concatenation rather than a padded sum per layer).
    `dropout_key`: see `Layers.arrays`. `extra`: arrays with a leading layers axis (or None), handed
    to `body` one layer's slice at a time (routing replay's experts).

    `row_sharding` (a Sharding of the rows of x, e.g. split over the mesh's batch axes; None: let
    XLA choose): every layer's input and output are held to it. Without it, XLA takes the split of
    the embedding table's `embed` axis (fsdp) for the activations from the first lookup on, so each
    device holds every row of a micro-batch in slices of E: the train step of Qwen3-1.7B on 32
    devices needed 13.6 GiB of temporaries per device instead of 5.3 (`grpo-jax bench memory`)."""
    if row_sharding is not None:
        body = _held_to(body, row_sharding)
        x0 = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, row_sharding), x0)
    if model.remat != "none":
        body = jax.checkpoint(_inputs_named(body), prevent_cse=False, policy=REMAT_POLICIES[model.remat])
    cfg, arrays = model.config, model.layers.arrays(dropout_key)
    if model.scan_layers:
        if not cfg.mixed:
            return jax.lax.scan(body, x0, (arrays, _kind_index(cfg), extra))
        return _scan_mixed(cfg, body, x0, arrays, extra)
    per_layer = {n: jnp.split(a, a.shape[0]) for n, a in arrays.items()}
    x, ys = x0, []
    for l, kind in enumerate(cfg.layer_types):
        extra_l = jax.tree.map(lambda a: a[l], extra)
        x, y = body(x, ({n: a[0] for n, a in layer_params(cfg, per_layer, l).items()}, cfg.kinds.index(kind),
                        extra_l))
        ys.append(y)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys[0] is not None else None


def _scan_mixed(cfg: TransformerConfig, body, x0, arrays: dict, extra):
    """`run_layers`' scan over a mixed dense/MoE stack: every layer's parameters are scanned; the
    two MLP stacks are passed whole in a `MixedMLP` with the layer's kind and slot (loop-invariant:
    JAX keeps them out of the scan's saved residuals)."""
    groups = {"layers": {}, "experts": {}, "dense": {}}
    for name, a in arrays.items():
        groups[mlp_stack(cfg, name)][name] = a
    sparse = jnp.asarray([cfg.layer_is_sparse(l) for l in range(cfg.num_layers)])
    slots = jnp.asarray([cfg.mlp_slot(l) for l in range(cfg.num_layers)], jnp.int32)

    def step(x, xs):
        p, kind, extra_l, (is_sparse, slot) = xs
        return body(x, ({**p, "mlp": MixedMLP(is_sparse, slot, groups["experts"], groups["dense"])}, kind, extra_l))

    return jax.lax.scan(step, x0, (groups["layers"], _kind_index(cfg), extra, (sparse, slots)))


def _inputs_named(body):
    """`body` whose input carry is named "layer_input" (`checkpoint_name`): what `model.remat:
    offload` moves to host memory between the forward and the backward pass."""
    def named(x, xs):
        return body(jax.tree.map(lambda a: checkpoint_name(a, "layer_input"), x), xs)

    return named


def _held_to(body, sharding):
    """`body` whose output carry (the layer's output x, one array or a tuple) keeps `sharding`."""
    def held(x, xs):
        x, y = body(x, xs)
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), x), y

    return held


def _kind_index(cfg: TransformerConfig) -> jax.Array:
    """int32 [L]: each layer's index into `cfg.kinds` (its attention kind: full / sliding)."""
    return jnp.asarray([cfg.kinds.index(t) for t in cfg.layer_types], jnp.int32)
