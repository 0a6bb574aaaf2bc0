"""The reference the samplers' log-probs and experts are checked against (tests/rollout/,
tests/engine/, tests/episodes/): one forward pass of the model over prompt and completion, float64
log-softmax at each completion token, and the experts a mixture-of-experts model routes each token to."""

from __future__ import annotations

import functools

import numpy as np


def teacher_forced(model, prompt_ids, prompt_mask, tokens, *, group_size: int, temperature: float = 1.0) -> np.ndarray:
    """float64 [R, T]: log softmax(logits / temperature) of each of `tokens` [R, T] (R = N x G rows
    after the left-padded prompts [N, P]), every completion position attended (causal, so what
    follows a row's end does not change its earlier positions)."""
    p_ids, p_mask = (np.repeat(np.asarray(x), group_size, axis=0) for x in (prompt_ids, prompt_mask))
    tokens = np.asarray(tokens)
    logits = np.asarray(model(np.concatenate([p_ids, tokens], 1),
                              attention_mask=np.concatenate([p_mask, np.ones_like(tokens)], 1)), np.float64)
    pred = logits[:, p_ids.shape[1] - 1:-1] / temperature
    logp = pred - pred.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


@functools.lru_cache(maxsize=4)
def tiny_moe(vocab_size: int = 256):
    """The tests' tiny mixture-of-experts model (random float32 weights, 2 layers, 8 experts, 2 per
    token), one per vocabulary size and process."""
    from flax import nnx

    from grpo_jax.models import Transformer
    from grpo_jax.models.presets import tiny

    cfg = tiny("qwen3", vocab_size=vocab_size).replace(family="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                                      moe_intermediate_size=32)
    return Transformer(cfg, rngs=nnx.Rngs(0))


def teacher_forced_experts(model, prompt_ids, prompt_mask, tokens, *, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The experts a plain pass over each row's [prompt, tokens] sends every token to: (the prompts'
    [N, P, L, Kx], from each group's first row; the tokens' [R, T, L, Kx]). What follows a row's end
    does not change its earlier tokens' routing (causal)."""
    p_ids, p_mask = (np.repeat(np.asarray(x), group_size, axis=0) for x in (prompt_ids, prompt_mask))
    tokens = np.asarray(tokens)
    _, routing = model.routed_hidden_states(np.concatenate([p_ids, tokens], 1),
                                            attention_mask=np.concatenate([p_mask, np.ones_like(tokens)], 1))
    experts = np.asarray(routing.experts)
    P = p_ids.shape[1]
    return experts[::group_size, :P], experts[:, P:]


def assert_same_experts(got: np.ndarray, want: np.ndarray, where: np.ndarray, what: str) -> None:
    """The expert sets [..., L, Kx] of `got` and `want` agree at every position of `where` (their
    order within a token's top-k is not compared: replay uses the set)."""
    got, want = np.sort(np.asarray(got)[where], -1), np.sort(np.asarray(want)[where], -1)
    assert got.size and (got == want).all(), f"{what}: {(got != want).any(axis=(-1, -2)).sum()} of {len(got)} differ"
