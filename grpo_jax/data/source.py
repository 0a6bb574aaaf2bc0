"""`load_source`: a prepared TFDS dataset split as a random-access sequence of plain dicts."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from grpo_jax.config import did_you_mean
from grpo_jax.data import gsm8k
from grpo_jax.data.arithmetic import Arithmetic
from grpo_jax.data.chains import ArithmeticChain
from grpo_jax.data.countdown import Countdown
from grpo_jax.data.preferences import ArithmeticPreferences
from grpo_jax.data.synthetic import SyntheticBuilder, SyntheticConfig
from grpo_jax.data.word_problems import WordProblems

SYNTHETIC: dict[str, type[SyntheticBuilder]] = {"arithmetic": Arithmetic, "countdown": Countdown,
                                                "word_problems": WordProblems,
                                                "arithmetic_preferences": ArithmeticPreferences,
                                                "arithmetic_chain": ArithmeticChain}
DATASETS: tuple[str, ...] = (*SYNTHETIC, "gsm8k")
SPLITS: dict[str, tuple[str, ...]] = {
    **{name: ("test", "train") for name in SYNTHETIC},
    "gsm8k": tuple(sorted(gsm8k.FILES)),
}


def to_python(value: Any) -> Any:
    """bytes -> str, NumPy arrays -> lists, NumPy scalars -> Python scalars, recursively."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [to_python(v) for v in value.tolist()] if value.ndim else to_python(value.item())
    if isinstance(value, np.generic):
        return to_python(value.item())
    if isinstance(value, Mapping):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    return value


class DataSource(Sequence):
    """`len(source)` rows; `source[i]` is a dict of Python values (str, int, float, lists)."""

    def __init__(self, records: Sequence, *, name: str, split: str, builder: tfds.core.DatasetBuilder):
        self._records = records
        self.name = name
        self.split = split
        self.builder = builder

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"{self!r}: index must be an int, got {type(index).__name__}")
        n = len(self._records)
        if not -n <= index < n:
            raise IndexError(f"{self!r}: index {index} out of range for {n} rows")
        return to_python(self._records[int(index) % n])

    def __repr__(self) -> str:
        return f"DataSource({self.name!r}, split={self.split!r}, rows={len(self._records)})"


def _synthetic_builder(
    name: str, data_dir: Path, builder_config: str | SyntheticConfig | None, overrides: dict[str, Any]
) -> SyntheticBuilder:
    cls = SYNTHETIC[name]
    if builder_config is None or isinstance(builder_config, str):
        key = builder_config or cls.DEFAULT_BUILDER_CONFIG_NAME
        if key not in cls.builder_configs:
            raise ValueError(
                f"{name} has no builder config {key!r}; valid: {sorted(cls.builder_configs)}"
                + did_you_mean(key, cls.builder_configs)
            )
        config = cls.builder_configs[key]
    else:
        config_cls = type(cls.builder_configs[cls.DEFAULT_BUILDER_CONFIG_NAME])
        if not isinstance(builder_config, config_cls):
            raise TypeError(f"{name} needs a {config_cls.__name__}, got a {type(builder_config).__name__}")
        config = builder_config
    config = config.with_overrides(**overrides)
    return cls(data_dir=data_dir, config=config, file_format="array_record")


def _gsm8k_builder(data_dir: Path, manual_dir: str | Path | None, builder_config, overrides) -> Any:
    if builder_config is not None or overrides:
        raise TypeError(f"gsm8k has no builder configs or parameters; got {builder_config=} {overrides=}")
    cls = gsm8k.Gsm8kLocal if manual_dir is not None else gsm8k.Gsm8k
    builder = cls(data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        if manual_dir is None:
            gsm8k.check_download_reachable()
        elif message := gsm8k.missing_files_message(manual_dir):
            raise FileNotFoundError(message)
    return builder


def load_source(
    name: str,
    split: str,
    *,
    data_dir: str | Path,
    manual_dir: str | Path | None = None,
    builder_config: str | SyntheticConfig | None = None,
    **config_overrides: Any,
) -> DataSource:
    """One split of a dataset, prepared under `data_dir` on first use (array_record format).

    name: "arithmetic", "countdown", "word_problems", "arithmetic_preferences" (preference pairs for
        `grpo-jax train-rm`), "arithmetic_chain" (answered by a derivation) or "gsm8k".
    split: "train", "test" (gsm8k also "train_socratic", "test_socratic"); TFDS slices such as
        "train[:100]" work.
    builder_config: a config name ("small", ...) or a config object, for the synthetic sets.
    config_overrides: parameters replacing the config's (num_train=, num_test=, seed=, digits=,
        ...); the result gets its own directory, named after a hash of the parameters.
    manual_dir: gsm8k only: a directory holding train.jsonl, test.jsonl, train_socratic.jsonl and
        test_socratic.jsonl, to build without network. Without it the stock TFDS builder
        downloads them from GitHub.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {list(DATASETS)}" + did_you_mean(name, DATASETS))
    splits = SPLITS[name]
    # Checked before preparing, which may download.
    if split.split("[", 1)[0] not in splits:
        raise ValueError(f"{name} has no split {split!r}; valid: {list(splits)}" + did_you_mean(split, splits))
    if manual_dir is not None and name != "gsm8k":
        raise TypeError(f"manual_dir is only used by gsm8k, not {name!r}")
    data_dir = Path(data_dir)
    with _quiet():
        if name == "gsm8k":
            builder = _gsm8k_builder(data_dir, manual_dir, builder_config, config_overrides)
        else:
            builder = _synthetic_builder(name, data_dir, builder_config, config_overrides)
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(
                manual_dir=None if manual_dir is None else str(manual_dir),
                # The GCS lookup would be a network call, and GCS holds only TFRecord copies anyway.
                try_download_gcs=False,
            ),
        )
    if isinstance(builder, SyntheticBuilder):
        _check_params(builder)
    return DataSource(builder.as_data_source(split), name=name, split=split, builder=builder)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """TFDS's preparation banners and progress bars, and absl's "custom data configuration"
    warnings, are library noise in a training run's output: a user sees our lines only. Errors
    still propagate as exceptions."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        absl.setLevel(level)


def _check_params(builder: SyntheticBuilder) -> None:
    """Refuse prepared data generated from other parameters than the requested config's."""
    stored = dict(builder.info.metadata or {})
    wanted = builder.builder_config.params()
    if stored != wanted:
        raise ValueError(
            f"{builder.data_dir} was prepared with parameters {stored}, but config "
            f"{builder.builder_config.name!r} asks for {wanted}; give the config another name, "
            "or delete that directory to rebuild it"
        )
