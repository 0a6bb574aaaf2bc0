"""LoRA adapters on the decoder's projections: adding, splitting, merging and PEFT export.

`add_adapters(model, rank=..., alpha=..., targets=..., key=...)` gives each targeted projection W
(q, k, v, o, gate, up, down; stacked over layers like W) a pair A [I, A], B [A, O] stored as
`LoRAParam`s in the model's `Layers` (`q_proj_lora_a`, `q_proj_lora_b`, ...). The layer then
computes x W + (alpha / r) (x A) B:

- in the training, reference and prefill passes unmerged (`Layers.arrays()` hands A and the scaled
  B to the layer functions, which add the low-rank path beside W), so the backward pass never
  forms a gradient the size of W;
- in the sampler's decode steps merged (`Transformer.layer_weights()` folds W + (alpha / r) A B
  once per `generate`, before the decode loop), so decoding costs what it costs without adapters
  and the rollout uses the adapters by construction.

A is drawn N(0, 1 / in_features), B starts at 0: fresh adapters give exactly the base model's
logits. The adapters carry the logical axes of the weight they adapt (and `lora_rank`,
replicated), so the mesh shards them like that weight. `split_adapters` separates the trainable
adapters from the frozen base (`nnx.split(model, LoRAParam, nnx.Param)`); `merge_adapters` folds
them into a plain model (the HF export), `strip_adapters` drops them (the base), `save_peft` writes
them in PEFT's format. Where a LoRA run's base lives and how checkpoints name it: grpo_jax.trainer.lora_base.

Shape letters: grpo_jax.shapes (A, the rank, is PEFT's `r`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.config import LORA_TARGETS as TARGETS

# Input dims (after the layers axis) of each projection's weight; the rest are its output dims.
_IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}


class LoRAParam(nnx.Param):
    """An adapter matrix: trainable while the base's `nnx.Param`s stay frozen."""


def add_adapters(model, *, rank: int, alpha: float, targets: tuple[str, ...] = TARGETS, key: jax.Array,
                 dropout: float = 0.0) -> None:
    """Give `model`'s targeted projections fresh adapters (in place; see the module docstring).
    `dropout`: the rate at which an adapter's inputs are dropped in a pass given a dropout key
    (`Transformer.hidden_states(dropout_key=...)`: the training pass); other passes never drop."""
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"LoRA targets {list(targets)}: choose from {list(TARGETS)}")
    layers = model.layers
    missing = [t for t in targets if not hasattr(layers, t)]
    if missing:
        raise ValueError(f"LoRA targets {missing} are not in this model: a mixture-of-experts model's MLPs are "
                         "experts, with no gate_proj/up_proj/down_proj; set lora.targets to the attention "
                         "projections (q_proj, k_proj, v_proj, o_proj)")
    if getattr(layers, "lora_scale", None) is not None:
        raise ValueError("the model already has LoRA adapters")
    for i, name in enumerate(targets):
        w = getattr(layers, name)
        axes = w.get_metadata()["logical_axes"]
        shape = w[...].shape
        n_in = _IN_DIMS[name]
        in_shape, out_shape = shape[1:1 + n_in], shape[1 + n_in:]
        fan_in = math.prod(in_shape)
        a = jax.random.normal(jax.random.fold_in(key, i), (shape[0], *in_shape, rank), jnp.float32) / math.sqrt(fan_in)
        # Adapters are float32 whatever the base's storage dtype (a bf16 base halves the frozen
        # weights' memory; Adam's small steps on bf16 adapters would round away).
        setattr(layers, f"{name}_lora_a", LoRAParam(a, logical_axes=(axes[0], *axes[1:1 + n_in], "lora_rank")))
        setattr(layers, f"{name}_lora_b", LoRAParam(jnp.zeros((shape[0], rank, *out_shape), jnp.float32),
                                                    logical_axes=(axes[0], "lora_rank", *axes[1 + n_in:])))
    layers.lora_scale = float(alpha) / rank
    layers.lora_dropout = float(dropout)


def dropped(x_XI: jax.Array, key_data: jax.Array, keep: jax.Array, name: str) -> jax.Array:
    """x with each entry kept with probability `keep` (and scaled by 1 / keep) or zeroed: PEFT's
    lora_dropout on projection `name`'s adapter input. `key_data`: this layer's key (raw uint32
    words, which survive the layer scan's slicing); each projection and input size draws its own mask."""
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), TARGETS.index(name))
    key = jax.random.fold_in(key, x_XI.shape[0])  # the grouped pass's prompt and completion inputs differ
    return jnp.where(jax.random.bernoulli(key, keep, x_XI.shape), x_XI / keep.astype(x_XI.dtype), 0).astype(x_XI.dtype)


