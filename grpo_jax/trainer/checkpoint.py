"""Orbax checkpoints of a run: the policy's parameters, the optimizer state and host-side metadata.

Layout of `RUN_DIR/checkpoints/<step>/` (an orbax `CheckpointManager` directory):
- `params`: the policy parameters (an `nnx.State` of `nnx.Param`), restorable on their own, so
  `grpo-jax eval` and `export` never need the optimizer;
- `train_state`: step, optimizer state and skip counters;
- `meta`: JSON, a versioned `run_state.CheckpointMeta` (the step, the seed, each stateful component's
  state per process: the prompt stream's position, rewards' statistics; a LoRA run's base).
The model's architecture and tokenizer are in `RUN_DIR/model/` (config.json and tokenizer files,
written at the start of the run) and the run's resolved configuration in `RUN_DIR/config.yaml`;
`find_run` walks up from a checkpoint path to them.

A run resumes from its newest checkpoint (grpo_jax.trainer.resume): the train state, the KL
reference and each host's position in its prompt stream, as `save_step` wrote them. A save that
fails on storage stops the run with one line, its previous checkpoint kept; a step directory left
incomplete by an interrupted deletion is removed at the next start
(grpo_jax.trainer.checkpoint_faults).

Every reader of checkpoints (train, eval, export, the PEFT base) picks its step by
`first_restorable`: the saved steps newest first, each damaged one warned about, the first that
restores. Preemption is grpo_jax.trainer.preemption.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from grpo_jax.config import ConfigError
from grpo_jax.runtime.hosts import any_host, multi_process
from grpo_jax.trainer import checkpoint_faults as faults
from grpo_jax.trainer import lora_base
from grpo_jax.trainer.checkpoint_faults import CheckpointError, short_error
from grpo_jax.models import Transformer, from_pretrained, load_config, load_tokenizer
from grpo_jax.models.lora import LoRAParam, add_adapters
from grpo_jax.rollout.source import RolloutSource
from grpo_jax.runtime.storage import is_remote
from grpo_jax.learner.step_factory import TrainState
from grpo_jax.learner.feed import Stateful
from grpo_jax.trainer.run_state import CheckpointMeta, save_components

T = TypeVar("T")

# The items of a saved step (orbax's composite items), named here once for every save and restore.
PARAMS, TRAIN_STATE, META, REFERENCE, IN_FLIGHT = "params", "train_state", "meta", "reference", "in_flight"


def _abstract(tree):
    """Restore targets. Arrays without a sharding go to this process's first device: orbax would
    otherwise reuse the saved shardings, whose devices (another host count or mesh) may not exist here."""
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=(x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None) or local),
        tree)


class Checkpointer:
    """Saves asynchronously every call to `save`; keeps the newest `keep` steps. A save that fails
    on storage (a full disk, ...) raises CheckpointError at the first `check` (every step), `save`,
    `wait` or `close` after orbax's writer gave up: one line, the newest complete step kept
    (grpo_jax.trainer.checkpoint_faults). Opening removes incomplete step directories, with one
    line to `log`, and orbax's temporary directories of interrupted saves."""

    def __init__(self, directory: str | Path, *, keep: int = 3, log: Callable[[str], None] | None = None):
        if is_remote(directory):  # gs://...: orbax writes it through tensorstore
            self.directory = epath.Path(str(directory))
        else:
            self.directory = Path(directory).absolute()
        self._log = log or _stderr
        if removed := faults.remove_incomplete(self.directory):
            self._log(f"removed incomplete checkpoint directories {removed} in {self.directory} (no "
                      f"{faults.STEP_METADATA}: a save or a deletion of them was interrupted)")
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True))
        self._quiet = faults.Quiet()
        self._in_flight: int | None = None  # the step saving in the background
        self._newest = max(self._manager.all_steps(), default=None)  # the newest complete step
        self._failed = False

    def save(self, step: int, state: TrainState, meta: CheckpointMeta, reference=None, in_flight=None) -> None:
        """`reference`: the KL reference policy's params (grpo.beta > 0), saved so a resumed run
        measures KL against the same policy; `in_flight`: a pipelined run's parameter copies that
        sampled its batches in flight (grpo_jax.rollout.pipeline)."""
        self._settle()  # the previous save's error is its own, not this one's
        rest = dataclasses.replace(state, params=None)
        items = {PARAMS: ocp.args.StandardSave(state.params), TRAIN_STATE: ocp.args.StandardSave(rest),
                 META: ocp.args.JsonSave(meta.to_json())}
        if reference is not None:
            items[REFERENCE] = ocp.args.StandardSave(reference)
        if in_flight:
            items[IN_FLIGHT] = ocp.args.StandardSave(list(in_flight))
        self._in_flight = step
        try:
            self._manager.save(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - a storage fault becomes CheckpointError, anything else stays
            self._fail(e)

    def check(self) -> None:
        """Without waiting: raise CheckpointError if the save in flight has failed (decided by every
        host together: one small collective per step while a save is in flight on several hosts)."""
        if self._in_flight is not None and not any_host(self._manager.is_saving_in_progress()):
            self._settle()

    def _settle(self) -> None:
        """Wait for the save in flight; its storage fault (on any host) is a CheckpointError."""
        if self._in_flight is None:
            return
        try:
            self._manager.wait_until_finished()
            error = None
        except Exception as e:  # noqa: BLE001 - judged by _fail
            error = e
        if any_host(error is not None):
            self._fail(error)
        self._newest, self._in_flight = self._in_flight, None

    def _fail(self, error: Exception | None) -> None:
        """Raise the failure of the save in flight: a CheckpointError for a storage fault (here or,
        `error` None, on another host), else `error` itself."""
        step, self._in_flight, self._failed = self._in_flight, None, True
        self._quiet.failed = True
        cause = faults.storage_fault(error) if error is not None else "failed on another host"
        if cause is None:
            raise error
        raise CheckpointError(step, self.directory, cause, self._newest) from error

    def restore(self, step: int, state: TrainState, reference=None, in_flight=None):
        """(state, reference params or None, meta, in-flight parameters or None) of a saved step,
        placed like `state`, `reference` and `in_flight` (arrays, or shape structs with shardings)."""
        rest = dataclasses.replace(state, params=None)
        items = {PARAMS: ocp.args.StandardRestore(_abstract(state.params)),
                 TRAIN_STATE: ocp.args.StandardRestore(_abstract(rest)), META: ocp.args.JsonRestore()}
        if reference is not None:
            items[REFERENCE] = ocp.args.StandardRestore(_abstract(reference))
        if in_flight:
            items[IN_FLIGHT] = ocp.args.StandardRestore(list(in_flight))
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        restored = dataclasses.replace(out[TRAIN_STATE], params=out[PARAMS])
        return (restored, (out[REFERENCE] if reference is not None else None), CheckpointMeta.from_json(out[META]),
                (list(out[IN_FLIGHT]) if in_flight else None))

    def restore_meta(self, step: int) -> CheckpointMeta:
        """The `meta` item of a saved step alone (no arrays read)."""
        out = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        return CheckpointMeta.from_json(out[META])

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
        self._newest = max(self._manager.all_steps(), default=None)  # what a failed save's message names

    def wait(self) -> None:
        """Until every save in flight is complete (committed) on storage (CheckpointError if it failed)."""
        self._settle()

    def close(self) -> None:
        try:
            self._settle()
        finally:
            self._manager.close()
            if self._failed:  # what a failed save's writes left behind goes now, not at exit
                gc.collect()
            self._quiet.remove()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            self.close()
        except CheckpointError as e:
            if error is None or faults.storage_fault(error) is not None:
                raise  # the same storage fault, said with the step and what is kept
            self._log(str(e))  # another error already on its way stays the one raised


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
            **{PARAMS: ocp.args.StandardRestore(_abstract(abstract_params))}))
    return restored[PARAMS]


