"""The benchmarks behind `grpo-jax bench`, one JSON-serialisable dict each:

- `sampler`, `forward` (parity.py): grpo_jax against transformers on the same weights;
- `grpo_step` (step.py): whole GRPO steps of a run config through the trainer, with MFU;
- `scaling` (scaling.py): `grpo_step` against group size, completion length and prompts per step;
- `engine` (engine.py): the static and paged rollout engines at one KV-cache budget (the paged one
  with a reservation per slot, `continuous`, and over a page pool), and
  transformers' continuous batching on the same weights;
- `memory` (memory.py): a run config's programs compiled on abstract shapes, their memory per
  device against a chip's HBM.

Their keyword defaults are the CLI's defaults. JAX, torch and transformers are imported when a
benchmark runs, so the CLI reads this package without them.
"""

from grpo_jax.tools.bench.engine import PEERS, engine, plot_engine
from grpo_jax.tools.bench.memory import CHIPS, memory
from grpo_jax.tools.bench.parity import PRESETS, forward, require_torch, sampler
from grpo_jax.tools.bench.scaling import SCALING_AXES, plot_scaling, scaling, scaling_micro_batches
from grpo_jax.tools.bench.step import grpo_step

# The benchmarks' command-line options: a benchmark takes those of its function's keyword parameters
# named here (with the function's defaults; a config benchmark also takes --config and --set), with
# their help, and one of CHOICES where the values are few.
OPTIONS = {"preset": "model shape", "dtype": "compute and parameter dtype", "iters": "timed repetitions",
           "prompts": "distinct prompts", "group_size": "samples per prompt", "prompt_len": "prompt tokens",
           "new_tokens": "generated tokens per row", "batch": "rows", "seq": "tokens per row",
           "steps": "timed steps", "warmup": "untimed steps before them",
           "devices": "host devices to compile for, one per chip", "chip": "the chip whose HBM the programs must fit",
           "peer": "also time another system's engines on the same weights and prompts",
           "paged_slots": "the paged engine's decode slots (0: 3 x sampling.slots) over the per-slot reservations' bytes"}
CHOICES = {"preset": list(PRESETS), "dtype": ["float32", "bfloat16"], "chip": list(CHIPS), "peer": list(PEERS)}

__all__ = ["CHIPS", "CHOICES", "OPTIONS", "PEERS", "PRESETS", "SCALING_AXES", "engine", "forward", "grpo_step", "memory",
           "plot_engine", "plot_scaling", "require_torch", "sampler", "scaling", "scaling_micro_batches"]
