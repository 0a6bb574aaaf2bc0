"""Benchmarks behind `grpo-jax bench`: grpo_jax against transformers on the same weights, in one run.

Each benchmark builds a random model with transformers (the reference needs torch: install the
`test` extra), saves it, loads it with `from_pretrained`, runs the same workload through both, and
returns one JSON-serialisable dict with tokens/s of each and their ratio. Timings are medians of
repeated runs after a warm-up (compilation is reported separately, never mixed in).
"""

from __future__ import annotations

import dataclasses
import platform
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import grpo_jax
from grpo_jax.config import SamplingConfig

PRESETS = {
    "tiny": dict(model_type="qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096),
    "small": dict(model_type="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151_936,
                       tie_word_embeddings=True),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128_256,
                        tie_word_embeddings=True, max_position_embeddings=131_072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                        rope_theta=500_000.0),
}


def _require_torch():
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise SystemExit("the benchmarks compare against transformers' PyTorch models: "
                         "pip install 'grpo-jax[test]' (torch==2.13.0)") from e


def build_pair(preset: str, dtype: str):
    """(transformers model on its device, grpo_jax model, torch device, load seconds) on the same weights."""
    _require_torch()
    import jax.numpy as jnp
    import torch
    import transformers

    from grpo_jax.models import from_pretrained

    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = dict(PRESETS[preset])
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
    import transformers
    from flax import nnx

    from grpo_jax.models import Transformer, config_from_hf

    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = dict(PRESETS[preset])
    config = config_from_hf(transformers.AutoConfig.for_model(spec.pop("model_type"), **spec).to_dict())
    return Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))


def median_time(fn: Callable[[], object], iters: int, warmup: int = 1) -> tuple[float, float]:
    """(seconds of the first call, median seconds of `iters` later calls)."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


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
    """Generated tokens/s of `grpo_jax.rollout.sampling.generate` vs transformers' `generate` (sampling, no
    early stop) on prompts x group_size rows, and prefill time for G=group_size vs G=1.

    `reference=False` measures grpo_jax alone (compile time and tokens/s, random weights, no torch):
    for shapes where building and running the transformers model would dominate the run.
    """
    import jax
    import numpy as np

    from grpo_jax.rollout.sampling import generate

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

    cfg = SamplingConfig(group_size=group_size, max_new_tokens=new_tokens, temperature=1.0,
                         prompt_buckets=(prompt_len,))
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
        one = SamplingConfig(group_size=g, max_new_tokens=1, temperature=1.0, prompt_buckets=(prompt_len,))
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


def forward(*, preset: str = "tiny", batch: int = 8, seq: int = 128, dtype: str = "float32", iters: int = 5) -> dict:
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


def peak_matmul_flops(dtype: str = "float32", n: int = 2048, iters: int = 5) -> float:
    """FLOP/s of a jitted n x n x n matmul on the default device (median of `iters`): the in-run
    peak that MFU is measured against."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.dtype(dtype))
    matmul = jax.jit(lambda x, y: x @ y)
    _, seconds = median_time(lambda: matmul(a, b).block_until_ready(), iters, warmup=2)
    return 2.0 * n**3 / seconds


