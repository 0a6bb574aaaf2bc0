"""Orbax checkpoints of a run: the policy's parameters, the optimizer state and host-side metadata.

Layout of `RUN_DIR/checkpoints/<step>/` (an orbax `CheckpointManager` directory):
- `params`: the policy parameters (an `nnx.State` of `nnx.Param`), restorable on their own, so
  `grpo-jax eval` and `export` never need the optimizer;
- `train_state`: step, optimizer state and skip counters;
- `meta`: JSON (data stream position, rng seed, metrics of the step).
The model's architecture and tokenizer are in `RUN_DIR/model/` (config.json and tokenizer files,
written at the start of the run) and the run's resolved configuration in `RUN_DIR/config.yaml`;
`find_run` walks up from a checkpoint path to them.

A run resumes (`resume`) from its newest checkpoint: the train state, the KL reference and each
host's position in its prompt stream, as `save_step` wrote them; `check_resumable` refuses a
restart that could not resume before it writes anything.

Preemption (`StopSignals`): a preemption notice (SIGTERM) or Ctrl-C (SIGINT) ends the current
step, saves a checkpoint at it and lets the run return normally; a second signal aborts at once.

On one host the trainer's own signal handlers set the flag. On several hosts (jax.distributed)
JAX's preemption service already owns SIGTERM: it agrees on a step every host reaches
(`multihost_utils.reached_preemption_sync_point`), so every host saves the same step; SIGINT is
still ours, and a flag set on any host stops every host at the same step (one small collective
per step, shared with the wall-clock checkpoint decision).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import yaml
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from grpo_jax.config import ConfigError
from grpo_jax.runtime.hosts import any_hosts, gather_json, multi_process
from grpo_jax.trainer import lora_base
from grpo_jax.models import Transformer, from_pretrained, load_config, load_tokenizer
from grpo_jax.models.lora import LoRAParam, add_adapters
from grpo_jax.runtime.storage import is_remote
from grpo_jax.learner.train_step import TrainState


def _abstract(tree):
    """Restore targets. Arrays without a sharding go to this process's first device: orbax would
    otherwise reuse the saved shardings, whose devices (another host count or mesh) may not exist here."""
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or local),
                        tree)


class Checkpointer:
    """Saves asynchronously every call to `save`; keeps the newest `keep` steps."""

    def __init__(self, directory: str | Path, *, keep: int = 3):
        if is_remote(directory):  # gs://...: orbax writes it through tensorstore
            self.directory = epath.Path(str(directory))
        else:
            self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def save(self, step: int, state: TrainState, meta: dict[str, Any], reference=None) -> None:
        """`reference`: the KL reference policy's params (grpo.beta > 0), saved so a resumed run
        measures KL against the same policy."""
        rest = dataclasses.replace(state, params=None)
        items = dict(params=ocp.args.StandardSave(state.params), train_state=ocp.args.StandardSave(rest),
                     meta=ocp.args.JsonSave(meta))
        if reference is not None:
            items["reference"] = ocp.args.StandardSave(reference)
        self._manager.save(step, args=ocp.args.Composite(**items))

    def restore(self, step: int, state: TrainState, reference=None):
        """(state, reference params or None, meta) of a saved step, placed like `state` and
        `reference` (arrays, or shape structs with shardings)."""
        rest = dataclasses.replace(state, params=None)
        items = dict(params=ocp.args.StandardRestore(_abstract(state.params)),
                     train_state=ocp.args.StandardRestore(_abstract(rest)), meta=ocp.args.JsonRestore())
        if reference is not None:
            items["reference"] = ocp.args.StandardRestore(_abstract(reference))
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        restored = dataclasses.replace(out.train_state, params=out.params)
        return restored, (out.reference if reference is not None else None), dict(out.meta)

    def restore_meta(self, step: int) -> dict:
        """The `meta` item of a saved step alone (no arrays read)."""
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out.meta)

    def all_steps(self) -> list[int]:
        """Saved steps orbax lists as finalized, newest first (one may still be damaged)."""
        self._manager.reload()
        return sorted(self._manager.all_steps(), reverse=True)

    def set_aside(self, steps: list[int]) -> None:
        """Damaged steps out of the way (a resumed run saves these step numbers again): moved to
        `checkpoints_damaged/` beside the checkpoints (deleted on remote storage), by process 0."""
        if multi_process():
            multihost_utils.sync_global_devices("grpo_jax_set_aside_before")
        if jax.process_index() == 0:
            for step in steps:
                if isinstance(self.directory, Path):
                    aside = self.directory.parent / "checkpoints_damaged"
                    aside.mkdir(exist_ok=True)
                    target = aside / f"{step}.{int(time.time())}"
                    (self.directory / str(step)).rename(target)
                else:
                    self._manager.delete(step)
        if multi_process():
            multihost_utils.sync_global_devices("grpo_jax_set_aside_after")
        self._manager.reload()

    def wait(self) -> None:
        """Until every save in flight is complete (committed) on storage."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


