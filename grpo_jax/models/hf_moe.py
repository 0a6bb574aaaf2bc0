"""Mixture-of-experts weights (Qwen3-MoE, Mixtral) in Hugging Face checkpoints <-> our expert parameters.

Ours, per layer (stacked over layers like every layer parameter): `router` [E, Ex], `expert_gate`
and `expert_up` [Ex, E, Fx], `expert_down` [Ex, Fx, E] (Ex experts of width Fx; shapes.py for E).
Checkpoints hold them in one of two layouts, told apart per layer:
- per expert, as published checkpoints have them and as transformers 5.25's `save_pretrained`
  writes them (it converts its fused tensors back on save): Qwen3-MoE's `mlp.gate.weight` [Ex, E]
  and `mlp.experts.{j}.gate_proj.weight` / `up_proj` [Fx, E] / `down_proj` [E, Fx]; Mixtral's
  `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{j}.w1` (gate) / `w3` (up) / `w2`
  (down). `save_pretrained` here writes this layout.
- fused, as transformers 5 holds the weights in memory (and writes them with
  `save_pretrained(save_original_format=False)`), for both families: `mlp.gate.weight` [Ex, E],
  `mlp.experts.gate_up_proj` [Ex, 2Fx, E] (the gate's Fx rows first) and `mlp.experts.down_proj`
  [Ex, E, Fx].
A layer whose `mlp.experts.gate_up_proj` exists is read fused, any other per expert; tensors of the
layout not read are left unused, which the loader refuses. Each parameter is filled in place into
one array [L, ...] allocated up front, so reading holds the result plus one checkpoint tensor,
never a second copy of the experts (128 experts x 48 layers in Qwen3-30B-A3B).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from grpo_jax.models.config import TransformerConfig
from grpo_jax.models.hf_tensors import TensorReader, read_tensor

MOE_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")

# family -> (the MoE block's name inside `layers.{i}.` in the per-expert layout, our expert
# parameter -> that family's name of the expert's projection).
_PER_EXPERT = {
    "qwen3_moe": ("mlp", {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"}),
}


def _block_names(config: TransformerConfig) -> tuple[str, dict[str, str]]:
    if config.family not in _PER_EXPERT:
        raise ValueError(f"no mixture-of-experts checkpoint layout for family {config.family!r}; "
                         f"known: {sorted(_PER_EXPERT)}")
    return _PER_EXPERT[config.family]


def read_experts(reader: TensorReader, config: TransformerConfig, prefix: str, np_dtype,
                 used: set[str]) -> dict[tuple[str, str], np.ndarray]:
    """Every expert layer's parameters from `reader` (names under `{prefix}layers.{i}.`), each as
    one array [Lm, ...] (the sparse layers, in order) of `np_dtype` in our layout, keyed by NNX state path; the tensors read are
    added to `used`. A missing or mis-shaped tensor is a ValueError naming it (`read_tensor`)."""
    E, Ex, Fx = config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes = {"router": (E, Ex), "expert_gate": (Ex, E, Fx), "expert_up": (Ex, E, Fx), "expert_down": (Ex, Fx, E)}
    sparse = config.sparse_layers  # every layer, or a mixed stack's expert layers
    out = {name: np.empty((len(sparse), *shape), np_dtype) for name, shape in shapes.items()}
    for j, i in enumerate(sparse):
        layer = {name: array[j] for name, array in out.items()}
        if f"{prefix}layers.{i}.mlp.experts.gate_up_proj" in reader.location:
            _read_fused(reader, config, f"{prefix}layers.{i}.", layer, used)
        else:
            _read_per_expert(reader, config, f"{prefix}layers.{i}.", layer, used)
    return {("layers", name): array for name, array in out.items()}


def _read_fused(reader: TensorReader, config: TransformerConfig, p: str, layer: dict[str, np.ndarray],
                used: set[str]) -> None:
    """One layer's experts from transformers' in-memory layout into the views `layer` (ours)."""
    E, Ex, Fx = config.hidden_size, config.num_experts, config.moe_intermediate_size
    layer["router"][...] = read_tensor(reader, f"{p}mlp.gate.weight", (Ex, E), used).T
    gate_up = read_tensor(reader, f"{p}mlp.experts.gate_up_proj", (Ex, 2 * Fx, E), used)
    layer["expert_gate"][...] = gate_up[:, :Fx].transpose(0, 2, 1)
    layer["expert_up"][...] = gate_up[:, Fx:].transpose(0, 2, 1)
    del gate_up
    layer["expert_down"][...] = read_tensor(reader, f"{p}mlp.experts.down_proj", (Ex, E, Fx), used).transpose(0, 2, 1)


def _read_per_expert(reader: TensorReader, config: TransformerConfig, p: str, layer: dict[str, np.ndarray],
                     used: set[str]) -> None:
    """One layer's experts from the published layout (one tensor per expert and projection)."""
    E, Fx = config.hidden_size, config.moe_intermediate_size
    block, names = _block_names(config)
    layer["router"][...] = read_tensor(reader, f"{p}{block}.gate.weight", (config.num_experts, E), used).T
    hf_shapes = {"expert_gate": (Fx, E), "expert_up": (Fx, E), "expert_down": (E, Fx)}
    for j in range(config.num_experts):
        for ours, theirs in names.items():
            layer[ours][j] = read_tensor(reader, f"{p}{block}.experts.{j}.{theirs}.weight", hf_shapes[ours], used).T


def expert_tensors(config: TransformerConfig, arrays: Mapping[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """The `i`-th expert layer's parameters (`arrays`: our parameters, the experts' stacked [Lm, ...]) under
    their per-expert Hugging Face names after `model.layers.{i}.`, as published checkpoints have them."""
    block, names = _block_names(config)
    out = {f"{block}.gate.weight": np.ascontiguousarray(arrays["router"][i].T)}
    for j in range(config.num_experts):
        for ours, theirs in names.items():
            out[f"{block}.experts.{j}.{theirs}.weight"] = np.ascontiguousarray(arrays[ours][i, j].T)
    return out
