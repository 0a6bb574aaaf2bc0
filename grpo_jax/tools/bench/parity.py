"""`grpo-jax bench sampler` and `bench forward`: grpo_jax against transformers on the same weights.

Each benchmark builds a random transformers model of a preset's shape (the reference needs torch:
install the `test` extra), saves it, loads it with `from_pretrained`, runs the same workload
through both, and returns one JSON-serialisable dict with tokens/s of each and their ratio.
Timings are medians of repeated runs after a warm-up (compilation is reported separately, never
mixed in).
"""

from __future__ import annotations

import platform
import tempfile
import time

from grpo_jax.config import SamplingConfig
from grpo_jax.tools.bench.timing import median_time

# The model shapes: name -> (family, overrides of `grpo_jax.models.presets.tiny`, with "rope" as
# RopeConfig keywords for every layer type). Plain data, so the CLI lists the names without JAX.
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny": ("qwen3", dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=4,
                           head_dim=32, vocab_size=4096)),
    "small": ("qwen3", dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4,
                            head_dim=64, vocab_size=8192)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                                 num_kv_heads=8, head_dim=128, vocab_size=151_936, tie_word_embeddings=True,
                                 max_position_embeddings=40_960)),
    # Qwen/Qwen3-1.7B's config.json (as the 0.6B's, wider): `bench memory --preset` sizes the pod config.
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                                 num_kv_heads=8, head_dim=128, vocab_size=151_936, tie_word_embeddings=True,
                                 max_position_embeddings=40_960)),
    # Qwen/Qwen3-30B-A3B's config.json: 128 experts of width 768, 8 per token, every layer sparse.
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                                        num_kv_heads=4, head_dim=128, vocab_size=151_936, tie_word_embeddings=False,
                                        max_position_embeddings=40_960, rms_norm_eps=1e-6, num_experts=128,
                                        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                                        router_aux_loss_coef=0.001, bos_token_id=151_643, eos_token_id=151_645,
                                        rope=dict(theta=1_000_000.0))),
    "llama3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                                  num_kv_heads=8, head_dim=64, vocab_size=128_256, tie_word_embeddings=True,
                                  max_position_embeddings=131_072,
                                  rope=dict(theta=500_000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=8192))),
}


def preset_config(preset: str):
    """The TransformerConfig of a preset: `grpo_jax.models.presets.tiny` of its family, reshaped."""
    from grpo_jax.models import RopeConfig
    from grpo_jax.models.presets import tiny

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    family, overrides = PRESETS[preset]
    overrides = dict(overrides)
    if "rope" in overrides:
        overrides["rope"] = {"full_attention": RopeConfig(**overrides["rope"])}
    return tiny(family, **overrides)


def require_torch() -> None:
    """Raise ImportError, saying what to install, when the PyTorch reference is missing."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ImportError("the benchmarks compare against transformers' PyTorch models: "
                          "pip install 'grpo-jax[test]' (torch==2.13.0)") from e


def build_pair(preset: str, dtype: str):
    """(transformers model on its device, grpo_jax model, torch device, load seconds) on the same weights."""
    require_torch()
    import jax.numpy as jnp
    import torch
    import transformers

    from grpo_jax.models import config_to_hf, from_pretrained

    spec = config_to_hf(preset_config(preset), dtype_name=dtype)
    cfg = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(tdtype).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        t = time.perf_counter()
        ours = from_pretrained(d, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))
        load_s = time.perf_counter() - t
    return hf.to(device), ours, device, load_s


def build_ours(preset: str, dtype: str):
    """A grpo_jax model of a preset's shape with random weights (no transformers model, no torch):
    for figures of our own, such as compile time at a real model's depth."""
    import jax.numpy as jnp
    from flax import nnx

    from grpo_jax.models import Transformer

    return Transformer(preset_config(preset), rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))


