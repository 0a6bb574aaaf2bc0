"""Decoder-only transformers (Flax NNX) and Hugging Face checkpoint I/O."""

from grpo_jax.models.cache import KVCache
from grpo_jax.models.config import SUPPORTED_FAMILIES, RopeConfig, TransformerConfig
from grpo_jax.models.hf import from_pretrained, hf_state_dict, load_config, load_tokenizer, save_pretrained
from grpo_jax.models.hf_config import UnsupportedModelError, config_from_hf, config_to_hf
from grpo_jax.models.transformer import JNP_DTYPES, Transformer

__all__ = [
    "JNP_DTYPES",
    "KVCache",
    "RopeConfig",
    "SUPPORTED_FAMILIES",
    "Transformer",
    "TransformerConfig",
    "UnsupportedModelError",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "hf_state_dict",
    "load_config",
    "load_tokenizer",
    "save_pretrained",
]
