"""Environments for multi-turn episodes: the protocol (`Environment`, `EnvStep`, pinned in
DESIGN.md), the built-in environments (`calculator`, `python`, `countdown`), the tool-call formats
they read (`tool_calls`) and the registry that builds one by name (`registry`). How an episode runs
over the engine's slots, and how its messages become tokens, is grpo_jax.episodes."""

from grpo_jax.env.protocol import Environment, EnvStep, check_messages

__all__ = ["Environment", "EnvStep", "check_messages"]
