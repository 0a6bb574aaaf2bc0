"""`load_path`: your own prompts (`data.path`) as random-access row sources, read by Hugging Face
`datasets`.

What `data.path` may name:
- a file: `.jsonl` / `.json` (a list of objects), `.csv`, `.parquet` (also `.jsonl.gz` and the like);
- a directory written by `datasets`' `save_to_disk` (a `Dataset`, or a `DatasetDict` whose
  `data.train_split` / `data.eval_split` name its splits);
- a TFDS dataset directory (the one holding `dataset_info.json` and `features.json`, prepared in
  the array_record format), split by `data.train_split` / `data.eval_split`.

Files are converted once into `datasets`' Arrow cache (under `data.data_dir`/files) and read
memory-mapped, row by row, so a file larger than memory costs disk, not RAM; the cache is keyed
by the file's contents, so an edited file is read again. A JSON line that does not parse (or is
not an object) does not cost its file: the file is then read line by line, and each bad line
becomes a row the prompt formatter skips and counts, its reason ("line 7: not JSON ...") shown
like any skipped row's.

Held-out prompts come from `data.eval_path` (a second file or directory), or the dataset's own
eval split, or else a fraction of the rows (`data.eval_fraction`, 0.1 when not set) drawn with
`data.split_seed`: the same rows on every host and every resume.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grpo_jax.data.prompts import INVALID
from grpo_jax.data.source import to_python

DEFAULT_EVAL_FRACTION = 0.1
FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}


class FileSource(Sequence):
    """`len(source)` rows of a `datasets.Dataset` (or a TFDS data source); `source[i]` a dict of
    Python values. `columns` are the dataset's column names."""

    def __init__(self, rows: Any, *, name: str, split: str, columns: Sequence[str]):
        self._rows, self.name, self.split = rows, name, split
        self.columns = tuple(c for c in columns if c != INVALID)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"{self!r}: index must be an int, got {type(index).__name__}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"{self!r}: index {index} out of range for {n} rows")
        row = to_python(self._rows[int(index) % n])
        if INVALID in row:
            if row[INVALID] is not None:
                return {INVALID: row[INVALID]}
        # Every row has every column (a line without a field gets None), so a batch's fields line up.
        return {c: row.get(c) for c in self.columns} if self.columns else row

    def __repr__(self) -> str:
        return f"FileSource({self.name!r}, split={self.split!r}, rows={len(self)})"


def _quiet_datasets() -> None:
    """`datasets`' progress bars and info lines are library noise in a run's output."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failed fast path is ours to handle


def data_format(path: Path) -> str | None:
    """`json`, `csv` or `parquet` by the file's suffixes (a compression suffix skipped), or None."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        suffixes.pop()
    return FORMATS.get(suffixes[-1]) if suffixes else None


def _json_lines(path: str, stamp: str) -> Iterator[dict[str, Any]]:
    """Each line (JSONL) or element (a JSON list) of `path` as a row; a bad one as an INVALID row.
    `stamp` (size and mtime) only keys `datasets`' cache."""
    import fsspec

    with fsspec.open(path, "rt", encoding="utf-8", errors="replace", compression="infer") as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        if first == "[":  # a JSON list: it parses or not as a whole
            try:
                items = json.loads(first + f.read())
            except json.JSONDecodeError as e:
                yield {"__row__": None, INVALID: f"{path} is not valid JSON: {e}"}
                return
            lines = ((i + 1, item, None) for i, item in enumerate(items))
            what = "element"
        else:
            f.seek(0)
            lines = (_parse_line(i + 1, line) for i, line in enumerate(f) if line.strip())
            what = "line"
        for number, item, error in lines:
            if error is not None:
                yield {"__row__": None, INVALID: f"{what} {number}: not JSON ({error})"}
            elif not isinstance(item, dict):
                yield {"__row__": None, INVALID: f"{what} {number}: a JSON {type(item).__name__}, not an object"}
            else:
                yield {"__row__": json.dumps(item), INVALID: None}


def _parse_line(number: int, line: str) -> tuple[int, Any, str | None]:
    try:
        return number, json.loads(line), None
    except json.JSONDecodeError as e:
        return number, None, str(e)


class _JsonRows(Sequence):
    """Rows stored as JSON text (the line-by-line read of a file with bad lines): decoded on access."""

    def __init__(self, dataset):
        self._ds = dataset

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self._ds[int(index)]
        return {INVALID: row[INVALID]} if row.get(INVALID) is not None else json.loads(row["__row__"])


def _read_file(path: str, fmt: str, cache_dir: Path, key: str) -> tuple[Any, list[str]]:
    """(rows, column names) of one file."""
    import datasets

    try:
        ds = datasets.load_dataset(fmt, data_files=path, split="train", cache_dir=str(cache_dir))
        return ds, list(ds.column_names)
    except datasets.exceptions.DatasetGenerationError as e:
        if fmt != "json":
            raise ValueError(f"{key} {path}: the {fmt} reader failed: {e.__cause__ or e}") from None
    stat = os.stat(path)  # bad JSON lines: read line by line, each bad one kept as a row to skip and count
    ds = datasets.Dataset.from_generator(_json_lines, gen_kwargs={"path": path, "stamp": f"{stat.st_size}:{stat.st_mtime_ns}"},
                                         cache_dir=str(cache_dir))
    rows = _JsonRows(ds)
    columns = sorted({k for i in range(len(rows)) for k in rows[i]})  # every field some line has
    return rows, columns


