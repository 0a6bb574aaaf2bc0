"""Multi-turn episodes: the environment protocol (`Environment`, `EnvStep`), the built-in
environments and how an environment's messages become tokens of the trajectory."""

from grpo_jax.env.protocol import Environment, EnvStep, check_messages

__all__ = ["Environment", "EnvStep", "check_messages"]
