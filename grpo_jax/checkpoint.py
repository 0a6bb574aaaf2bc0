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
host's position in its prompt stream, as `save_step` wrote them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from grpo_jax.config import ConfigError
from grpo_jax.hosts import gather_json
from grpo_jax.models import Transformer, load_config, load_tokenizer
from grpo_jax.storage import is_remote
from grpo_jax.train_step import TrainState


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

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


@dataclasses.dataclass(frozen=True)
class RunFiles:
    run_dir: Path
    checkpoints: Path
    step: int


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
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"{path} has no step {step}; saved steps: {steps}")
    return RunFiles(run_dir=run_dir, checkpoints=path, step=step)


def restore_params(files: RunFiles, abstract_params):
    """The `params` item of one saved step, shaped like `abstract_params` (arrays or shape structs)."""
    with ocp.CheckpointManager(files.checkpoints) as manager:
        restored = manager.restore(files.step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(abstract_params))))
    return restored.params


def load_policy(checkpoint: str | Path, *, dtype=jnp.float32, param_dtype=jnp.float32):
    """(model, tokenizer, RunFiles) of a saved step: the run's architecture with the step's params,
    computing in `dtype` and stored in `param_dtype` (a run's `model.dtype` / `model.param_dtype`)."""
    files = find_run(checkpoint)
    config = load_config(files.run_dir / "model")
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    params = restore_params(files, params)
    model = nnx.merge(graphdef, params, rest)
    return model, load_tokenizer(files.run_dir / "model"), files


def save_step(checkpointer: Checkpointer, step: int, state: TrainState, *, stream, seed: int,
              reference=None) -> None:
    """Checkpoint `step` (collective: every process saves its shards): the state, the KL reference
    and every host's prompt-stream position (`stream.state_dict()`, gathered)."""
    streams = gather_json(stream.state_dict())  # each host's position in its share
    meta = {"step": step, "seed": seed, "data": streams[0], **({"data_by_process": streams} if len(streams) > 1 else {})}
    checkpointer.save(step, state, meta, reference=reference)


def resume(checkpointer: Checkpointer, step: int, state: TrainState, *, stream, reference=None):
    """(state, reference) of checkpoint `step`, placed like `state` and `reference`, with this
    host's prompt stream moved to where it was. A checkpoint of another number of hosts, or a
    stream with other settings, is a ConfigError."""
    restored, saved_reference, meta = checkpointer.restore(step, state, reference)
    streams = meta.get("data_by_process") or [meta["data"]]
    if len(streams) != jax.process_count():
        raise ConfigError(f"checkpoint step {step} was written by {len(streams)} processes, this run has "
                          f"{jax.process_count()}; resume with the same number of hosts")
    try:
        stream.load_state_dict(streams[jax.process_index()])
    except ValueError as e:
        raise ConfigError(f"cannot resume step {step} with this config: {e}") from None
    return restored, (reference if saved_reference is None else saved_reference)