def grpo_step(config_path: str, *, overrides: Sequence[str] = (), steps: int = 5, warmup: int = 2) -> dict:
    """Whole GRPO steps of a run config through the trainer itself (`grpo_jax.trainer.loop.Trainer`,
    the code `grpo-jax train` runs): `warmup` steps, then `steps` timed ones, in a temporary run
    directory, without warm start, evaluation between steps or checkpoints between steps. Returns
    medians of the trainer's own per-step timings (sample, rewards, reference, update, step), model
    FLOPs per step (grpo_jax.tools.flops), the in-run matmul peak and MFU."""
    import jax

    from grpo_jax.config import ConfigError, load_config
    from grpo_jax.tools.flops import step_flops
    from grpo_jax.trainer.loop import Trainer

    if steps < 1 or warmup < 0:
        raise ConfigError(f"bench grpo-step needs --steps >= 1 and --warmup >= 0, got {steps} and {warmup}")
    config = load_config(config_path, [*overrides, f"train.steps={warmup + steps}", "train.progress=false",
                                       "train.samples_every=0", "sft.steps=0", "eval.every=0",
                                       "checkpoint.every=0"])
    seen: list[dict] = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir, hooks=[lambda step, m: seen.append(m)], log=lambda line: None)
        t0 = time.perf_counter()
        trainer.run()
        run_s = time.perf_counter() - t0
    timed = seen[warmup:]

    def median(key: str) -> float:
        return statistics.median(m[key] for m in timed)

    s, d = config.sampling, config.data
    prompt_len = int(median("perf/prompt_len"))  # the bucket the steps padded to
    model_cfg = trainer.prepared.model_config
    flops = step_flops(model_cfg, prompts=d.prompts_per_step, group_size=s.group_size, prompt_len=prompt_len,
                       completion_len=s.max_new_tokens, decode_steps=int(median("completion/len_max")) - 1,
                       reference=config.grpo.beta > 0, num_iterations=config.grpo.num_iterations,
                       shared_prompt=config.train.shared_prompt)
    # Dynamic sampling samples a round per median "dynamic/rounds".
    flops = dataclasses.replace(flops, sample=flops.sample * median("dynamic/rounds"))
    dtype = config.model.dtype
    # The step runs on every device of the mesh: the peak is one device's matmul rate times their number.
    peak = peak_matmul_flops(dtype) * len(trainer.mesh.devices.flat)
    step_s, train_s = median("perf/step_s"), median("perf/train_s")
    stats = jax.devices()[0].memory_stats() or {}

    def nbytes(tree) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(tree)))

    memory = {  # what the run holds between steps, by part (the device's peak is backend-dependent)
        "trainable_params_bytes": nbytes(trainer.state.params), "optimizer_state_bytes": nbytes(trainer.state.opt_state),
        "frozen_params_bytes": nbytes(trainer.par.frozen), "reference_params_bytes": nbytes(trainer.ref_params),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    return {
        "system": "grpo_jax", "version": grpo_jax.__version__, "config": str(config_path), "overrides": list(overrides),
        "steps_timed": len(timed), "warmup_steps": warmup, "run_s": round(run_s, 2),
        "step_s_median": step_s, "sample_s_median": median("perf/sample_s"),
        "reward_s_median": median("perf/reward_s"), "ref_s_median": median("perf/ref_s"), "train_s_median": train_s,
        "tokens_per_s": median("perf/sample_tokens") / step_s,
        "flops_per_step": flops.total, "flops": dataclasses.asdict(flops),
        "peak_matmul_flops_per_s": peak, "peak_matmul_dtype": dtype,
        "mfu": flops.total / step_s / peak, "train_mfu": flops.update / train_s / peak,
        "peak_memory_bytes": stats.get("peak_bytes_in_use"), "memory": memory,
        "lora": dataclasses.asdict(config.lora),
        "workload": {"prompts_per_step": d.prompts_per_step, "group_size": s.group_size, "prompt_len": prompt_len,
                     "completion_len": s.max_new_tokens, "vocab_size": model_cfg.vocab_size,
                     "hidden_size": model_cfg.hidden_size, "num_layers": model_cfg.num_layers,
                     "micro_batch_rows": d.prompts_per_step * s.group_size // config.train.micro_batches,
                     "scan_layers": config.model.scan_layers},
        "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
    }


SCALING_AXES = {  # sweep name -> (config key, default values)
    "group_size": ("sampling.group_size", (2, 4, 8, 16, 32)),
    "completion_len": ("sampling.max_new_tokens", (64, 128, 256, 512)),
    "prompts_per_step": ("data.prompts_per_step", (2, 4, 8, 16)),
}
# The per-point figures kept from each grpo_step result.
_POINT_FIELDS = ("step_s_median", "sample_s_median", "reward_s_median", "ref_s_median", "train_s_median",
                 "tokens_per_s", "flops_per_step", "mfu", "train_mfu", "peak_memory_bytes")


def scaling_micro_batches(rows: int, group_size: int, micro_batch_rows: int) -> int:
    """Micro-batches for `rows` completions: as close to `micro_batch_rows` rows each as whole
    groups allow (a micro-batch holds at least one group)."""
    per = max(group_size, micro_batch_rows - micro_batch_rows % group_size)
    mb = max(1, rows // per)
    while rows % mb or (rows // mb) % group_size:
        mb -= 1
    return mb


def scaling(config_path: str, *, overrides: Sequence[str] = (), sweeps: dict[str, Sequence[int]] | None = None,
            steps: int = 2, warmup: int = 1, log: Callable[[str], None] = print) -> dict:
    """Step time against the work: `grpo_step` of the config with one of group size, completion
    length or prompts per step changed at a time (`sweeps`: axis -> values, default SCALING_AXES).

    Every point keeps the config's micro-batch size in rows (rounded to whole groups), so that the
    curves show how cost grows with the work, not a change of micro-batching. With `min_new_tokens`
    equal to `max_new_tokens` in the config, completions stay fixed-length along the length sweep.
    """
    from grpo_jax.config import ConfigError, load_config

    base = load_config(config_path, overrides)
    sweeps = {k: tuple(v) for k, v in (sweeps or {k: v for k, (_, v) in SCALING_AXES.items()}).items()}
    unknown = sorted(set(sweeps) - set(SCALING_AXES))
    if unknown:
        raise ConfigError(f"bench scaling: unknown sweep {unknown}; choose from {sorted(SCALING_AXES)}")
    if any(not values or any(int(v) < 1 for v in values) for values in sweeps.values()):
        raise ConfigError(f"bench scaling: every sweep needs values >= 1, got {sweeps}")
    rows0 = base.data.prompts_per_step * base.sampling.group_size
    micro_rows = rows0 // base.train.micro_batches
    fixed_len = base.sampling.min_new_tokens == base.sampling.max_new_tokens
    points = []
    for axis, values in sweeps.items():
        for value in values:
            work = {"group_size": base.sampling.group_size, "completion_len": base.sampling.max_new_tokens,
                    "prompts_per_step": base.data.prompts_per_step, axis: int(value)}
            rows = work["prompts_per_step"] * work["group_size"]
            mb = scaling_micro_batches(rows, work["group_size"], micro_rows)
            sets = [f"sampling.group_size={work['group_size']}", f"sampling.max_new_tokens={work['completion_len']}",
                    f"data.prompts_per_step={work['prompts_per_step']}", f"train.micro_batches={mb}"]
            if fixed_len:
                sets.append(f"sampling.min_new_tokens={work['completion_len']}")
            t = time.perf_counter()
            result = grpo_step(config_path, overrides=[*overrides, *sets], steps=steps, warmup=warmup)
            point = {"axis": axis, "value": int(value), **work, "micro_batches": mb,
                     **{k: result[k] for k in _POINT_FIELDS}}
            points.append(point)
            log(f"scaling {axis}={value}: step {point['step_s_median']:.2f} s (sample {point['sample_s_median']:.2f}, "
                f"reference {point['ref_s_median']:.2f}, update {point['train_s_median']:.2f}), "
                f"{time.perf_counter() - t:.0f} s with compilation")
    return {"benchmark": "scaling", "version": grpo_jax.__version__, "config": str(config_path),
            "overrides": list(overrides), "steps_timed": steps, "warmup_steps": warmup,
            "base": {"group_size": base.sampling.group_size, "completion_len": base.sampling.max_new_tokens,
                     "prompts_per_step": base.data.prompts_per_step, "micro_batch_rows": micro_rows},
            "points": points, "device": result["device"], "backend": result["backend"]}


def plot_scaling(result: dict, path: str) -> None:
    """One panel per swept axis: the step's parts stacked against the swept value (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_swept = list(dict.fromkeys(p["axis"] for p in result["points"]))
    fig, panels = plt.subplots(1, len(axes_swept), figsize=(5 * len(axes_swept), 4), squeeze=False)
    parts = (("sample_s_median", "sampling"), ("ref_s_median", "reference log-probs"), ("train_s_median", "update"))
    for ax, axis in zip(panels[0], axes_swept):
        pts = sorted((p for p in result["points"] if p["axis"] == axis), key=lambda p: p["value"])
        x = [p["value"] for p in pts]
        bottom = [0.0] * len(pts)
        for key, label in parts:
            y = [p[key] for p in pts]
            ax.fill_between(x, bottom, [b + v for b, v in zip(bottom, y)], alpha=0.5, label=label, step=None)
            bottom = [b + v for b, v in zip(bottom, y)]
        ax.plot(x, [p["step_s_median"] for p in pts], "k.-", label="whole step")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel(axis.replace("_", " "))
        ax.set_ylabel("seconds per step (median)")
        ax.grid(alpha=0.3)
        base = result["base"]
        ax.set_title(", ".join(f"{k.replace('_', ' ')} {v}" for k, v in base.items() if k != axis
                               and k != "micro_batch_rows"), fontsize=9)
    panels[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"grpo_jax GRPO step vs work ({result['device']}, {result['config']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