def has_adapters(model) -> bool:
    return getattr(model.layers, "lora_scale", None) is not None


def split_adapters(model):
    """(graphdef, adapters state, base state): the trainable and the frozen parameters."""
    return nnx.split(model, LoRAParam, nnx.Param)


def low_rank(x_XI: jax.Array, a_IA: jax.Array, b_AO: jax.Array) -> jax.Array:
    """(x A) B [X, O] for x [X, I] and the (scaled) adapter pair flattened to [I, A], [A, O]."""
    return (x_XI @ a_IA.astype(x_XI.dtype)) @ b_AO.astype(x_XI.dtype)


def merged(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One layer's weights (as `Layers.arrays()` gives them: B already scaled) with each adapter
    folded into its weight, W + A B, and the adapters dropped."""
    out = {k: v for k, v in p.items() if "_lora_" not in k}
    for name in TARGETS:
        if f"{name}_lora_a" in p:
            w, a, b = p[name], p[f"{name}_lora_a"], p[f"{name}_lora_b"]
            delta = a.reshape(-1, a.shape[-1]).astype(jnp.float32) @ b.reshape(b.shape[0], -1).astype(jnp.float32)
            out[name] = (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
    return out


def merge_adapters(model):
    """A copy of `model` with every adapter folded into its weight (W + (alpha / r) A B) and the
    adapters removed: a plain model that computes what the adapted one does (to export, or to
    compare against)."""
    model = nnx.clone(model)
    layers = model.layers
    if layers.lora_scale is None:
        return model
    for name in TARGETS:
        if not hasattr(layers, f"{name}_lora_a"):
            continue
        w = getattr(layers, name)
        a, b = getattr(layers, f"{name}_lora_a")[...], getattr(layers, f"{name}_lora_b")[...]
        L, r = a.shape[0], a.shape[-1]
        delta = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32),
                           b.reshape(L, r, -1).astype(jnp.float32)) * layers.lora_scale
        w[...] = (w[...].astype(jnp.float32) + delta.reshape(w[...].shape)).astype(w[...].dtype)
        delattr(layers, f"{name}_lora_a")
        delattr(layers, f"{name}_lora_b")
    layers.lora_scale = None
    layers.lora_dropout = 0.0
    return model


def strip_adapters(model):
    """A copy of `model` without its adapters (the base it adapts, unchanged)."""
    model = nnx.clone(model)
    layers = model.layers
    for name in TARGETS:
        for part in ("a", "b"):
            if hasattr(layers, f"{name}_lora_{part}"):
                delattr(layers, f"{name}_lora_{part}")
    layers.lora_scale = None
    layers.lora_dropout = 0.0
    return model


# Our projection -> its module path inside an HF decoder layer (PEFT's target_modules use the last part).
_HF_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
               "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
               "down_proj": "mlp.down_proj"}


def peft_state_dict(model) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, adapter config) of `model`'s adapters in PEFT's LoRA format: for each layer i and
    projection, `base_model.model.model.layers.{i}.<module>.lora_A.weight` [r, in] and `lora_B.weight`
    [out, r], with `lora_alpha` / `r` as PEFT's scaling (HF linear weights are [out, in], ours
    [in, out], with the same input and output orders)."""
    layers = model.layers
    if layers.lora_scale is None:
        raise ValueError("the model has no LoRA adapters to export in PEFT format")
    tensors, targets, rank = {}, [], None
    for name in TARGETS:
        if not hasattr(layers, f"{name}_lora_a"):
            continue
        targets.append(name)
        a = np.asarray(jax.device_get(getattr(layers, f"{name}_lora_a")[...]), np.float32)
        b = np.asarray(jax.device_get(getattr(layers, f"{name}_lora_b")[...]), np.float32)
        L, rank = a.shape[0], a.shape[-1]
        for i in range(L):
            prefix = f"base_model.model.model.layers.{i}.{_HF_MODULES[name]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": layers.lora_scale * rank,
              "lora_dropout": layers.lora_dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    return tensors, config


def save_peft(model, path, *, base_model_name_or_path: str) -> Path:
    """Write `model`'s adapters as a PEFT adapter directory (`adapter_config.json` +
    `adapter_model.safetensors`) whose base is `base_model_name_or_path` (an HF directory or hub
    name holding the weights they adapt): `peft.PeftModel.from_pretrained(base, path)` on the
    transformers base computes what the adapted model does."""
    from safetensors.numpy import save_file

    tensors, config = peft_state_dict(model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config["base_model_name_or_path"] = str(base_model_name_or_path)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
