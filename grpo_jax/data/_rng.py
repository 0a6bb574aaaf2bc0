"""A random stream that is the same on every Python and NumPy version.

Datasets and sampler orders are promises ("seed 3 gives these rows", "a resumed run reads the
same prompts"), so they must not depend on library internals that may change. Python
guarantees only that `random.Random(int).random()` keeps its sequence across versions
(`randrange`, `shuffle` and NumPy's `Generator` methods make no such promise), so every draw
here is built from `random()` alone.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import MutableSequence, Sequence
from typing import TypeVar

T = TypeVar("T")


def derive_seed(*key: int | str) -> int:
    """A 64-bit seed from a tuple of ints/strings (e.g. (seed, epoch) or (seed, "train"))."""
    digest = hashlib.sha256(repr(tuple(key)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class StableRandom:
    """Integers, choices and shuffles derived only from `random.Random.random()`."""

    def __init__(self, *key: int | str):
        self._random = random.Random(derive_seed(*key))

    def randint(self, low: int, high: int) -> int:
        """Uniform integer in [low, high] (inclusive)."""
        span = high - low + 1
        if span <= 0 or span >= 2**52:  # floats carry 53 bits; past that the draw has gaps
            raise ValueError(f"randint range [{low}, {high}] is empty or too wide")
        return low + min(int(self._random.random() * span), span - 1)

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.randint(0, len(seq) - 1)]

    def shuffle(self, seq: MutableSequence) -> None:
        """Fisher-Yates in place."""
        for i in range(len(seq) - 1, 0, -1):
            j = self.randint(0, i)
            seq[i], seq[j] = seq[j], seq[i]

    def sample(self, seq: Sequence[T], k: int) -> list[T]:
        """k distinct elements of seq, in random order."""
        pool = list(seq)
        for i in range(k):
            j = self.randint(i, len(pool) - 1)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]
