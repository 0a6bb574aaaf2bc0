"""Run outputs on the host: metrics.jsonl, samples.jsonl and TensorBoard events, written and read back.

A run directory holds

- `metrics.jsonl`: one JSON object per `MetricsWriter.write` call (the trainer calls it once per
  step with everything measured at that step), always with an integer `step`. The file is plain
  JSON: non-finite values (NaN, inf) are written as `null`, and `read_metrics` turns them back
  into NaN. Each line is flushed to the OS as it is written, so a killed run keeps every step it
  finished (no fsync: a machine crash may lose the last lines).
- `samples.jsonl`: one JSON object per sampled completion, with its `step` and rewards.
- `tensorboard/`: the same scalars and samples as TensorBoard event files, written with
  TensorBoard's own TensorFlow-free event writer (tags are the metric names, unchanged).

Only one process of a multi-host run should write (process index 0); the writer does not check.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
_SAMPLES_TAG = "samples"


# --------------------------------------------------------------------------- value conversion

def _metric_value(key: str, value: Any) -> int | float | None:
    """A 0-d number (Python, NumPy or JAX) as a JSON value: ints stay ints, non-finite is None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    arr = np.asarray(value)  # a JAX array is copied to the host here
    if arr.ndim != 0:
        raise ValueError(f"metric {key!r} has shape {arr.shape}; reduce it to a scalar before writing")
    if arr.dtype.kind in "OUSc":
        raise TypeError(f"metric {key!r} must be a real number, got {type(value).__name__} {value!r}")
    if arr.dtype.kind in "biu":
        return int(arr)
    f = float(arr)  # float16/32/64 and ml_dtypes' bfloat16 (dtype kind 'V')
    return f if math.isfinite(f) else None


