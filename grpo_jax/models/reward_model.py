"""Reward models: our decoder plus a `score` head, as transformers' `*ForSequenceClassification`.

A Hugging Face sequence-classification checkpoint (any family of `models.config`) is
the decoder's weights under `model.` and a linear head `score.weight` [num_labels, hidden] without
bias. transformers scores a row by the head applied to the final-normed hidden state of its
rightmost token that is not the pad token (`input_ids != pad_token_id`: this handles left and right
padding alike, and also means a row that ends in a real token equal to the pad id is read one token
earlier; we do exactly the same). `load_reward_model` reads such a directory strictly (every tensor
used, every shape checked, as `models.hf`); `save_reward_model` writes one that transformers'
`AutoModelForSequenceClassification` loads with the same scores.

The backbone has no language-model head (a classification checkpoint carries none). Its logical
axes are the decoder's, and the head's are ("embed", None), so `sharding.place_model` shards a
reward model by the same rules as the policy.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.models.config import TransformerConfig
from grpo_jax.models.hf import fill_params, hf_state_dict, model_dir, read_values, write_tensors
from grpo_jax.models.hf_tensors import TensorReader, read_tensor
from grpo_jax.models.hf_config import config_from_hf, config_to_hf
from grpo_jax.models.transformer import Transformer
from grpo_jax.runtime.sharding import RULES

ARCHITECTURES = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
                 "qwen3": "Qwen3ForSequenceClassification", "qwen3_moe": "Qwen3MoeForSequenceClassification",
                 "mixtral": "MixtralForSequenceClassification", "gemma3_text": "Gemma3TextForSequenceClassification"}


class RewardModel(nnx.Module):
    """A decoder (`backbone`, without an LM head) and a linear `score` head [E, num_labels]."""

    def __init__(self, config: TransformerConfig, *, pad_token_id: int, num_labels: int = 1, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32, remat: str = "none", scan_layers: bool = True,
                 attention: str = "auto"):
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        self.config = config
        # Tied: the backbone then holds no lm_head (the head here is `score`); only the embedding is read.
        self.backbone = Transformer(dataclasses.replace(config, tie_word_embeddings=True), rngs=rngs, dtype=dtype,
                                    param_dtype=param_dtype, remat=remat, scan_layers=scan_layers,
                                    attention=attention)
        head = jax.random.normal(rngs.params(), (config.hidden_size, num_labels)) * config.initializer_range
        self.score = nnx.Param(head.astype(param_dtype), logical_axes=("embed", None))
        self.pad_token_id = int(pad_token_id)
        self.num_labels = int(num_labels)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Scores float32 [B, num_labels] of input_ids int [B, T] (attention_mask [B, T], 1 = real;
        default: every token that is not the pad id), read at each row's last non-pad token."""
        return self.scores_and_states(input_ids, attention_mask)[0]

    def scores_and_states(self, input_ids: jax.Array,
                          attention_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(scores as `__call__`, the backbone's final-normed hidden states [B, T, E]: reward-model
        training also predicts tokens from them through the tied embedding, `backbone.logits`)."""
        chex.assert_rank(input_ids, 2)
        if attention_mask is None:
            attention_mask = input_ids != self.pad_token_id
        h_BTE = self.backbone.hidden_states(input_ids, attention_mask=attention_mask)
        h_BE = h_BTE[jnp.arange(input_ids.shape[0]), last_token_index(input_ids, self.pad_token_id)]
        return jnp.einsum("be,eo->bo", h_BE, self.score[...].astype(h_BE.dtype),
                          preferred_element_type=jnp.float32), h_BTE


def last_token_index(input_ids: jax.Array, pad_token_id: int) -> jax.Array:
    """int32 [B]: each row's rightmost position whose token is not `pad_token_id` (0 for an all-pad
    row), as transformers' sequence classifiers pick it."""
    T = input_ids.shape[1]
    return jnp.argmax(jnp.arange(T, dtype=jnp.int32) * (input_ids != pad_token_id), axis=-1).astype(jnp.int32)


def is_sequence_classifier(path: str | os.PathLike) -> bool:
    """Whether a model path (an HF directory, a GGUF file's conversion) holds a
    `*ForSequenceClassification` checkpoint: a reward model, not a causal LM."""
    cfg = model_dir(path) / "config.json"
    return cfg.exists() and _classifies(json.loads(cfg.read_text()))


def _classifies(hf: dict) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures") or [])


def _hf_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.exists():
        raise FileNotFoundError(f"reward model path {str(path)!r} is not a Hugging Face model directory "
                                "(config.json + *.safetensors)")
    return json.loads(cfg_file.read_text())


def load_reward_model(path: str | os.PathLike, dtype=jnp.float32, param_dtype=jnp.float32, remat: str = "none",
                      scan_layers: bool = True, *, attention: str = "auto", mesh: Mesh | None = None,
                      rules: Mapping[str, str | None] = RULES, on_host: bool = False) -> RewardModel:
    """A `*ForSequenceClassification` directory (config.json + safetensors) as a RewardModel; with a
    `mesh`, placed from host memory by `rules`, and with `on_host` kept there, as `from_pretrained`
    does."""
    path = model_dir(path)
    hf = _hf_config(path)
    if not _classifies(hf):
        raise ValueError(f"{path} is not a sequence-classification checkpoint (architectures: "
                         f"{hf.get('architectures') or []}); a reward "
                         "model is a *ForSequenceClassification directory with a score head")
    if hf.get("pad_token_id") is None:
        raise ValueError(f"{path}/config.json has no pad_token_id: transformers' sequence classifiers find each "
                         "row's last token by it; set it to the tokenizer's pad token id")
    config = config_from_hf(hf)
    num_labels = len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))
    reader = TensorReader(path)
    try:
        used: set[str] = set()
        score = read_tensor(reader, "score.weight", (num_labels, config.hidden_size), used)
        backbone_cfg = dataclasses.replace(config, tie_word_embeddings=True)
        values = read_values(reader, backbone_cfg, path, jnp.dtype(param_dtype), consumed=used)
    finally:
        reader.close()
    values = {("backbone", *k): v for k, v in values.items()}
    values[("score",)] = np.ascontiguousarray(score.T).astype(jnp.dtype(param_dtype))
    abstract = nnx.eval_shape(lambda: RewardModel(config, pad_token_id=hf["pad_token_id"], num_labels=num_labels,
                                                  rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                                  remat=remat, scan_layers=scan_layers, attention=attention))
    return fill_params(abstract, values, mesh, rules, on_host=on_host)


def save_reward_model(model: RewardModel, path: str | os.PathLike, *, tokenizer=None) -> Path:
    """Write `model` as an HF `*ForSequenceClassification` directory (and the tokenizer, if given):
    transformers' AutoModelForSequenceClassification loads it with the same scores."""
    path = Path(path)
    tensors = hf_state_dict(model.backbone)  # tied backbone: no lm_head
    tensors["score.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(model.score[...])).T)
    dtype_name = {"float32": "float32", "bfloat16": "bfloat16"}[model.backbone.param_dtype.name]
    config = config_to_hf(model.config, dtype_name=dtype_name)
    labels = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
    config.update(architectures=[ARCHITECTURES[model.config.family]], pad_token_id=model.pad_token_id,
                  num_labels=model.num_labels, id2label=labels, label2id={v: int(k) for k, v in labels.items()})
    write_tensors(path, tensors)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
