"""The MLPs' activations by their Hugging Face names (`TransformerConfig.activation`)."""

from __future__ import annotations

import jax


def activation(x: jax.Array, name: str) -> jax.Array:
    """silu, gelu_pytorch_tanh (GELU's tanh approximation) or gelu (exact) of x."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.gelu(x, approximate=False)