def _read_directory(path: Path, key: str) -> Any:
    """A `datasets` Dataset / DatasetDict (save_to_disk), or a TFDS builder."""
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        import datasets

        return datasets.load_from_disk(str(path))
    if (path / "dataset_info.json").exists() and (path / "features.json").exists():
        import tensorflow_datasets as tfds

        return tfds.builder_from_directory(str(path))
    raise ValueError(f"{key} {path} is a directory but neither one written by datasets' save_to_disk "
                     "(dataset_dict.json or state.json) nor a TFDS dataset directory (dataset_info.json and "
                     "features.json); name a .jsonl, .json, .csv or .parquet file instead")


def _split_of(data: Any, split: str, where: str) -> FileSource:
    """One named split of a DatasetDict or a TFDS builder (the datasets with named splits)."""
    import datasets

    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{where} has no split {split!r}; its splits: {sorted(data)}")
        return FileSource(data[split], name=where, split=split, columns=data[split].column_names)
    if split.split("[", 1)[0] not in data.info.splits:
        raise ValueError(f"{where} has no split {split!r}; its splits: {sorted(data.info.splits)}")
    try:
        rows = data.as_data_source(split)
    except Exception as e:  # noqa: BLE001 - TFDS says why (a tfrecord-only directory), in its words
        raise ValueError(f"{where}: TFDS cannot read split {split!r} by index ({e}); prepare it with "
                         "file_format='array_record'") from None
    return FileSource(rows, name=where, split=split, columns=list(data.info.features.keys()))


def _open(path: str, cache_dir: Path, key: str) -> tuple[Any, bool]:
    """(the dataset at `path`, whether it has named splits)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{key} {path}: no such file or directory")
    if p.is_dir():
        data = _read_directory(p, key)
        return data, not _single(data)
    fmt = data_format(p)
    if fmt is None:
        raise ValueError(f"{key} {path}: unknown file type {p.suffix!r}; use .jsonl, .json, .csv or .parquet "
                         "(or a directory from datasets' save_to_disk, or a TFDS dataset directory)")
    rows, columns = _read_file(str(p), fmt, cache_dir, key)
    return FileSource(rows, name=str(p), split="train", columns=columns), False


def _single(data: Any) -> bool:
    import datasets

    return isinstance(data, datasets.Dataset)


def load_path(path: str | os.PathLike, *, train_split: str = "train", eval_split: str = "test",
              eval_path: str | os.PathLike | None = None, eval_fraction: float | None = None, split_seed: int = 0,
              cache_dir: str | os.PathLike = "data/files") -> tuple[FileSource, FileSource, str | None]:
    """(train rows, held-out rows, a note saying how the held-out rows were chosen or None)."""
    _quiet_datasets()
    if eval_fraction is not None and not 0 < eval_fraction < 1:
        raise ValueError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
    if eval_path is not None and eval_fraction is not None:
        raise ValueError("data.eval_path and data.eval_fraction both set: held-out rows come from one of them")
    cache_dir = Path(cache_dir)
    data, named = _open(str(path), cache_dir, "data.path")
    train = _split_of(data, train_split, str(path)) if named else _as_source(data, str(path), train_split)
    if eval_path is not None:
        other, other_named = _open(str(eval_path), cache_dir, "data.eval_path")
        split = eval_split if other_named and _has_split(other, eval_split) else train_split
        held = _split_of(other, split, str(eval_path)) if other_named else _as_source(other, str(eval_path), split)
        return train, held, None
    if named and eval_fraction is None and _has_split(data, eval_split):
        return train, _split_of(data, eval_split, str(path)), None
    fraction = DEFAULT_EVAL_FRACTION if eval_fraction is None else eval_fraction
    return _held_out(train, fraction, split_seed)


def _as_source(data: Any, where: str, split: str) -> FileSource:
    return data if isinstance(data, FileSource) else FileSource(data, name=where, split=split,
                                                                columns=data.column_names)


def _has_split(data: Any, split: str) -> bool:
    import datasets

    if isinstance(data, datasets.DatasetDict):
        return split in data
    return hasattr(data, "info") and split.split("[", 1)[0] in data.info.splits


class _Rows(Sequence):
    """`rows` at `indices`."""

    def __init__(self, rows: Sequence, indices: np.ndarray):
        self._rows, self._indices = rows, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int):
        return self._rows[int(self._indices[index])]


def _held_out(source: FileSource, fraction: float, seed: int) -> tuple[FileSource, FileSource, str]:
    """A seeded split of `source` into (train, held-out): at least one row each."""
    n = len(source)
    if n < 2:
        raise ValueError(f"data.path {source.name} has {n} row(s): too few to hold any out; give data.eval_path")
    k = min(max(1, round(n * fraction)), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    held, kept = np.sort(order[:k]), np.sort(order[k:])
    train = FileSource(_Rows(source, kept), name=source.name, split="train", columns=source.columns)
    evals = FileSource(_Rows(source, held), name=source.name, split="held-out", columns=source.columns)
    note = (f"data: {k} of the {n} rows of {source.name} are held out for evaluation (data.eval_fraction "
            f"{fraction}, data.split_seed {seed}); give data.eval_path to choose them")
    return train, evals, note
