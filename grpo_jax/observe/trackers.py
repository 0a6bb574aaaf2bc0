"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases (`log.wandb`) and
MLflow (`log.mlflow`). Each gets every metric record `MetricsWriter.write` gets, and the run's config.

A tracker's run is tied to the run directory, so a resumed run continues the same tracker run:
W&B by an id derived from the directory (`resume="allow"`), MLflow by the run id kept in
`RUN_DIR/mlflow_run_id`. W&B drops steps it has already seen (a resume re-logs the steps after the
last checkpoint); MLflow keeps both. A tracker that fails to log (a network outage) costs a warning
once, never the run: metrics.jsonl stays the record.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from grpo_jax.config import ConfigError

_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")  # MLflow's metric names: letters, digits, _ - . space : /


def mlflow_name(key: str) -> str:
    """A metric name MLflow takes: its characters only, no empty, `.` or `..` path parts
    (`eval/pass@k` -> `eval/pass_k`, `reward//tmp/r.py:f/mean` -> `reward/tmp/r.py:f/mean`)."""
    return "/".join(p for p in _MLFLOW_BAD.sub("_", key).split("/") if p not in ("", ".", ".."))


def _needs(package: str, key: str) -> ConfigError:
    return ConfigError(f"{key} needs the {package} package, which is not installed: pip install {package}")


class Tracker:
    """One tracker: `write(step, metrics)` (None values are skipped), `close()`."""

    name = "tracker"

    def __init__(self, log: Callable[[str], None]):
        self._log, self._failed = log, False

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None and k != "step" and math.isfinite(float(v))}
        try:
            self._write(step, values)
        except Exception as e:  # noqa: BLE001 - a tracker's outage never costs the run
            if not self._failed:
                self._log(f"{self.name}: logging failed ({type(e).__name__}: {e}); metrics.jsonl keeps every step")
            self._failed = True

    def _write(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, kwargs: Mapping[str, Any], run_dir: Path, config: dict, log: Callable[[str], None]):
        super().__init__(log)
        try:
            import wandb
        except ImportError:
            raise _needs("wandb", "log.wandb") from None
        # One W&B run per run directory: a resumed run continues it.
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        kwargs = {"project": "grpo_jax", "name": run_dir.name, "id": run_id, "resume": "allow", **kwargs}
        settings = wandb.Settings(silent=True, console="off", disable_git=True)  # our lines, not its banners
        self._run = wandb.init(dir=str(run_dir), config=config, settings=settings, **kwargs)
        where = f"offline in {self._run.dir}, upload with `wandb sync {Path(self._run.dir).parent}`" \
            if kwargs.get("mode") == "offline" else self._run.url
        log(f"wandb: run {self._run.id}: {where}")

    def _write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, options: Mapping[str, Any], run_dir: Path, config: dict, log: Callable[[str], None]):
        super().__init__(log)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _needs("mlflow", "log.mlflow") from None
        for name in ("mlflow", "alembic"):  # its database set-up lines are library noise
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = options.get("tracking_uri") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self._client = client = MlflowClient(tracking_uri=uri)
        experiment = options.get("experiment", "grpo_jax")
        found = client.get_experiment_by_name(experiment)
        # With the default store, artifacts (the config) go beside it, not into the working directory.
        artifacts = None if options.get("tracking_uri") else (run_dir / "mlflow_artifacts").resolve().as_uri()
        experiment_id = found.experiment_id if found else client.create_experiment(experiment, artifacts)
        saved = run_dir / "mlflow_run_id"
        if saved.exists():  # a resumed run continues its MLflow run
            self._run_id = saved.read_text().strip()
            client.update_run(self._run_id, status="RUNNING")
        else:
            self._run_id = client.create_run(experiment_id, run_name=options.get("run_name", run_dir.name)).info.run_id
            saved.write_text(self._run_id)
            client.log_dict(self._run_id, config, "config.yaml")
        log(f"mlflow: run {self._run_id} in experiment {experiment!r} at {uri}")

    def _write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self._client.log_batch(self._run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def open_trackers(log_config, run_dir: str | os.PathLike, config: dict, *, log: Callable[[str], None]) -> list[Tracker]:
    """The trackers `log_config` (a LogConfig) turns on, for `run_dir`; `config` is logged with them."""
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    if log_config.wandb is not None:
        trackers.append(WandbTracker(log_config.wandb, run_dir, config, log))
    if log_config.mlflow is not None:
        trackers.append(MlflowTracker(log_config.mlflow, run_dir, config, log))
    return trackers
