"""How one program's rows relate to the whole batch's: the only thing a step knows of the
parallelism that runs it. A jitted step on a mesh holds the whole batch (`ONE_PROGRAM`); the pmap
mode's programs each hold a slice (grpo_jax.learner.pmap.Devices gathers and sums over them)."""

from __future__ import annotations

import jax


class Across:
    """How one program's rows relate to the whole batch's: on a mesh (jit) a program holds the
    whole batch, so there is nothing to gather or sum. The pmap mode's `learner.pmap.Devices`
    gathers and sums over its devices; nothing else in the step knows which mode runs it."""

    whole = True  # a program holds the whole batch

    def gather(self, x: jax.Array) -> jax.Array:
        """`x` [rows, ...] of every device, concatenated."""
        return x

    def sum(self, tree):
        return tree

    def max(self, tree):
        return tree

    def count(self) -> int:
        """Programs that together hold the batch."""
        return 1

    def index(self) -> jax.Array | None:
        """This program's place among them (None: the only one)."""
        return None


ONE_PROGRAM = Across()