@dataclasses.dataclass(frozen=True)
class RunFiles:
    run_dir: Path
    checkpoints: Path
    step: int
    older: tuple[int, ...] = ()  # saved steps before `step`, newest first (fallbacks when it was not named)


def find_run(checkpoint: str | Path) -> RunFiles:
    """Resolve `RUN_DIR`, `RUN_DIR/checkpoints` or `RUN_DIR/checkpoints/<step>` to the run's files
    and a step (the newest one unless the path names a step)."""
    path = Path(checkpoint).absolute()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {str(checkpoint)!r} does not exist; pass a run directory "
                                "written by `grpo-jax train` or its checkpoints/<step> subdirectory")
    step = None
    if path.name.isdigit() and path.parent.name == "checkpoints":
        step, path = int(path.name), path.parent
    if path.name != "checkpoints" and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.name != "checkpoints":
        raise FileNotFoundError(f"{checkpoint} is not a run directory: it has no checkpoints/ subdirectory")
    run_dir = path.parent
    for needed in ("config.yaml", "model/config.json"):
        if not (run_dir / needed).exists():
            raise FileNotFoundError(f"{run_dir} lacks {needed}; it was not written by `grpo-jax train`")
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit())
    if not steps:
        raise FileNotFoundError(f"{path} holds no saved step yet")
    if step is None:
        return RunFiles(run_dir=run_dir, checkpoints=path, step=steps[-1], older=tuple(reversed(steps[:-1])))
    if step not in steps:
        raise FileNotFoundError(f"{path} has no step {step}; saved steps: {steps}")
    return RunFiles(run_dir=run_dir, checkpoints=path, step=step)


def restore_params(files: RunFiles, abstract_params):
    """The `params` item of one saved step, shaped like `abstract_params` (arrays or shape structs)."""
    with ocp.CheckpointManager(files.checkpoints) as manager:
        restored = manager.restore(files.step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(abstract_params))))
    return restored.params


def _lora_policy(files: RunFiles, lora: dict, *, dtype, param_dtype):
    """A LoRA run's policy at one saved step: its base (from where the step's metadata says, its
    fingerprint checked: `grpo_jax.trainer.lora_base`) with the step's adapters."""
    with ocp.CheckpointManager(files.checkpoints) as manager:
        meta = dict(manager.restore(files.step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    model = from_pretrained(lora_base.locate(meta["base"], files.run_dir), dtype=dtype, param_dtype=param_dtype)
    add_adapters(model, rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]),
                 dropout=lora.get("dropout", 0.0), key=jax.random.key(0))
    graphdef, adapters, base = nnx.split(model, LoRAParam, nnx.Param)
    return nnx.merge(graphdef, restore_params(files, adapters), base)


