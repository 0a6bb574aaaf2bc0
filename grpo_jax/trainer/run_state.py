"""A run's state as types: what a checkpoint's `meta` item holds (`CheckpointMeta`, versioned), the
components whose state it holds (`Stateful`: `state_dict()` / `load_state_dict()`, walked by
`save_components` and `load_components`), and what a run returns (`RunResult`).

The meta's versions:
- 1 (this code): `{"version": 1, "step", "seed", "components": {name: [one state_dict per process]},
  "base", "pipeline"}`; the components are the prompt stream (`data`), the rewards that keep state
  (`rewards`) and a reward model's pair stream (`pairs`).
- 0 (before 2026-12-07, no `version` key): the same facts as `data` (+ `data_by_process` with
  several hosts), `rewards_by_process`, `pairs`; read by `CheckpointMeta.from_json` (tests/trainer/
  legacy_checkpoints holds a run and a reward-model run that code wrote).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax

from grpo_jax.config import ConfigError
from grpo_jax.learner.feed import Stateful
from grpo_jax.runtime.hosts import gather_json


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """The `meta` item of a saved step: the step, the run's seed, each component's state per
    process, a LoRA run's base record (grpo_jax.trainer.lora_base.record) and a pipelined run's
    batches in flight (grpo_jax.rollout.pipeline)."""

    VERSION: ClassVar[int] = 1
    step: int
    seed: int
    components: Mapping[str, tuple[Mapping[str, Any], ...]] = dataclasses.field(default_factory=dict)
    base: Mapping[str, Any] | None = None
    pipeline: Mapping[str, Any] | None = None
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.step, "seed": self.seed,
                "components": {k: list(v) for k, v in self.components.items()},
                **({"base": dict(self.base)} if self.base is not None else {}),
                **({"pipeline": dict(self.pipeline)} if self.pipeline is not None else {})}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CheckpointMeta:
        version = raw.get("version", 0)
        if version > cls.VERSION:
            raise ConfigError(f"checkpoint step {raw.get('step')} has metadata version {version}; this grpo_jax "
                              f"reads up to {cls.VERSION}: resume it with the newer grpo_jax that wrote it")
        if version == 0:  # the keys before typed metadata
            components = {}
            if "data" in raw:
                components["data"] = tuple(raw.get("data_by_process") or [raw["data"]])
            if "rewards_by_process" in raw:
                components["rewards"] = tuple(raw["rewards_by_process"])
            if "pairs" in raw:
                components["pairs"] = (raw["pairs"],)
        else:
            components = {k: tuple(v) for k, v in raw["components"].items()}
        return cls(step=raw["step"], seed=raw["seed"], components=components, base=raw.get("base"),
                   pipeline=raw.get("pipeline"), version=cls.VERSION)


def save_components(components: Mapping[str, Stateful], *, rewind: Mapping[str, Any] | None = None
                    ) -> dict[str, tuple[Mapping[str, Any], ...]]:
    """Every component's `state_dict()`, gathered from every process (a collective: every host
    calls it with the same names). `rewind` replaces some of them with earlier states (a pipelined
    run's, from before its batches in flight were sampled)."""
    states = {name: c.state_dict() for name, c in components.items()}
    states.update(rewind or {})
    return {name: tuple(gather_json(state)) for name, state in states.items()}


def load_components(meta: CheckpointMeta, components: Mapping[str, Stateful], *,
                    required: tuple[str, ...] = ()) -> None:
    """Each component back to this process's saved state. A `required` component the checkpoint
    lacks, a checkpoint of another number of hosts, or a state the component refuses (another
    dataset, another batch size: ValueError) is a ConfigError."""
    for name, component in components.items():
        saved = meta.components.get(name)
        if saved is None:
            if name in required:
                raise ConfigError(f"checkpoint step {meta.step} holds no {name!r} state; resume it with the "
                                  "command that wrote it")
            continue
        if len(saved) != jax.process_count():
            raise ConfigError(f"checkpoint step {meta.step} was written by {len(saved)} processes, this run has "
                              f"{jax.process_count()}; resume with the same number of hosts")
        try:
            component.load_state_dict(saved[jax.process_index()])
        except ValueError as e:
            raise ConfigError(f"cannot resume step {meta.step} with this config: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What `train` (and `train-rm`) return. A finished run: its first and last evaluation, each
    step's mean reward, its plot. A run a stop signal ended (`stopped`: SIGTERM, SIGINT, ...):
    the step whose checkpoint is complete (None: none was saved by this start)."""

    run_dir: str
    stopped: str | None = None
    step: int | None = None
    eval_start: Mapping[str, float] = dataclasses.field(default_factory=dict)
    eval_end: Mapping[str, float] = dataclasses.field(default_factory=dict)
    reward: tuple[float, ...] = ()
    plot: str | None = None
    learner_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v)
                for k, v in dataclasses.asdict(self).items()}
