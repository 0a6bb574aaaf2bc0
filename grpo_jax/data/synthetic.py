"""Shared machinery of the seeded synthetic TFDS builders (arithmetic, countdown, word_problems).

A synthetic dataset is a pure function of its config: the same config gives the same rows on
any machine, so a run's data is fully described by the config it logs. The config's
parameters are also written into the prepared dataset's metadata, and `load_source` refuses
to read a directory whose rows were generated from different parameters.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import tensorflow_datasets as tfds

from grpo_jax.data._rng import StableRandom

# Draws allowed per requested row before concluding that the config's question space is too
# small to hold num_train + num_test distinct problems.
_ATTEMPTS_PER_ROW = 50


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
    """Size and seed shared by all synthetic datasets (subclasses add the task's knobs)."""

    num_train: int = 1000
    num_test: int = 100
    seed: int = 0

    def __post_init__(self):
        self.require([(self.num_train >= 1 and self.num_test >= 1, "num_train and num_test must be >= 1")])

    def require(self, checks) -> None:
        """Refuse the config at the first of `checks` ((holds, what must hold) pairs) that fails: a
        ValueError naming the config, the rule and every parameter as given."""
        for ok, rule in checks:
            if not ok:
                raise ValueError(f"config {self.name!r}: {rule} ({self.params()})")

    def params(self) -> dict[str, Any]:
        """The generation parameters (everything but TFDS's own config fields), JSON-normalised."""
        base = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in base}
        return json.loads(json.dumps(values))  # tuples -> lists, as they come back from metadata.json

    def with_overrides(self, **overrides: Any) -> SyntheticConfig:
        """A copy with some parameters replaced, named after the base config and a hash of all
        parameters, so that different parameters never share a prepared-data directory."""
        unknown = sorted(set(overrides) - set(self.params()))
        if unknown:
            raise TypeError(
                f"unknown parameter(s) {unknown} for {type(self).__name__}; "
                f"valid: {sorted(self.params())}"
            )
        if not overrides:
            return self
        fields = {
            k: tuple(v) if isinstance(v, list) else v for k, v in {**self.params(), **overrides}.items()
        }
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
        return dataclasses.replace(
            self, name=f"{self.name}_{digest}", **fields
        )


class SyntheticBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base builder: subclasses define the features and how to draw one problem.

    Builders are not registered in TFDS's global registry (names like `arithmetic` could clash
    with future TFDS datasets); read prepared data with `load_source` or
    `tfds.builder_from_directory`.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    DESCRIPTION = ""

    @abc.abstractmethod
    def _features(self) -> dict[str, tfds.features.FeatureConnector]:
        """Features other than `id`."""

    @abc.abstractmethod
    def _draw(self, rng: StableRandom) -> tuple[Hashable, dict[str, Any]]:
        """One random problem: (key identifying the problem, row without `id`). Two rows with
        the same key are the same problem, whatever their wording."""

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.DESCRIPTION,
            features=tfds.features.FeaturesDict({**self._features(), "id": tfds.features.Text()}),
            metadata=tfds.core.MetadataDict(self.builder_config.params()),
            # Rows keep their generation order; samplers shuffle at read time.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        config = self.builder_config
        rows = draw_disjoint(
            lambda rng: self._draw(rng),
            counts={"test": config.num_test, "train": config.num_train},
            rng=StableRandom(self.name, config.seed),
            what=f"{self.name} config {config.name!r} ({config.params()})",
        )
        return {split: self._generate_examples(split, split_rows) for split, split_rows in rows.items()}

    def _generate_examples(self, split: str, rows: list[dict[str, Any]]) -> Iterator[tuple[int, dict]]:
        for i, row in enumerate(rows):
            yield i, {**row, "id": f"{split}-{i}"}


def draw_disjoint(
    draw: Callable[[StableRandom], tuple[Hashable, dict[str, Any]]],
    *,
    counts: dict[str, int],
    rng: StableRandom,
    what: str,
) -> dict[str, list[dict[str, Any]]]:
    """Rows for each split, all problems distinct, so splits never share a problem.

    Splits are filled in the order of `counts`; with test first, changing num_train leaves the
    test set unchanged, so evaluations stay comparable.
    """
    total = sum(counts.values())
    seen: set[Hashable] = set()
    ordered: list[dict[str, Any]] = []
    attempts = 0
    while len(ordered) < total:
        attempts += 1
        if attempts > _ATTEMPTS_PER_ROW * total + 1000:
            raise ValueError(
                f"{what}: found only {len(ordered)} distinct problems in {attempts - 1} draws but "
                f"{total} were requested (num_train + num_test); lower them or widen the config "
                "(more digits, ops or numbers)"
            )
        key, row = draw(rng)
        if key not in seen:
            seen.add(key)
            ordered.append(row)
    out, start = {}, 0
    for split, count in counts.items():
        out[split] = ordered[start:start + count]
        start += count
    return out
