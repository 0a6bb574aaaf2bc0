"""`grpo-jax bench grpo-step`: whole GRPO steps of a run config through the trainer itself, with
the trainer's own per-step timings, model FLOPs (grpo_jax.tools.flops), the in-run matmul peak and
MFU."""

from __future__ import annotations

import dataclasses
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpo_jax
from grpo_jax.tools.bench.timing import peak_matmul_flops

if TYPE_CHECKING:  # the trainer starts JAX; the CLI's parser imports this module
    from grpo_jax.trainer.run_state import RunResult

# What the benchmark turns off: warm start, evaluation, samples, checkpoints and the progress bar.
_QUIET = ("train.progress=false", "train.samples_every=0", "sft.steps=0", "eval.every=0", "checkpoint.every=0")


@dataclasses.dataclass(frozen=True)
class _Run:
    """The trainer's metrics of the timed steps, its summary, and what the step ran on."""

    timed: list[dict]
    summary: RunResult
    model_config: object
    num_devices: int
    run_s: float

    def median(self, key: str) -> float:
        return statistics.median(m[key] for m in self.timed)


def _run_trainer(config, warmup: int) -> _Run:
    from grpo_jax.trainer.loop import Trainer

    seen: list[dict] = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir, hooks=[lambda step, m: seen.append(m)], log=lambda line: None)
        t0 = time.perf_counter()
        summary = trainer.run()
        run_s = time.perf_counter() - t0
    prepared = trainer.prepared
    return _Run(seen[warmup:], summary, prepared.model.config, len(prepared.mesh.devices.flat), run_s)


def _step_flops(config, run: _Run, prompt_len: int):
    from grpo_jax.tools.flops import step_flops

    s, d = config.sampling, config.data
    flops = step_flops(run.model_config, prompts=d.prompts_per_step, group_size=s.group_size, prompt_len=prompt_len,
                       completion_len=s.max_new_tokens, decode_steps=int(run.median("completion/len_max")) - 1,
                       reference=config.grpo.beta > 0, num_iterations=config.grpo.num_iterations,
                       shared_prompt=config.train.shared_prompt)
    # Dynamic sampling samples a round per median "dynamic/rounds".
    return dataclasses.replace(flops, sample=flops.sample * run.median("dynamic/rounds"))


def _workload(config, model_cfg, prompt_len: int) -> dict:
    s, d = config.sampling, config.data
    return {"prompts_per_step": d.prompts_per_step, "group_size": s.group_size, "prompt_len": prompt_len,
            "completion_len": s.max_new_tokens, "vocab_size": model_cfg.vocab_size,
            "hidden_size": model_cfg.hidden_size, "num_layers": model_cfg.num_layers,
            "micro_batch_rows": d.prompts_per_step * s.group_size // config.train.micro_batches,
            "scan_layers": config.model.scan_layers}


def grpo_step(config_path: str, *, overrides: Sequence[str] = (), steps: int = 5, warmup: int = 2) -> dict:
    """Whole GRPO steps of a run config through the trainer itself (`grpo_jax.trainer.loop.Trainer`,
    the code `grpo-jax train` runs): `warmup` steps, then `steps` timed ones, in a temporary run
    directory, without warm start, evaluation between steps or checkpoints between steps. Returns
    medians of the trainer's own per-step timings (sample, rewards, reference, update, step), model
    FLOPs per step (grpo_jax.tools.flops), the in-run matmul peak and MFU."""
    import jax

    from grpo_jax.config import ConfigError, load_config

    if steps < 1 or warmup < 0:
        raise ConfigError(f"bench grpo-step needs --steps >= 1 and --warmup >= 0, got {steps} and {warmup}")
    config = load_config(config_path, [*overrides, f"train.steps={warmup + steps}", *_QUIET])
    run = _run_trainer(config, warmup)
    median = run.median
    prompt_len = int(median("perf/prompt_len"))  # the bucket the steps padded to
    flops = _step_flops(config, run, prompt_len)
    dtype = config.model.dtype
    # The step runs on every device of the mesh: the peak is one device's matmul rate times their number.
    peak = peak_matmul_flops(dtype) * run.num_devices
    step_s, train_s = median("perf/step_s"), median("perf/train_s")
    stats = jax.devices()[0].memory_stats() or {}
    memory = {  # what the run holds between steps, by part (the device's peak is backend-dependent)
        **run.summary.learner_bytes, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    return {
        "system": "grpo_jax", "version": grpo_jax.__version__, "config": str(config_path), "overrides": list(overrides),
        "steps_timed": len(run.timed), "warmup_steps": warmup, "run_s": round(run.run_s, 2),
        "step_s_median": step_s, "sample_s_median": median("perf/sample_s"),
        "reward_s_median": median("perf/reward_s"), "ref_s_median": median("perf/ref_s"), "train_s_median": train_s,
        "tokens_per_s": median("perf/sample_tokens") / step_s,
        "train_tokens_per_s_median": median("perf/train_tokens_per_s"),
        "completion_len_mean": median("completion/len_mean"),
        # train.packing: the share of the bins' tokens that are real (learner.packing)
        "pack_fill_median": median("perf/pack_fill") if config.train.packing else None,
        "flops_per_step": flops.total, "flops": dataclasses.asdict(flops),
        "peak_matmul_flops_per_s": peak, "peak_matmul_dtype": dtype,
        "mfu": flops.total / step_s / peak, "train_mfu": flops.update / train_s / peak,
        "peak_memory_bytes": stats.get("peak_bytes_in_use"), "memory": memory,
        "lora": dataclasses.asdict(config.lora),
        "workload": _workload(config, run.model_config, prompt_len),
        "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
    }
