"""The models a run holds beside its policy: PPO's separate critic (`ppo.critic: model`) and
on-policy distillation's teacher (`distill.teacher`). Both read the policy's token ids, so both
must have its tokenizer and cover its vocabulary: `check_side_model` says so in `prepare`, before
anything is compiled. Both are placed on the run's mesh by the policy's sharding rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config import ConfigError, RunConfig
from grpo_jax.learner.ppo import init_critic
from grpo_jax.models import Transformer, TransformerConfig, from_pretrained, load_config, load_tokenizer
from grpo_jax.models.lora import has_adapters, strip_adapters
from grpo_jax.models.reward_model import is_sequence_classifier, load_reward_model
from grpo_jax.runtime.sharding import placed_shapes

# Text that tells tokenizers apart: digits, spacing, punctuation, non-ASCII and markup.
_PROBE = "Q: 12 + 7 = ?\n  A: 19. <answer>x*y</answer> [tool] {\"a\": 1} café ünïcode ✓ — end"


def check_side_model(path: str, what: str, tokenizer, model_config: TransformerConfig) -> TransformerConfig:
    """The side model's architecture, after checking that it loads, that its vocabulary covers the
    policy's and that its tokenizer encodes as the policy's does; a ConfigError names `what`
    (the config key) and the reason otherwise."""
    try:
        config = load_config(path)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"{what}: {e}") from None
    if config.vocab_size < model_config.vocab_size:
        raise ConfigError(f"{what}: {path} has a vocabulary of {config.vocab_size} tokens, the policy's "
                          f"{model_config.vocab_size}: it must read every token id the policy writes")
    try:
        other = load_tokenizer(path)
    except FileNotFoundError as e:
        raise ConfigError(f"{what}: cannot compare {path}'s tokenizer with the policy's ({e}); the two must share "
                          "one, so save the policy's tokenizer there") from None
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise ConfigError(f"{what}: {path}'s tokenizer is not the policy's ({len(theirs)} vs {len(mine)} tokens; "
                          f"e.g. {differ}): it would score other tokens than the policy wrote")
    a = tokenizer.encode(_PROBE, add_special_tokens=False)
    b = other.encode(_PROBE, add_special_tokens=False)
    if a != b:
        raise ConfigError(f"{what}: {path}'s tokenizer splits text differently from the policy's ({b[:12]} vs "
                          f"{a[:12]} ...) though the vocabularies agree")
    return config


def load_teacher(config: RunConfig, mesh, options: dict[str, Any], *, abstract: bool = False) -> nnx.Module:
    """The distillation teacher (`distill.teacher`, an HF directory or GGUF file) on `mesh`, with
    the policy's `options` (dtypes, remat: `prepare.model_options`). `abstract`: its shapes only
    (its config read, nothing loaded), placed by the rules."""
    if abstract:
        teacher = _abstract(load_config(config.distill.teacher), options)
        graphdef, state = nnx.split(teacher)
        return nnx.merge(graphdef, placed_shapes(state, mesh))
    return from_pretrained(config.distill.teacher, **options, mesh=mesh)


def _abstract(config: TransformerConfig, options: dict[str, Any]) -> nnx.Module:
    """A transformer of `config` as jax.ShapeDtypeStructs: nothing drawn or loaded."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), **options))


def build_critic(config: RunConfig, policy: nnx.Module, mesh, options: dict[str, Any], *,
                 abstract: bool = False) -> tuple[nnx.GraphDef | None, dict]:
    """(the critic model's structure, or None for the head; the critic's parameters) for
    `algorithm: ppo`. `ppo.critic: head`: a zero linear head on the policy's trunk. `model`: a
    transformer with a value head: loaded from `ppo.critic_path` (a reward model's score head
    becomes the value head; a causal LM's head starts at 0) or, unset, a copy of the policy's
    starting weights (a LoRA policy's base) with a zero head; on `mesh`, with the policy's `options`.
    `abstract`: `policy` is an abstract model (`nnx.eval_shape`) and the critic's parameters are
    jax.ShapeDtypeStructs too: a critic_path's config is read, its weights are not."""
    ppo = config.ppo
    head = (lambda hidden: jax.eval_shape(lambda: init_critic(hidden))) if abstract else init_critic
    if ppo.critic == "head":
        return None, head(policy.config.hidden_size)
    path = ppo.critic_path
    if path is None:
        trunk = strip_adapters(policy) if has_adapters(policy) else policy
        graphdef, params = nnx.split(trunk, nnx.Param)
        if not abstract:
            params = jax.tree.map(jnp.copy, params)  # its own buffers: the policy's are donated by each step
        return graphdef, {**head(policy.config.hidden_size), "model": params}
    if abstract:
        critic_config = load_config(path)
        if is_sequence_classifier(path):  # a reward model's backbone: no LM head
            critic_config = dataclasses.replace(critic_config, tie_word_embeddings=True)
        graphdef, params = nnx.split(_abstract(critic_config, options), nnx.Param)
        return graphdef, {**head(critic_config.hidden_size), "model": params}
    if is_sequence_classifier(path):
        rm = load_reward_model(path, **options, mesh=mesh)
        if rm.num_labels != 1:
            raise ConfigError(f"ppo.critic_path: {path} scores {rm.num_labels} labels; a critic's head gives one value")
        graphdef, params = nnx.split(rm.backbone, nnx.Param)
        head = {"w": jnp.asarray(rm.score[...][:, 0], jnp.float32), "b": jnp.zeros((), jnp.float32)}
        return graphdef, {**head, "model": params}
    trunk = from_pretrained(path, **options, mesh=mesh)  # placed by the rules already
    graphdef, params = nnx.split(trunk, nnx.Param)
    return graphdef, {**init_critic(trunk.config.hidden_size), "model": params}
