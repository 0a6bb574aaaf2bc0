"""Placeholder for the expert computation (the dense reference only); branch moe-ep replaces it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models.activations import activation as _activation

EXPERT_IMPLS = ("auto", "dense")


def expert_mlp(x_XE, experts_XK, weights_XK, w_gate, w_up, w_down, *, activation: str = "silu", impl: str = "auto",
               mesh=None):
    del impl, mesh
    num_experts = w_gate.shape[0]
    gate = jnp.einsum("xe,nef->nxf", x_XE, w_gate)
    up = jnp.einsum("xe,nef->nxf", x_XE, w_up)
    y = jnp.einsum("nxf,nfe->nxe", _activation(gate, activation) * up, w_down)
    combine = jnp.einsum("xk,xkn->nx", weights_XK, jax.nn.one_hot(experts_XK, num_experts, dtype=x_XE.dtype))
    return jnp.einsum("nx,nxe->xe", combine, y)
