"""The benchmarks behind `grpo-jax bench`, one JSON-serialisable dict each:

- `sampler`, `forward` (parity.py): grpo_jax against transformers on the same weights;
- `grpo_step` (step.py): whole GRPO steps of a run config through the trainer, with MFU;
- `scaling` (scaling.py): `grpo_step` against group size, completion length and prompts per step.

Their keyword defaults are the CLI's defaults. JAX, torch and transformers are imported when a
benchmark runs, so the CLI reads this package without them.
"""

from grpo_jax.tools.bench.parity import PRESETS, forward, require_torch, sampler
from grpo_jax.tools.bench.scaling import SCALING_AXES, plot_scaling, scaling, scaling_micro_batches
from grpo_jax.tools.bench.step import grpo_step

__all__ = ["PRESETS", "SCALING_AXES", "forward", "grpo_step", "plot_scaling", "require_torch", "sampler", "scaling",
           "scaling_micro_batches"]
