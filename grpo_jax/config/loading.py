"""YAML to a validated RunConfig: sections map onto the schema's dataclasses (`model:`, `data:`,
`rewards:`, `sampling:`, `grpo:`, `ppo:`, `distill:`, `lora:`, `train:`, `sft:`, `eval:`, `checkpoint:`, `mesh:`,
`distributed:`, `moe:`; the top-level choices `parallelism:`, `algorithm:`, `reward_control:`). An unknown
key fails with the valid keys of its section and the nearest match;
`--set section.key=value` overrides are parsed as YAML scalars and go through the same checks
(`section.key.a.b=value` sets a key inside a mapping setting). A key given twice in one mapping is
refused (PyYAML would keep the last), and so is a file that is not UTF-8.
Imports nothing of JAX, Flax, optax, orbax, transformers or TFDS."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from grpo_jax.config.reward_model import PreferenceDataConfig, RMRunConfig, RMTrainConfig
from grpo_jax.config.algorithm import DistillConfig, GRPOConfig, PPOConfig
from grpo_jax.config.model import LoRAConfig, ModelConfig, MoEConfig
from grpo_jax.config.rollout import (DataConfig, EnvironmentConfig, EvalConfig, RewardConfig, RolloutConfig,
                                     SamplingConfig)
from grpo_jax.config.schema import RunConfig
from grpo_jax.config.training import CheckpointConfig, DistributedConfig, LogConfig, MeshConfig, SFTConfig, TrainConfig

_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "sampling": SamplingConfig, "grpo": GRPOConfig,
    "train": TrainConfig, "sft": SFTConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "log": LogConfig,
    "mesh": MeshConfig, "distributed": DistributedConfig, "ppo": PPOConfig, "distill": DistillConfig,
    "lora": LoRAConfig, "environment": EnvironmentConfig, "rollout": RolloutConfig, "moe": MoEConfig,
}
# A float in exponent notation without a dot (1e-4, 3E+2), which PyYAML leaves a string.
_YAML11_FLOAT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")
_SCALARS = ("parallelism", "algorithm", "reward_control")  # top-level choices, not sections
_TOP_LEVEL = (*_SECTIONS, "rewards", *_SCALARS)


class ConfigError(ValueError):
    """A configuration file or override that cannot become a RunConfig."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is refused: PyYAML keeps
    the last silently, so a setting written twice would be half ignored."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} at line {key_node.start_mark.line + 1}: give each key once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> Python values, duplicate keys refused; a ConfigError naming `where` otherwise."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None


