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

Every reader of checkpoints (train, eval, export, the PEFT base) picks its step by
`first_restorable`: the saved steps newest first, each damaged one warned about, the first that
restores. Preemption is grpo_jax.trainer.preemption.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from grpo_jax.config import ConfigError
from grpo_jax.runtime.hosts import gather_json, multi_process
from grpo_jax.trainer import lora_base
from grpo_jax.models import Transformer, from_pretrained, load_config, load_tokenizer
from grpo_jax.models.lora import LoRAParam, add_adapters
from grpo_jax.rewards import StatefulReward
from grpo_jax.rollout.source import RolloutSource
from grpo_jax.runtime.storage import is_remote
from grpo_jax.learner.step_factory import TrainState

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
    """Saves asynchronously every call to `save`; keeps the newest `keep` steps."""

    def __init__(self, directory: str | Path, *, keep: int = 3):
        if is_remote(directory):  # gs://...: orbax writes it through tensorstore
            self.directory = epath.Path(str(directory))
        else:
            self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def save(self, step: int, state: TrainState, meta: dict[str, Any], reference=None, in_flight=None) -> None:
        """`reference`: the KL reference policy's params (grpo.beta > 0), saved so a resumed run
        measures KL against the same policy; `in_flight`: a pipelined run's parameter copies that
        sampled its batches in flight (grpo_jax.rollout.pipeline)."""
        rest = dataclasses.replace(state, params=None)
        items = {PARAMS: ocp.args.StandardSave(state.params), TRAIN_STATE: ocp.args.StandardSave(rest),
                 META: ocp.args.JsonSave(meta)}
        if reference is not None:
            items[REFERENCE] = ocp.args.StandardSave(reference)
        if in_flight:
            items[IN_FLIGHT] = ocp.args.StandardSave(list(in_flight))
        self._manager.save(step, args=ocp.args.Composite(**items))

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
        return (restored, (out[REFERENCE] if reference is not None else None), dict(out[META]),
                (list(out[IN_FLIGHT]) if in_flight else None))

    def restore_meta(self, step: int) -> dict:
        """The `meta` item of a saved step alone (no arrays read)."""
        out = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        return dict(out[META])

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

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def read_meta(files: RunFiles) -> dict:
    """The `meta` item of the step `files` names (no arrays read)."""
    with ocp.CheckpointManager(files.checkpoints) as manager:
        return dict(manager.restore(files.step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META])


def local_base(files: RunFiles) -> str | None:
    """A LoRA run's base as a local HF directory (RUN_DIR/base, or `model.path` when it is one),
    from the step's metadata (its fingerprint checked), else None (a .gguf file, a remote copy)."""
    saved = read_meta(files)["base"]
    directory = lora_base.locate(saved, files.run_dir)
    if saved["path"] == lora_base.BASE_DIR or Path(saved["path"]).resolve() == Path(directory).resolve():
        return str(Path(directory).resolve())
    return None


def _lora_policy(files: RunFiles, lora: dict, *, dtype, param_dtype):
    """A LoRA run's policy at one saved step: its base (from where the step's metadata says, its
    fingerprint checked: `grpo_jax.trainer.lora_base`) with the step's adapters."""
    model = from_pretrained(lora_base.locate(read_meta(files)["base"], files.run_dir), dtype=dtype,
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


def save_step(checkpointer: Checkpointer, step: int, state: TrainState, *, stream, seed: int,
              reference=None, base: dict | None = None, rewards: Sequence = (),
              source: RolloutSource | None = None) -> None:
    """Checkpoint `step` (collective: every process saves its shards): the state, the KL reference
    and every host's prompt-stream position (`stream.state_dict()`, gathered); a LoRA run's `base`
    record (`grpo_jax.trainer.lora_base.record`) goes into the metadata, and so does the state of every
    reward that keeps one (`fn.state()`: a reward model's running normalisation), per host. A
    pipelined `source` with batches in flight adds their parameters, and the stream and rewards are
    saved as they were before the first of them (a resumed run samples them again)."""
    flight = source.in_flight() if source is not None else None
    position = stream.state_dict() if flight is None else flight.rewind["stream"]
    streams = gather_json(position)  # each host's position in its share
    meta = {"step": step, "seed": seed, "data": streams[0], **({"data_by_process": streams} if len(streams) > 1 else {}),
            **({"base": base} if base is not None else {}), **({"pipeline": flight.meta} if flight else {})}
    held = {spec.name: spec.fn.state() for spec in rewards if isinstance(spec.fn, StatefulReward)}
    if flight is not None:
        held = flight.rewind["rewards"]
    if held:
        meta["rewards_by_process"] = gather_json(held)
    checkpointer.save(step, state, meta, reference=reference, in_flight=flight.params if flight else None)


def checkpoint_hook(checkpointer: Checkpointer, signals, *, learner, prepared, base: dict | None,
                    synced: Callable[[], None], source: RolloutSource | None = None) -> Callable[..., bool]:
    """The loop's checkpoint hook (the function of a `loop.Hook` run every step: a signal is looked
    for at every step, on every host): saves the step (`save_step`, then `synced()`)
    every `checkpoint.every` steps, at the last step, and when `signals.check(step)` (a
    `preemption.StopSignals`, the same on every host) says a stop signal arrived or the clock made a
    checkpoint due. Returns True (stop the run after this step) after a signal."""
    cfg = prepared.config

    def hook(info) -> bool:
        step = info.step
        stop, due = signals.check(step)
        every = cfg.checkpoint.every
        if stop or due or every and step % every == 0 or step == cfg.train.steps:
            save_step(checkpointer, step, learner.unplace(info.state), stream=prepared.train_stream, seed=cfg.train.seed,
                      reference=learner.reference, base=base, rewards=prepared.rewards, source=source)
            synced()
            signals.saved()
        return stop

    return hook


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
           rewards: Sequence = (), source: RolloutSource | None = None):
    """(state, reference) of checkpoint `step`, placed like `state` and `reference`, with this
    host's prompt stream moved to where it was and its rewards' states (`save_step`) restored, and
    a pipelined `source` given its batches in flight. A checkpoint of another number of hosts, or a
    stream with other settings, is a ConfigError."""
    # A pipelined run's batches in flight (a synchronous run never gets here with them: resumable_steps).
    flight = checkpointer.restore_meta(step).get("pipeline") if source is not None else None
    like = source.in_flight_like(len(flight["steps"])) if flight else None
    restored, saved_reference, meta, in_flight = checkpointer.restore(step, state, reference, in_flight=like)
    if flight:
        source.restore(flight, in_flight)
    _load_stream(meta, step, stream)
    saved = (meta.get("rewards_by_process") or [{}] * jax.process_count())[jax.process_index()]
    for spec in rewards:
        if isinstance(spec.fn, StatefulReward) and spec.name in saved:
            spec.fn.load_state(saved[spec.name])
    return restored, (reference if saved_reference is None else saved_reference)
