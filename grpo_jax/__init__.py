"""grpo_jax: JAX/TPU-native GRPO for reinforcement learning of language models from verifiable rewards.

The main API, importable from here:

- `from_pretrained(path, dtype=..., param_dtype=...)`, `save_pretrained(model, path)`: Hugging Face
  checkpoints to and from our Flax NNX decoder (grpo_jax.models);
- `generate(model, prompts, config, rng) -> Rollout` with `SamplingConfig` (grpo_jax.engine.sampling);
- `group_advantages(rewards, group_size, *, scale, estimator, ddof=0)` (grpo_jax.learner.grpo);
- `RunConfig`, `load_config(path, overrides)` (grpo_jax.config) and `train(config, run_dir) ->
  RunResult` (grpo_jax.trainer.loop, grpo_jax.trainer.run_state);
- `mesh_device_grid(mesh_config, devices)`: the host-aware device order of a run's mesh
  (grpo_jax.runtime.sharding).

Names are loaded on first use, so `import grpo_jax.config` (a leaf) does not import JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "from_pretrained": "grpo_jax.models",
    "save_pretrained": "grpo_jax.models",
    "generate": "grpo_jax.engine.sampling",
    "SamplingConfig": "grpo_jax.config",
    "group_advantages": "grpo_jax.learner.grpo",
    "gae": "grpo_jax.learner.ppo",
    "policy_loss": "grpo_jax.learner.grpo",
    "get_reward_fn": "grpo_jax.rewards",
    "RunConfig": "grpo_jax.config",
    "load_config": "grpo_jax.config",
    "train": "grpo_jax.trainer.loop",
    "RunResult": "grpo_jax.trainer.run_state",
    "mesh_device_grid": "grpo_jax.runtime.sharding",
    "Environment": "grpo_jax.env",
    "EnvStep": "grpo_jax.env",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'grpo_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