def short_error(e: BaseException) -> str:
    """One line naming an exception: its type and the start of its message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def load_policy(checkpoint: str | Path, *, dtype=jnp.float32, param_dtype=jnp.float32,
                warn: Callable[[str], None] = _stderr):
    """(model, tokenizer, RunFiles) of a saved step: the run's architecture with the step's params,
    computing in `dtype` and stored in `param_dtype` (a run's `model.dtype` / `model.param_dtype`).
    Without a named step, a damaged or incomplete newest checkpoint is skipped with a warning
    (`warn`) and the newest one that restores is used (RunFiles.step says which)."""
    files = find_run(checkpoint)
    config = load_config(files.run_dir / "model")
    lora = (yaml.safe_load((files.run_dir / "config.yaml").read_text()) or {}).get("lora") or {}
    errors = []
    for step in (files.step, *files.older):  # a named step only; else the newest that restores
        here = dataclasses.replace(files, step=step, older=())
        try:
            if lora.get("rank"):
                model = _lora_policy(here, lora, dtype=dtype, param_dtype=param_dtype)
            else:
                abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                              param_dtype=param_dtype))
                graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
                model = nnx.merge(graphdef, restore_params(here, abstract_params), rest)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read it means the checkpoint is damaged
            errors.append(f"step {step}: {short_error(e)}")
            if files.older:
                warn(f"warning: checkpoint {files.checkpoints / str(step)} is damaged or incomplete "
                     f"({short_error(e)}); trying the previous one")
            continue
        return model, load_tokenizer(files.run_dir / "model"), here
    raise FileNotFoundError(f"no restorable checkpoint in {files.checkpoints}: " + "; ".join(errors))


def save_step(checkpointer: Checkpointer, step: int, state: TrainState, *, stream, seed: int,
              reference=None, base: dict | None = None, rewards: Sequence = ()) -> None:
    """Checkpoint `step` (collective: every process saves its shards): the state, the KL reference
    and every host's prompt-stream position (`stream.state_dict()`, gathered); a LoRA run's `base`
    record (`grpo_jax.trainer.lora_base.record`) goes into the metadata, and so does the state of every
    reward that keeps one (`fn.state()`: a reward model's running normalisation), per host."""
    streams = gather_json(stream.state_dict())  # each host's position in its share
    meta = {"step": step, "seed": seed, "data": streams[0], **({"data_by_process": streams} if len(streams) > 1 else {}),
            **({"base": base} if base is not None else {})}
    held = {spec.name: spec.fn.state() for spec in rewards if hasattr(spec.fn, "state")}
    if held:
        meta["rewards_by_process"] = gather_json(held)
    checkpointer.save(step, state, meta, reference=reference)


def check_resumable(checkpointer: Checkpointer, step: int, *, stream, run_dir: Path, model_json: dict) -> None:
    """Everything that would stop `resume` from continuing checkpoint `step`, checked before a
    restarted run writes anything: the run's architecture (`run_dir/model/config.json`) against the
    config's (`model_json`, what `write_model_files` would write), the number of hosts, and this
    host's prompt stream against the saved one (loaded into `stream`, as `resume` does again). A
    ConfigError says what differs."""
    saved_file = Path(run_dir) / "model" / "config.json"
    if saved_file.exists():
        saved = json.loads(saved_file.read_text())
        ignore = {"torch_dtype", "dtype", "transformers_version"}
        changed = sorted(k for k in set(saved) | set(model_json) if k not in ignore and saved.get(k) != model_json.get(k))
        if changed:
            diff = ", ".join(f"{k} {saved.get(k)!r} -> {model_json.get(k)!r}" for k in changed[:6])
            raise ConfigError(f"{run_dir} holds a run of another model ({diff}); resume it with its own config "
                              f"({Path(run_dir) / 'config.yaml'}) or choose another --output")
    meta = checkpointer.restore_meta(step)
    _load_stream(meta, step, stream)


def _load_stream(meta: dict, step: int, stream) -> None:
    streams = meta.get("data_by_process") or [meta["data"]]
    if len(streams) != jax.process_count():
        raise ConfigError(f"checkpoint step {step} was written by {len(streams)} processes, this run has "
                          f"{jax.process_count()}; resume with the same number of hosts")
    try:
        stream.load_state_dict(streams[jax.process_index()])
    except ValueError as e:
        raise ConfigError(f"cannot resume step {step} with this config: {e}") from None


def resume(checkpointer: Checkpointer, step: int, state: TrainState, *, stream, reference=None,
           rewards: Sequence = ()):
    """(state, reference) of checkpoint `step`, placed like `state` and `reference`, with this
    host's prompt stream moved to where it was and its rewards' states (`save_step`) restored. A
    checkpoint of another number of hosts, or a stream with other settings, is a ConfigError."""
    restored, saved_reference, meta = checkpointer.restore(step, state, reference)
    _load_stream(meta, step, stream)
    saved = (meta.get("rewards_by_process") or [{}] * jax.process_count())[jax.process_index()]
    for spec in rewards:
        if hasattr(spec.fn, "load_state") and spec.name in saved:
            spec.fn.load_state(saved[spec.name])
    return restored, (reference if saved_reference is None else saved_reference)


def _jax_preemption_service() -> bool:
    """True when jax.distributed runs its preemption service (it then handles SIGTERM itself)."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a JAX without the module: no service to defer to
        return False
    return distributed.global_state.preemption_sync_manager is not None


class StopSignals:
    """Context manager installing the handlers (main thread only; restored on exit), and the
    per-step decision `check(step)` -> (stop, checkpoint due by the clock), the same on every host."""

    def __init__(self, log: Callable[[str], None], *, every_minutes: float = 0.0):
        self.log = log
        self.every_s = every_minutes * 60.0
        self.received: str | None = None  # the signal's name, once one arrived (on this host)
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}
        self._jax_service = multi_process() and _jax_preemption_service()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            signals = [signal.SIGINT] + ([] if self._jax_service else [signal.SIGTERM])
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # the second signal: stop now, without saving
            signal.signal(signum, signal.SIG_DFL)
            self.log(f"received {name} again: aborting now, without a checkpoint")
            os.kill(os.getpid(), signum)
            return
        self.received = name
        self.log(f"received {name}: finishing this step, then saving a checkpoint and stopping "
                 f"(send {name} again to abort at once)")

    def saved(self) -> None:
        """A checkpoint was just written: the clock starts again."""
        self.last_save = time.monotonic()

    def check(self, step: int) -> tuple[bool, bool]:
        """(stop after this step, a checkpoint is due by `every_minutes`): decided together by all
        hosts, so each saves and stops at the same step."""
        due = bool(self.every_s) and time.monotonic() - self.last_save >= self.every_s
        stop, due = any_hosts(self.received is not None, due)
        if self._jax_service and multihost_utils.reached_preemption_sync_point(step):
            stop = True
            self.received = self.received or "a preemption notice (JAX preemption service)"
        return stop, due
