"""The reference the samplers' log-probs are checked against (tests/rollout/): one forward pass of
the model over prompt and completion, float64 log-softmax at each completion token."""

from __future__ import annotations

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
