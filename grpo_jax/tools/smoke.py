"""`grpo-jax smoke`: the model stack end to end on a tiny random model, in seconds."""

from __future__ import annotations

import time
from pathlib import Path

from grpo_jax.config import SamplingConfig

MIN_NEW_TOKENS = 2  # one cached decode step after the prefill's token
MAX_ABS_DIFF = 1e-4  # allowed gap between the cached decode's log-probs and a full pass's


def smoke(*, family: str = "qwen3", output: str | Path = "runs/smoke/model", new_tokens: int = 16,
          seed: int = 0) -> dict:
    """Build a tiny random model of `family`, save and reload it in HF format at `output`, decode
    greedily with the sampler (prefill + cached decode steps, as training runs them) and check its
    log-probs against a full pass. Returns a summary whose `cache_vs_full_max_abs_diff` should stay
    within MAX_ABS_DIFF."""
    if new_tokens < MIN_NEW_TOKENS:
        raise ValueError(f"new_tokens must be at least {MIN_NEW_TOKENS}, got {new_tokens}")
    import jax
    import numpy as np
    from flax import nnx

    from grpo_jax.learner.logprobs import completion_logprobs
    from grpo_jax.models import Transformer, from_pretrained, save_pretrained
    from grpo_jax.models.presets import tiny
    from grpo_jax.engine.sampling import generate

    t0 = time.perf_counter()
    config = tiny(family)
    out = Path(output)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(seed)), out)
    model = from_pretrained(out)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (8, 5, 3, 6)]  # left-padded to 8
    sampling = SamplingConfig(group_size=1, max_new_tokens=new_tokens, temperature=0.0, prompt_buckets=(8,))
    rollout = jax.block_until_ready(generate(model, prompts, sampling, jax.random.key(seed)))  # compiles
    t_decode = time.perf_counter()
    jax.block_until_ready(generate(model, prompts, sampling, jax.random.key(seed)).tokens)
    decode_s = time.perf_counter() - t_decode
    # Teacher-forced log-probs of the generated tokens: what the KV-cache decode must reproduce.
    full, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.tokens)
    return {
        "family": family,
        "model_dir": str(out),
        "generated": np.asarray(rollout.tokens).tolist(),
        # Of the generated tokens' log-probs.
        "cache_vs_full_max_abs_diff": float(np.abs(np.asarray(full) - np.asarray(rollout.logprobs)).max()),
        # One compiled generate (prefill + decode loop) on 4 rows: a smoke figure, not a benchmark.
        "decode_tokens_per_s": round(len(prompts) * new_tokens / decode_s, 1),
        "total_s": round(time.perf_counter() - t0, 2),
    }