def environment(device: str) -> dict:
    import jax
    import torch
    import transformers

    return {
        "jax_backend": jax.default_backend(),
        "jax_device": str(jax.devices()[0].device_kind),
        "torch_device": device if device == "cpu" else torch.cuda.get_device_name(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "host": platform.node(),
    }


def sampler(*, preset: str = "small", prompts: int = 4, group_size: int = 16, prompt_len: int = 32,
            new_tokens: int = 128, dtype: str = "float32", iters: int = 3, reference: bool = True) -> dict:
    """Generated tokens/s of `grpo_jax.engine.sampling.generate` vs transformers' `generate` (sampling, no
    early stop) on prompts x group_size rows, and prefill time for G=group_size vs G=1.

    `reference=False` measures grpo_jax alone (compile time and tokens/s, random weights, no torch):
    for shapes where building and running the transformers model would dominate the run.
    """
    import jax
    import numpy as np

    from grpo_jax.engine.sampling import generate

    if reference:
        hf, ours, device, load_s = build_pair(preset, dtype)
    else:
        t = time.perf_counter()
        ours, device = build_ours(preset, dtype), "cpu"
        load_s = time.perf_counter() - t
    vocab = ours.config.vocab_size
    rng = np.random.default_rng(0)
    prompt_ids = [list(rng.integers(3, vocab, prompt_len)) for _ in range(prompts)]
    rows = prompts * group_size

    def run(config, share=True):
        out = generate(ours, prompt_ids, config, jax.random.key(0), share_prefill=share)
        jax.block_until_ready(out.tokens)
        return out

    # The static engine: its shared and repeated prefills are compared below (`bench engine` compares engines).
    cfg = SamplingConfig(group_size=group_size, max_new_tokens=new_tokens, temperature=1.0,
                         prompt_buckets=(prompt_len,), engine="static")
    compile_s, ours_s = median_time(lambda: run(cfg), iters)
    tokens = rows * new_tokens
    result = {
        "benchmark": "sampler",
        "preset": preset,
        "dtype": dtype,
        "prompts": prompts,
        "group_size": group_size,
        "rows": rows,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "load_s": round(load_s, 2),
        # The first call: compilation plus one run.
        "grpo_jax_compile_s": round(compile_s, 2),
        "grpo_jax_tokens_per_s": round(tokens / ours_s, 1),
    }
    if not reference:
        return {**result, "jax_backend": jax.default_backend(), "jax_version": jax.__version__}
    return {**result, **environment(device), **_sampler_reference(hf, device, prompt_ids, group_size, new_tokens,
                                                                 ours_s, iters, run)}


def _sampler_reference(hf, device, prompt_ids, group_size, new_tokens, ours_s, iters, run) -> dict:
    """transformers' generate on the same prompts, and grpo_jax's prefill time for G = 1 vs G."""
    import numpy as np
    import torch

    rows, prompt_len = len(prompt_ids) * group_size, len(prompt_ids[0])
    ids_t = torch.as_tensor(np.repeat(np.asarray(prompt_ids), group_size, axis=0), dtype=torch.long, device=device)

    def hf_generate():
        with torch.no_grad():
            out = hf.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0, eos_token_id=None)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape == (rows, prompt_len + new_tokens)

    _, hf_s = median_time(hf_generate, iters)

    # Prefill = a one-token generate: what the sampler does before its decode loop (prefill, the
    # first token's logits to every row, the first draw). shared = G samples per prompt from one
    # prefill of the N prompts; repeated = the prompts repeated G times before prefill.
    prefill_s = {}
    for g, share in ((1, True), (group_size, True), (group_size, False)):
        one = SamplingConfig(group_size=g, max_new_tokens=1, temperature=1.0, prompt_buckets=(prompt_len,),
                             engine="static")
        prefill_s[(g, share)] = median_time(lambda: run(one, share), max(iters, 7), warmup=2)[1]

    tokens = rows * new_tokens
    return {
        "transformers_tokens_per_s": round(tokens / hf_s, 1),
        "ratio_vs_transformers": round(hf_s / ours_s, 3),
        "prefill_s_G1": round(prefill_s[(1, True)], 4),
        f"prefill_s_G{group_size}_shared": round(prefill_s[(group_size, True)], 4),
        f"prefill_s_G{group_size}_repeated": round(prefill_s[(group_size, False)], 4),
        "prefill_ratio_shared_vs_G1": round(prefill_s[(group_size, True)] / prefill_s[(1, True)], 3),
    }


def forward(*, preset: str = "tiny", batch: int = 8, seq: int = 128, dtype: str = "float32", iters: int = 3) -> dict:
    """Prefill (plain forward) tokens/s of the NNX decoder vs transformers, and their max logit diff."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    if dtype == "float32":
        # Full fp32 matmuls on both sides (GPUs default to TF32 in XLA), so the diff measures the model.
        jax.config.update("jax_default_matmul_precision", "highest")
        torch.backends.cuda.matmul.allow_tf32 = False
    hf, ours, device, load_s = build_pair(preset, dtype)
    ids = np.random.default_rng(0).integers(3, hf.config.vocab_size, (batch, seq)).astype(np.int32)
    graphdef, state = nnx.split(ours)
    fwd = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    ids_j = jnp.asarray(ids)
    ours_logits = np.asarray(fwd(state, ids_j))
    _, ours_s = median_time(lambda: fwd(state, ids_j).block_until_ready(), iters, warmup=2)
    ids_t = torch.as_tensor(ids, dtype=torch.long, device=device)

    def torch_forward():
        with torch.no_grad():
            out = hf(input_ids=ids_t).logits
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    torch_logits = torch_forward().float().cpu().numpy()
    _, hf_s = median_time(torch_forward, iters, warmup=2)
    return {
        "benchmark": "forward",
        "preset": preset,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        **environment(device),
        "load_s": round(load_s, 2),
        "grpo_jax_tokens_per_s": round(batch * seq / ours_s, 1),
        "transformers_tokens_per_s": round(batch * seq / hf_s, 1),
        "ratio_vs_transformers": round(hf_s / ours_s, 3),
        "max_abs_logit_diff": float(np.abs(ours_logits - torch_logits).max()),
        "logit_scale": float(np.abs(torch_logits).max()),
    }
