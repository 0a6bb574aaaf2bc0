"""The names of a run's programs that `grpo-jax bench memory` compiles, shared by the command
(grpo_jax.tools.bench.memory, JAX-free until it measures) and the abstract run that lowers them
(grpo_jax.tools.bench.abstract_run)."""

PROGRAMS = ("sampler", "eval_sampler", "reference", "teacher", "train_step")
"""The programs a run can have, in the order they are compiled (`programs=` names some of them)."""
NOT_ASKED = "not asked (--programs)"
"""Why a program the run has was not compiled: `--programs` did not name it."""
