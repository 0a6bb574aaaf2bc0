"""Benchmarks' tooling: benchmarks (`bench`), FLOP counts and the smoke check. The product's commands
(train-rm, check) live with the trainer (grpo_jax.trainer). The top floor but the CLI: nothing below
imports it."""
