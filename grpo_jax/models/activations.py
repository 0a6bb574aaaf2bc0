"""The MLP activations by the names Hugging Face configs give them (`hidden_act`). A leaf of the
package: the dense MLP (grpo_jax.models.layers) and the experts (grpo_jax.models.experts) both
apply them, and the experts cannot import `layers`, which calls them."""

from __future__ import annotations

import jax

from grpo_jax.models.config import ACTIVATIONS


def activation(x: jax.Array, name: str) -> jax.Array:
    """`name`'s activation of `x`: silu, gelu_pytorch_tanh (tanh approximation) or gelu (exact)."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unknown activation {name!r}: one of {ACTIVATIONS}")
