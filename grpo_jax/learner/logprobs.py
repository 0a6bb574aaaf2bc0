"""Per-token log-probabilities and entropies computed in chunks over the sequence.

The [B, T, V] logits are never materialised: a `lax.scan` over chunks of C positions computes
[B, C, V] logits from the hidden states, reduces them to log-prob and entropy, and is
rematerialised (`jax.checkpoint`) so the backward pass recomputes each chunk's logits instead of
storing them. Peak memory grows with C, not with T. `completion_logprobs` can run a group's
shared prompt once (`group_size`), for the policy and reference passes of a GRPO batch.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from grpo_jax.models.grouped import grouped_routed_hidden_states


def chunked_logprobs(hidden: jax.Array, targets: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], *,
                     chunk: int = 128, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(log p(targets) [B, T], entropy [B, T]) under softmax(logits_fn(h) / temperature), float32.

    `logits_fn` maps hidden states [B, C, E] to logits [B, C, V] (e.g. `model.logits`). T is padded
    up to a multiple of `chunk` internally; pick chunk to divide T to avoid the padding.
    """
    chex.assert_rank(hidden, 3)
    B, T, E = hidden.shape
    chex.assert_shape(targets, (B, T))
    if temperature <= 0:
        raise ValueError(f"log-probs need a positive temperature, got {temperature}")
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (T + pad) // C
    h_nBCE = hidden.reshape(B, n, C, E).transpose(1, 0, 2, 3)
    t_nBC = targets.reshape(B, n, C).transpose(1, 0, 2)

    @jax.checkpoint
    def one_chunk(h_BCE, t_BC):
        logits = logits_fn(h_BCE).astype(jnp.float32) / temperature
        logp_BCV = jax.nn.log_softmax(logits, axis=-1)
        logp_BC = jnp.take_along_axis(logp_BCV, t_BC[..., None], axis=-1)[..., 0]
        entropy_BC = -jnp.sum(jnp.exp(logp_BCV) * logp_BCV, axis=-1)
        return logp_BC, entropy_BC

    _, (logp_nBC, ent_nBC) = jax.lax.scan(lambda c, xs: (c, one_chunk(*xs)), None, (h_nBCE, t_nBC))
    logp_BT = logp_nBC.transpose(1, 0, 2).reshape(B, n * C)[:, :T]
    ent_BT = ent_nBC.transpose(1, 0, 2).reshape(B, n * C)[:, :T]
    return logp_BT, ent_BT


def completion_states(model, prompt_ids: jax.Array, prompt_mask: jax.Array, completion_ids: jax.Array, *,
                      group_size: int = 1, dropout_key: jax.Array | None = None, row_sharding=None,
                      experts: tuple[jax.Array, jax.Array] | None = None, replay: bool = True,
                      completion_mask: jax.Array | None = None, with_routing: bool = False):
    """The hidden states [R, M, E] that predict each completion token (int [R, M]) given its prompt
    (int [R, P], left-padded, prompt_mask [R, P]) and the tokens before it: state t is the one
    before token t (feed to `model.logits`, or to a value head: the critic's state for token t).

    group_size=G > 1: rows i*G .. i*G+G-1 share prompt i (the sampler's layout; only the first row
    of each group is read), which then runs once per group (`models.grouped`): N x P + R x M tokens
    instead of R x (P + M), with the same result up to float rounding.

    dropout_key: apply the LoRA adapters' input dropout (the training pass; `Layers.arrays`).
    row_sharding: where the activations' rows live on a mesh (`models.layer_scan.run_layers`).

    A mixture-of-experts model: `experts` (the sampler's: prompt [R, P, L, Kx], completion [R, M,
    L, Kx]) are replayed (`replay`, `moe.routing_replay: sampler`), or only compared with the
    router's own choice (`Routing.mismatch`). `with_routing`: return (states, `moe.Routing` or
    None); its statistics count the prompt's real tokens and the completion tokens whose state
    predicts a token of `completion_mask` (default all): the states the loss reads.
    """
    prompt_ids_RP, prompt_mask_RP, completion_ids_RM = prompt_ids, prompt_mask, completion_ids
    chex.assert_rank([prompt_ids_RP, prompt_mask_RP, completion_ids_RM], 2)
    R, P = prompt_ids_RP.shape
    scored_RM = jnp.ones_like(completion_ids_RM) if completion_mask is None else completion_mask
    # Completion token t's state predicts token t + 1.
    scored_RM = jnp.concatenate([scored_RM[:, 1:], jnp.zeros_like(scored_RM[:, :1])], axis=1)
    if experts is not None and not model.config.is_moe:
        experts = None  # a dense model (e.g. a distillation teacher) has nothing to route
    if group_size > 1:
        if R % group_size:
            raise ValueError(f"{R} rows are not whole groups of group_size={group_size}")
        N = R // group_size
        first = (lambda a: a.reshape(N, group_size, *a.shape[1:])[:, 0])
        h_NPE, h_RME, routed = grouped_routed_hidden_states(
            model, first(prompt_ids_RP), first(prompt_mask_RP), completion_ids_RM, dropout_key=dropout_key,
            row_sharding=row_sharding, prompt_routing=None if experts is None else first(experts[0]),
            completion_routing=None if experts is None else experts[1], completion_mask=scored_RM, replay=replay)
        # The prompt's last position predicts completion token 0, completion position t token t+1.
        h_R1E = jnp.repeat(h_NPE[:, -1:], group_size, axis=0)
        h_RME = jnp.concatenate([h_R1E, h_RME[:, :-1]], axis=1)
        return (h_RME, routed) if with_routing else h_RME
    ids = jnp.concatenate([prompt_ids_RP, completion_ids_RM], axis=1)
    mask = jnp.concatenate([prompt_mask_RP, jnp.ones_like(completion_ids_RM)], axis=1)
    counted = jnp.concatenate([prompt_mask_RP, scored_RM], axis=1)
    routing = None if experts is None else jnp.concatenate(experts, axis=1)
    # Position P-1+t predicts completion token t.
    h_BTE, routed = model.routed_hidden_states(ids, attention_mask=mask, dropout_key=dropout_key,
                                               row_sharding=row_sharding, routing=routing, replay=replay,
                                               counted=counted)
    h_RME = h_BTE[:, P - 1:-1]
    return (h_RME, routed) if with_routing else h_RME


def completion_logprobs(model, prompt_ids: jax.Array, prompt_mask: jax.Array, completion_ids: jax.Array, *,
                        chunk: int = 128, temperature: float = 1.0, group_size: int = 1,
                        row_sharding=None, experts: tuple[jax.Array, jax.Array] | None = None,
                        replay: bool = True) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies float32 [R, M] of each completion token (int [R, M]) given its prompt
    and the tokens before it; arguments as `completion_states`."""
    h_RME = completion_states(model, prompt_ids, prompt_mask, completion_ids, group_size=group_size,
                              row_sharding=row_sharding, experts=experts, replay=replay)
    return chunked_logprobs(h_RME, completion_ids, model.logits, chunk=chunk, temperature=temperature)
