"""transformers' engines on a `bench engine` workload (`--peer transformers`): its continuous
batching (`model.generate_batch`, transformers.generation.continuous_batching) and its plain
`generate`, on the same weights (our model written by `save_pretrained`, loaded by
`AutoModelForCausalLM.from_pretrained`), prompts, lengths and sampling settings, each as a runner
that returns an `EngineRun` like ours.

Continuous batching runs twice: sized to the workload's KV budget (`max_requests_per_batch` =
sampling.slots sequences at once, enough pages for them and the prompts) and with its own sizing
from free memory (`auto`); the comparison takes the faster. Its pages need no flash attention:
on CPU it runs SDPA over the paged cache with an explicit mask.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Callable

import numpy as np

from grpo_jax.models import save_pretrained
from grpo_jax.tools.bench.engine_runs import EngineRun, Workload
from grpo_jax.tools.bench.parity import require_torch

PAGE_SIZE = 256  # transformers' default page (tokens per layer per block)


def _lengths(generated: list[list[int]], stops: tuple[int, ...], max_new_tokens: int):
    """(lengths, truncated) of completions: up to and including the first stop token."""
    lengths, truncated = [], []
    for row in generated:
        hit = [i for i, t in enumerate(row[:max_new_tokens]) if t in stops]
        lengths.append(hit[0] + 1 if hit else min(len(row), max_new_tokens))
        truncated.append(not hit)
    return np.asarray(lengths, np.int32), np.asarray(truncated)


def _load(w: Workload):
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(w.model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return hf.eval()


def _sampling_kwargs(w: Workload) -> dict:
    s = w.sampling
    fixed = s.min_new_tokens == s.max_new_tokens  # no stop token can be drawn: none is passed
    return dict(do_sample=s.temperature > 0, temperature=s.temperature if s.temperature > 0 else None,
                top_k=s.top_k, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                min_new_tokens=s.min_new_tokens or None, eos_token_id=None if fixed else list(s.stop_token_ids),
                pad_token_id=s.pad_id)


def _generate_runner(hf, w: Workload, seed: int) -> Callable[[], EngineRun]:
    """transformers' `generate` on every row at once: the prompts left-padded as ours, repeated G times."""
    import torch

    G, s = w.sampling.group_size, w.sampling
    ids = torch.as_tensor(np.repeat(w.ids, G, axis=0), dtype=torch.long)
    mask = torch.as_tensor(np.repeat(w.mask, G, axis=0), dtype=torch.long)
    stops = () if s.min_new_tokens == s.max_new_tokens else s.stop_token_ids

    def run() -> EngineRun:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, **_sampling_kwargs(w))
        generated = out[:, ids.shape[1]:].tolist()
        lengths, truncated = _lengths(generated, stops, s.max_new_tokens)
        steps = len(generated[0])
        return EngineRun(lengths=lengths, truncated=truncated, draw_steps=steps, slot_steps=len(generated) * steps)

    return run


def _batch_runner(hf, w: Workload, cb_config) -> Callable[[], EngineRun]:
    """transformers' continuous batching over the prompts, G samples each (num_return_sequences)."""
    import torch
    from transformers import GenerationConfig

    s = w.sampling
    stops = () if s.min_new_tokens == s.max_new_tokens else s.stop_token_ids
    config = GenerationConfig(num_return_sequences=s.group_size, **_sampling_kwargs(w))

    def run() -> EngineRun:
        with torch.inference_mode():
            out = hf.generate_batch(inputs=w.prompts, generation_config=config,
                                    continuous_batching_config=cb_config, warmup=False)
        failed = [k for k, v in out.items() if v.error is not None]
        if len(out) != w.rows or failed:
            raise RuntimeError(f"generate_batch returned {len(out)} of {w.rows} sequences, {len(failed)} failed")
        lengths, truncated = _lengths([list(v.generated_tokens) for v in out.values()], stops, s.max_new_tokens)
        return EngineRun(lengths=lengths, truncated=truncated, draw_steps=0, slot_steps=None)

    return run


def transformers_runners(w: Workload, seed: int) -> tuple[dict[str, Callable[[], EngineRun]], dict]:
    """name -> runner for transformers' engines on the workload, and what each was given (its KV
    cache bytes from its shapes where they are fixed in advance, versions)."""
    require_torch()
    import torch
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "eos_token_id not set" per call
    hf = _load(w)
    mc, s = w.model.config, w.sampling
    N, P = w.ids.shape
    pages = math.ceil((int(w.mask.sum(axis=1).max()) + s.max_new_tokens) / PAGE_SIZE)
    blocks = s.slots * pages + N  # every slot's sequence, and a partial prompt page per prompt
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4  # float32 keys and values
    sized = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=blocks, max_requests_per_batch=s.slots, seed=seed)
    runners = {"transformers_cb": _batch_runner(hf, w, sized),
               "transformers_cb_auto": _batch_runner(hf, w, ContinuousBatchingConfig(seed=seed)),
               "transformers_generate": _generate_runner(hf, w, seed)}
    info = {
        "transformers_cb": {"num_blocks": blocks, "page_size": PAGE_SIZE, "max_requests_per_batch": s.slots,
                            "kv_cache_bytes": blocks * PAGE_SIZE * per_token},
        "transformers_cb_auto": {"sizing": "transformers' own, from free memory", "kv_cache_bytes": None},
        "transformers_generate": {"kv_cache_bytes": w.rows * (P + s.max_new_tokens) * per_token},
        "attn_implementation": hf.config._attn_implementation, "torch_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    return runners, info