def read_meta(files: RunFiles) -> CheckpointMeta:
    """The `meta` item of the step `files` names (no arrays read)."""
    with ocp.CheckpointManager(files.checkpoints) as manager:
        raw = manager.restore(files.step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    return CheckpointMeta.from_json(raw)


def local_base(files: RunFiles) -> str | None:
    """A LoRA run's base as a local HF directory (RUN_DIR/base, or `model.path` when it is one),
    from the step's metadata (its fingerprint checked), else None (a .gguf file, a remote copy)."""
    saved = read_meta(files).base
    directory = lora_base.locate(saved, files.run_dir)
    if saved["path"] == lora_base.BASE_DIR or Path(saved["path"]).resolve() == Path(directory).resolve():
        return str(Path(directory).resolve())
    return None


def _lora_policy(files: RunFiles, lora: dict, *, dtype, param_dtype):
    """A LoRA run's policy at one saved step: its base (from where the step's metadata says, its
    fingerprint checked: `grpo_jax.trainer.lora_base`) with the step's adapters."""
    model = from_pretrained(lora_base.locate(read_meta(files).base, files.run_dir), dtype=dtype,
                            param_dtype=param_dtype)
    add_adapters(model, rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]),
                 dropout=lora.get("dropout", 0.0), key=jax.random.key(0))
    graphdef, adapters, base = nnx.split(model, LoRAParam, nnx.Param)
    return nnx.merge(graphdef, restore_params(files, adapters), base)


