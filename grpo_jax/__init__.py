"""grpo_jax: JAX/TPU-native GRPO for reinforcement learning of language models from verifiable rewards."""

__version__ = "0.1.0"
