"""A model and its tokenizer from a config's `model:` section: the tokenizer (a path, a GGUF file or
the character tokenizer, with `model.chat_template`), the architecture of a random model
(`model.architecture`, vocabulary and special ids from the tokenizer), the `Transformer` keywords
the section sets, the base policy itself (loaded or drawn from the seed) and a reward model to
train. The RL trainer (grpo_jax.trainer.prepare), the reward-model trainer and the benchmarks
build their models here."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from grpo_jax import data
from grpo_jax.config import ConfigError, ModelConfig, RMRunConfig, unknown_key
from grpo_jax.models.config import RopeConfig, TransformerConfig
from grpo_jax.models.gguf import is_gguf
from grpo_jax.models.hf import from_pretrained, load_tokenizer
from grpo_jax.models.reward_model import RewardModel, is_sequence_classifier, load_reward_model
from grpo_jax.models.transformer import JNP_DTYPES, Transformer
from grpo_jax.runtime.sharding import init_on_host, place_model
from grpo_jax.runtime.storage import is_remote


def build_tokenizer(cfg: ModelConfig):
    if cfg.tokenizer == "char":
        tokenizer = data.char_tokenizer(add_bos=True)  # a BOS token gives attention a place to rest
    else:
        path = cfg.tokenizer or cfg.path
        if not is_gguf(path) and not is_remote(path) and not Path(path).exists():
            raise FileNotFoundError(f"model.tokenizer: {str(path)!r} does not exist; pass a directory with "
                                    "tokenizer files (tokenizer.json ...) or \"char\"")
        tokenizer = load_tokenizer(path)
    if cfg.chat_template is not None:
        tokenizer.chat_template = chat_template_text(cfg.chat_template)
    return tokenizer


def chat_template_text(value: str) -> str:
    """`model.chat_template`: Jinja text, or the path of a `.jinja` file holding it."""
    if value.endswith(".jinja"):
        if not Path(value).is_file():
            raise FileNotFoundError(f"model.chat_template: {value!r} does not exist")
        return Path(value).read_text()
    if "{{" not in value and "{%" not in value:
        raise ConfigError(f"model.chat_template: {value[:60]!r} is neither Jinja (no {{{{ or {{%) nor a .jinja file")
    return value


def architecture(arch: Mapping[str, Any], tokenizer) -> TransformerConfig:
    """TransformerConfig from `model.architecture`; vocab size and special ids default to the tokenizer's."""
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    values = dict(arch)
    for key in values:
        if key not in fields:
            raise unknown_key(key, "model.architecture", fields)
    if "rope" in values:
        values["rope"] = {kind: RopeConfig(**rope) for kind, rope in values["rope"].items()}
    values.setdefault("vocab_size", len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values.setdefault(name, getattr(tokenizer, name))
    if "layer_types" in values and values["layer_types"] is not None:
        values["layer_types"] = tuple(values["layer_types"])
    try:
        return TransformerConfig(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.architecture: {e}") from None


def model_options(cfg: ModelConfig) -> dict[str, Any]:
    """The `Transformer` keywords the `model:` section sets (dtypes, remat, scan_layers, attention)."""
    return dict(dtype=JNP_DTYPES[cfg.dtype], param_dtype=JNP_DTYPES[cfg.param_dtype], remat=cfg.remat,
                scan_layers=cfg.scan_layers, attention=cfg.attention)


def build_model(cfg: ModelConfig, model_config: TransformerConfig, seed: int, mesh: Mesh | None = None) -> Transformer:
    """The base policy: loaded from `model.path` (with a `mesh`, straight onto it from host memory:
    `from_pretrained`), or initialised from `model.architecture` and the seed (with a `mesh`, drawn
    in host memory, `init_on_host`, for `place_model` to cut onto the mesh). (A LoRA run adds its
    adapters after the warm start: `add_run_adapters`.)"""
    options = model_options(cfg)
    if cfg.path is not None:
        return from_pretrained(cfg.path, **options, mesh=mesh)
    make = lambda: Transformer(model_config, rngs=nnx.Rngs(seed), **options)
    return make() if mesh is None else init_on_host(make)


def build_reward_model(config: RMRunConfig, tokenizer, mesh: Mesh | None = None) -> RewardModel:
    """The model to train: an RM directory as it is, a causal LM's decoder with a fresh score head,
    or a random architecture. With a `mesh`, nothing is built whole on a device: a directory loads
    straight onto the mesh, a fresh model is drawn in host memory (`init_on_host`) and cut onto the
    mesh (`place_model`)."""
    m = config.model
    options = model_options(m)  # dtypes, remat, scan_layers: as the policy takes them
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    on_host = (lambda make: make()) if mesh is None else init_on_host
    if m.path is None:
        model = on_host(lambda: RewardModel(architecture(m.architecture, tokenizer), pad_token_id=pad,
                                            rngs=nnx.Rngs(config.train.seed), **options))
    else:
        if is_sequence_classifier(m.path):
            return load_reward_model(m.path, **options, mesh=mesh)
        causal = from_pretrained(m.path, **options, on_host=mesh is not None)
        model = on_host(lambda: RewardModel(causal.config, pad_token_id=pad, rngs=nnx.Rngs(config.train.seed),
                                            **options))
        state = {k: v for k, v in nnx.to_flat_state(nnx.state(causal, nnx.Param)) if k[0] != "lm_head"}
        nnx.update(model.backbone, nnx.from_flat_state(state))
    if mesh is not None:
        place_model(model, mesh)
    return model