class NothingRestores(FileNotFoundError):
    """No saved step restores; the message lists each one's error."""


def first_restorable(steps: Sequence[int], attempt: Callable[[int], T], *, where: str,
                     warn: Callable[[str], None], agree: Callable[[bool], bool] = bool,
                     label: Callable[[int], str] | None = None) -> tuple[int, T, list[int]]:
    """(the step, what `attempt(step)` returned, the newer steps that failed) for the newest of
    `steps` (newest first) whose `attempt` returns. A ConfigError from `attempt` is the user's
    input, not damage: it propagates. `agree(failed)` is True when this step failed on any host.
    Raises NothingRestores naming every step's error. `label(step)` names a step in warnings
    (default: "of step N in WHERE")."""
    label = label or (lambda step: f"of step {step} in {where}")
    errors, failed = [], []
    for step in steps:
        try:
            result, error = attempt(step), None
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - anything unreadable: a damaged or partial checkpoint
            result, error = None, e
        if not agree(error is not None):
            return step, result, failed
        why = short_error(error) if error is not None else "damaged on another host"
        errors.append(f"step {step}: {why}")
        failed.append(step)
        warn(f"warning: checkpoint {label(step)} is damaged or incomplete ({why}); "
                 "trying the previous one")
    raise NothingRestores(f"{where} holds checkpoints {sorted(steps)} but none of them restores ("
                          + "; ".join(errors) + "); move checkpoints/ away to start afresh")


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def load_policy(checkpoint: str | Path, *, dtype=jnp.float32, param_dtype=jnp.float32,
                warn: Callable[[str], None] = _stderr):
    """(model, tokenizer, RunFiles) of a saved step: the run's architecture with the step's params,
    computing in `dtype` and stored in `param_dtype` (a run's `model.dtype` / `model.param_dtype`).
    Without a named step, a damaged or incomplete newest checkpoint is skipped with a warning
    (`warn`) and the newest one that restores is used (RunFiles.step says which)."""
    from grpo_jax.config import load_config as load_run_config

    files = find_run(checkpoint)
    config = load_config(files.run_dir / "model")
    lora = load_run_config(files.run_dir / "config.yaml").lora

    def attempt(step: int):
        here = dataclasses.replace(files, step=step, older=())
        if lora.enabled:
            return _lora_policy(here, dataclasses.asdict(lora), dtype=dtype, param_dtype=param_dtype), here
        abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
        graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
        return nnx.merge(graphdef, restore_params(here, abstract_params), rest), here

    try:
        _, (model, here), _ = first_restorable((files.step, *files.older), attempt, where=str(files.checkpoints),
                                               warn=warn, label=lambda step: str(files.checkpoints / str(step)))
    except NothingRestores as e:
        raise FileNotFoundError(f"no restorable checkpoint in {files.checkpoints}: {e}") from None
    return model, load_tokenizer(files.run_dir / "model"), here


def save_step(checkpointer: Checkpointer, step: int, state: TrainState, *, components: Mapping[str, Stateful],
              seed: int, reference=None, base: dict | None = None, source: RolloutSource | None = None) -> None:
    """Checkpoint `step` (collective: every process saves its shards): the state, the KL reference
    and every host's state of each component (`state_dict()`, gathered: the prompt stream as
    `data`, the rewards that keep state as `rewards`); a LoRA run's `base` record
    (`grpo_jax.trainer.lora_base.record`) goes into the metadata. A pipelined `source` with batches
    in flight adds their parameters, and the components it names are saved as they were before the
    first of them (a resumed run samples them again)."""
    flight = source.in_flight() if source is not None else None
    meta = CheckpointMeta(step=step, seed=seed, components=save_components(components, rewind=flight and flight.rewind),
                          base=base, pipeline=flight.meta if flight else None)
    checkpointer.save(step, state, meta, reference=reference, in_flight=flight.params if flight else None)