def _jsonable(x: Any) -> Any:
    """Sample rows: nested dicts/lists of strings and numbers, with NaN/inf as None."""
    if x is None or isinstance(x, (str, bool, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    arr = np.asarray(x)
    if arr.dtype.kind == "O":
        raise TypeError(f"cannot write {type(x).__name__} {x!r} to samples.jsonl")
    if arr.ndim:
        return [_jsonable(v) for v in arr.tolist()]
    if arr.dtype.kind in "US":
        return str(arr.item())
    if arr.dtype.kind == "b":
        return bool(arr)
    return _metric_value("sample field", arr)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or np.asarray(step).dtype.kind not in "iu" or np.ndim(step) != 0:
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")
    if int(step) < 0:
        raise ValueError(f"step must be >= 0, got {int(step)}")
    return int(step)


def _parse_lines(path: Path) -> list[dict]:
    """All records of a jsonl file; a malformed last line (a write cut off by a kill) is skipped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a JSON object with a 'step'")
        except ValueError as e:
            if i == len(lines) - 1:
                log.warning("%s: ignoring an incomplete last line (%s)", path, e)
                break
            raise ValueError(f"{path}, line {i + 1}: {e}; the file is corrupt, fix or remove that line") from e
        records.append(record)
    return records


def _drop_partial_tail(path: Path) -> None:
    """Cut a last line without its newline, so that the next append starts a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    log.warning("%s: dropping an incomplete last line of %d bytes", path, len(data) - keep)
    os.truncate(path, keep)


# --------------------------------------------------------------------------- writer

class Closing(contextlib.AbstractContextManager):
    """A `with` block's resource (the metrics writer, the progress bar): entering gives the object
    itself, leaving closes it, whatever the block raised."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the resource; calling it again does nothing."""

    def __exit__(self, *exc) -> None:
        self.close()


def _after_existing_event_files(tb_dir: Path) -> None:
    """Wait, if need be, until a new event file's name sorts after every existing one's: TensorBoard
    reads a directory's event files in name order, and the name carries the creation time in whole
    seconds, then a per-process counter that sorts as text (10 before 9). A writer reopened within
    the second its predecessor started (a resume) would otherwise be read first, and the restart
    marker that drops the interrupted run's later steps would apply to the wrong events."""
    stamps = [int(f.name.split(".")[3]) for f in tb_dir.glob("events.out.tfevents.*")
              if f.name.split(".")[3].isdigit()] if tb_dir.is_dir() else []
    if stamps and max(stamps) >= int(time.time()):
        time.sleep(max(stamps) + 1 - time.time())


class MetricsWriter(Closing):
    """Appends per-step metrics and sample completions to a run directory (see module docstring).

    Opening an existing run directory appends to it; after restoring a checkpoint, call
    `truncate_after(last_kept_step)` to drop what the interrupted run wrote after that step.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, trackers: Sequence = ()):
        self.run_dir = Path(run_dir)
        self._trackers = list(trackers)  # grpo_jax.observe.trackers: W&B, MLflow
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics_path = self.run_dir / METRICS_FILE
        self._samples_path = self.run_dir / SAMPLES_FILE
        self._files: dict[Path, TextIO] = {}
        self._tb = None
        self._closed = False
        if tensorboard:
            # Imported here so that runs without TensorBoard never load it.
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            _after_existing_event_files(self.run_dir / TENSORBOARD_DIR)
            self._tb = EventFileWriter(str(self.run_dir / TENSORBOARD_DIR))
        self._file(self._metrics_path)  # create metrics.jsonl (and repair its tail) now

    def _file(self, path: Path) -> TextIO:
        if self._closed:
            raise RuntimeError(f"MetricsWriter for {self.run_dir} is closed")
        if path not in self._files:
            _drop_partial_tail(path)
            self._files[path] = open(path, "a", encoding="utf-8")
        return self._files[path]

    def _append(self, path: Path, records: Sequence[dict]) -> None:
        f = self._file(path)
        # One write per call: a reader never sees half of a record unless the process dies mid-write.
        f.write("".join(json.dumps(r, allow_nan=False, ensure_ascii=False) + "\n" for r in records))
        f.flush()

    def _tb_event(self, step: int, summary=None, session_log=None) -> None:
        from tensorboard.compat.proto import event_pb2

        self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary,
                                           session_log=session_log))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one record `{"step": step, **metrics}`; values must be 0-d numbers."""
        step = _check_step(step)
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be strings, got {key!r}")
            if key == "step":
                raise ValueError("pass the step as the `step` argument, not as a metric")
            record[key] = _metric_value(key, value)
        self._append(self._metrics_path, [record])
        if self._tb is not None:
            from tensorboard.compat.proto import summary_pb2

            values = [summary_pb2.Summary.Value(tag=k, simple_value=math.nan if v is None else float(v))
                      for k, v in record.items() if k != "step"]
            self._tb_event(step, summary=summary_pb2.Summary(value=values))
            self._tb.flush()
        for tracker in self._trackers:
            tracker.write(step, record)

    def write_histogram(self, step: int, tag: str, values, *, bins: int = 10,
                        value_range: tuple[float, float] | None = None) -> None:
        """A histogram of `values` at `step`, in TensorBoard only (tag unchanged; metrics.jsonl holds
        scalars). Nothing is written for an empty array or without TensorBoard."""
        values = np.asarray(values, np.float64).ravel()
        values = values[np.isfinite(values)]
        if self._tb is None or not values.size:
            return
        from tensorboard.compat.proto import summary_pb2

        counts, edges = np.histogram(values, bins=bins, range=value_range)
        proto = summary_pb2.HistogramProto(min=float(values.min()), max=float(values.max()), num=float(values.size),
                                           sum=float(values.sum()), sum_squares=float(np.square(values).sum()),
                                           bucket_limit=[float(e) for e in edges[1:]],
                                           bucket=[float(c) for c in counts])
        self._tb_event(_check_step(step), summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag,
                                                                                                    histo=proto)]))
        self._tb.flush()

    def write_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append sampled completions, one JSON object per row, e.g. `{"prompt", "completion",
        "reward", ...}`; in TensorBoard they form one text table (tag `samples`) at `step`."""
        step = _check_step(step)
        records = []
        for row in rows:
            if not isinstance(row, Mapping):
                raise TypeError(f"each sample row must be a dict, got {type(row).__name__}")
            if "step" in row:
                raise ValueError("pass the step as the `step` argument, not inside the sample rows")
            records.append({"step": step, **_jsonable(row)})
        if not records:
            return
        self._append(self._samples_path, records)
        if self._tb is not None:
            from tensorboard.plugins.text.summary_v2 import text_pb

            cells = np.array([_sample_markdown(r) for r in records], dtype=object)
            self._tb_event(step, summary=text_pb(_SAMPLES_TAG, cells))
            self._tb.flush()

    def truncate_after(self, last_kept_step: int) -> int:
        """Drop the records with `step > last_kept_step` from metrics.jsonl and samples.jsonl, and
        tell TensorBoard to discard its events past that step. Returns how many metric records
        were dropped. Use it when resuming from a checkpoint taken after `last_kept_step`."""
        return self._keep_through(_check_step(last_kept_step))

    def start_over(self) -> int:
        """Drop every record (and TensorBoard's events): a run that starts from scratch in a
        directory whose earlier attempt stopped before its first checkpoint logs its steps once."""
        if not any(p.exists() and p.stat().st_size for p in (self._metrics_path, self._samples_path)):
            return 0
        return self._keep_through(-1)

    def _keep_through(self, last_kept_step: int) -> int:
        dropped = 0
        for path in (self._metrics_path, self._samples_path):
            if path in self._files:
                self._files.pop(path).close()
            if not path.exists():
                continue
            records = _parse_lines(path)
            kept = [r for r in records if r["step"] <= last_kept_step]
            if path == self._metrics_path:
                dropped = len(records) - len(kept)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r, allow_nan=False, ensure_ascii=False) + "\n"
                                   for r in kept), encoding="utf-8")
            os.replace(tmp, path)  # a kill mid-rewrite leaves the old file, never a half one
        self._file(self._metrics_path)
        if self._tb is not None:
            from tensorboard.compat.proto import event_pb2

            # TensorBoard's restart marker: readers purge earlier events with step >= this one.
            self._tb_event(last_kept_step + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
            self._tb.flush()
        return dropped

    def close(self) -> None:
        """Flush and close every file; calling it again does nothing."""
        if self._closed:
            return
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()
        self._closed = True


def _sample_markdown(record: Mapping[str, Any]) -> str:
    """One sample as a TensorBoard text cell: numbers inline, text as an indented code block."""
    parts = []
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, str):
            block = "\n".join("    " + line for line in value.splitlines() or [""])
            parts.append(f"**{key}**:\n\n{block}\n")
        else:
            shown = format_value(value) if isinstance(value, (int, float)) or value is None else json.dumps(value)
            parts.append(f"**{key}**: {shown}\n")
    return "\n".join(parts)


# --------------------------------------------------------------------------- reading

def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` in file order, with `null` read back as NaN."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {run_dir}: pass the directory given to `grpo-jax train --output` "
            "(it is written from the first finished step on)")
    return [{k: math.nan if v is None else v for k, v in r.items()} for r in _parse_lines(path)]


def series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of metric `key` over `records` (metrics.jsonl rows), as float arrays of the
    records where it is a finite number (empty arrays when it never is)."""
    pts = [(r["step"], float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    steps, values = zip(*pts) if pts else ((), ())
    return np.asarray(steps, float), np.asarray(values, float)


# --------------------------------------------------------------------------- one-line summaries

def format_value(v: Any) -> str:
    """A metric value in a few characters (ints whole, large numbers as k/M, None as nan): the one
    format of TensorBoard's sample cells and the progress bar."""
    if v is None:
        return "nan"
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return str(f)
    if abs(f) >= 1e4:
        return f"{f / 1e3:.1f}k" if abs(f) < 1e6 else f"{f / 1e6:.2f}M"
    return f"{f:.3g}" if abs(f) < 1e-3 and f != 0 else f"{f:.4g}"