def did_you_mean(name: object, options: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the option nearest to `name`, or "" when none is near: the one
    hint every unknown-name error in the project gives."""
    near = difflib.get_close_matches(str(name), list(options), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def unknown_key(key: str, where: str, valid: Iterable[str]) -> ConfigError:
    """The error for a key that `where` does not have: the nearest valid key and all of them."""
    valid = sorted(valid)
    return ConfigError(f"unknown key {key!r} in {where}{did_you_mean(key, valid)}. Valid keys: {', '.join(valid)}")


def _shown(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a mapping {dict(value)!r} (YAML reads {{...}} as a mapping: quote the text if you meant a string)"
    if isinstance(value, list):
        return f"a list {value!r}"
    return repr(value)


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """`value` checked against the field's annotation (one line naming `where` when it does not
    fit): integers are integers (a whole float such as 2.0 is taken as 2, 1.5 is refused), floats
    are finite numbers, strings are strings, lists are lists of their element type (YAML lists
    become tuples), booleans are true/false, Literal fields one of their choices."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(annotation)):
                return None
            raise ConfigError(f"{where} cannot be null")
        errors = []
        for arg in args:
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where} got {_shown(value)}, which is none of: "
                          + "; ".join(e.removeprefix(f"{where} ") for e in errors))
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
            raise ConfigError(f"{where} must be one of {list(choices)}, got {_shown(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {_shown(value)} (e.g. [{value!r}] for one item)")
        args = typing.get_args(annotation)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else Any
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict, typing.Mapping) or annotation in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping of keys to values, got {_shown(value)}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {_shown(value)}")
        return value
    if annotation is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {_shown(value)}")
        return value
    if annotation is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string; it is the number meant
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {_shown(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {_shown(value)}")
        return value
    return value


def _build(cls: type, values: Any, where: str):
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise unknown_key(str(key), where, fields)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required field
        raise ConfigError(f"{where}: {e}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def config_from_dict(raw: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from nested plain data (a parsed YAML file)."""
    return _from_dict(raw, RunConfig, _SECTIONS, _SCALARS, lists={"rewards": RewardConfig})


def _from_dict(raw: Mapping[str, Any], cls: type, sections: Mapping[str, type], scalars: Sequence[str] = (),
               lists: Mapping[str, type] | None = None):
    """`cls` from nested plain data: each section built by its dataclass, `lists` as tuples of
    their dataclass, `scalars` as they are; anything else is an unknown key."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    lists = lists or {}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("model", "environment") and value is None:
            continue
        if key in sections:
            kwargs[key] = _build(sections[key], value or {}, key)
        elif key in lists:
            if not isinstance(value, list):
                raise ConfigError(f"{key} must be a list of {{name, weight, kwargs}} entries")
            kwargs[key] = tuple(_build(lists[key], v, f"{key}[{i}]") for i, v in enumerate(value))
        elif key in scalars:
            kwargs[key] = value
        else:
            raise unknown_key(str(key), "the config's top level", [*sections, *lists, *scalars])
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], *, sections: Mapping[str, type] = _SECTIONS,
                    top_level: Sequence[str] = _TOP_LEVEL) -> dict[str, Any]:
    """`section.key=value` overrides (values parsed as YAML) applied to a parsed config."""
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        value = parse_yaml(text, f"--set {item!r}") if text else None
        parts = key.strip().split(".")
        if len(parts) == 1:
            if parts[0] not in top_level:
                raise unknown_key(parts[0], "the config's top level", top_level)
            raw[parts[0]] = value
        elif len(parts) == 2 and parts[0] in sections:
            section, name = parts
            valid = {f.name for f in dataclasses.fields(sections[section]) if f.init}
            if name not in valid:
                raise unknown_key(name, section, valid)
            raw.setdefault(section, {})
            raw[section] = dict(raw[section] or {})
            raw[section][name] = value
        else:
            if parts[0] not in sections:
                raise unknown_key(parts[0], "the config's top level", top_level)
            _set_nested(raw, sections, parts, value, key)
    return raw


def _set_nested(raw: dict[str, Any], sections: Mapping[str, type], parts: list[str], value: Any, key: str) -> None:
    """`--set section.field.a.b=v`: into a mapping field (data.builder_kwargs, environment.kwargs, ...)."""
    section, name, *path = parts
    fields = {f.name: f for f in dataclasses.fields(sections[section]) if f.init}
    if name not in fields:
        raise unknown_key(name, section, fields)
    if "Mapping" not in str(fields[name].type):
        raise ConfigError(f"--set {key}: {section}.{name} is not a mapping setting; set it whole "
                          f"({section}.{name}=...)")
    raw[section] = dict(raw.get(section) or {})
    node = raw[section]
    for i, part in enumerate([name, *path[:-1]]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, Mapping):
            raise ConfigError(f"--set {key}: {'.'.join([section, name, *path][:i + 2])} is {child!r}, not a mapping "
                              "to set a key in")
        node[part] = dict(child)
        node = node[part]
    node[path[-1]] = value


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file such as configs/demo_cpu.yaml")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); save it "
                          "as UTF-8") from None
    raw = parse_yaml(text, str(path)) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, data:, ...)")
    return dict(raw)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config file, apply `--set` overrides, validate everything."""
    return config_from_dict(apply_overrides(_read_yaml(path), overrides))


_RM_SECTIONS: dict[str, type] = {"model": ModelConfig, "data": PreferenceDataConfig, "train": RMTrainConfig,
                                 "checkpoint": CheckpointConfig, "mesh": MeshConfig}


def load_rm_config(path: str | Path, overrides: Sequence[str] = ()) -> RMRunConfig:
    """A `grpo-jax train-rm` config file (sections model:, data:, train:, checkpoint:, mesh:) with
    `--set` overrides."""
    raw = apply_overrides(_read_yaml(path), overrides, sections=_RM_SECTIONS, top_level=tuple(_RM_SECTIONS))
    return _from_dict(raw, RMRunConfig, _RM_SECTIONS)


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    """Plain data (lists, not tuples) that `config_from_dict` turns back into the same RunConfig."""

    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        if isinstance(x, (tuple, list)):
            return [plain(v) for v in x]
        if isinstance(x, Mapping):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(config)
