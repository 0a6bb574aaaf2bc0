"""GGUF files (llama.cpp's format) as Hugging Face model directories.

`hf_dir(path)` dequantises a `.gguf` file once into a cached HF-format directory (config.json,
model.safetensors in float32, the tokenizer and chat template from the same file) keyed by the
file's SHA-256, so `from_pretrained`, `load_tokenizer` and a run's `model.path` take a `.gguf`
path like any model directory, and the second load is a plain safetensors read.

The conversion undoes what llama.cpp's converter did to the Hugging Face weights: GGUF stores
linear weights [out, in] as HF does, under its own names (`blk.N.attn_q.weight`, ...); for
llama-family rope it permutes the rows of q and k (interleaved rotary pairs), which is reversed
here; for Gemma it stored every RMSNorm weight plus one (Gemma computes x * (1 + w)), which is
subtracted again. Architectures: `llama` (SmolLM2, Llama 3) and `gemma3` (Gemma 3 text models).
Others fail with a message naming what is supported; quantisation types are whatever the `gguf`
package dequantises.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
_FORMAT = 1  # bump when the conversion changes: cached directories of older conversions are redone

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`).
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's sandwich norms: llama.cpp's names -> HF's (the rest as _LAYER).
_GEMMA3_LAYER = {**_LAYER, "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf")


def cache_root() -> Path:
    """Where converted files go: $GRPO_JAX_CACHE/gguf, else ~/.cache/grpo_jax/gguf."""
    base = os.environ.get("GRPO_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "grpo_jax")
    return Path(base) / "gguf"


def fingerprint(path: str | os.PathLike) -> str:
    """SHA-256 of the file's bytes (a renamed or copied file reuses its conversion)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def hf_dir(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """The cached HF-format directory of GGUF file `path`, converted on first use."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    out = Path(cache) if cache is not None else cache_root()
    out = out / f"{path.stem}-{fingerprint(path)[:16]}-v{_FORMAT}"
    if (out / "complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        convert(path, work)
        (work / "complete").write_text(str(path.resolve()) + "\n")
        try:
            work.rename(out)  # atomic: another process converting the same file may have won
        except OSError:
            if not (out / "complete").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_config(reader) -> dict:
    """config.json for the file's architecture, from its metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    unsupported = sorted(k for k in reader.fields if k.startswith(f"{arch}.rope.scaling"))
    if unsupported:
        raise ValueError(f"GGUF rope scaling ({', '.join(unsupported)}) is not supported yet")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    common = {
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(_field(reader, "tokenizer.ggml.tokens") or []))),
        "tie_word_embeddings": "output.weight" not in names,
        **({"bos_token_id": int(bos)} if bos is not None else {}),
        **({"eos_token_id": int(eos)} if eos is not None else {}),
        **({"pad_token_id": int(pad)} if pad is not None else {}),
        "attention_bias": False, "torch_dtype": "float32",
    }
    if arch == "gemma3":
        # As transformers' GGUF loader reads it: llama.cpp keeps the global rope base and the
        # window; the local base (10,000), the 5:1 sliding pattern and the query scale
        # (1/sqrt(head_dim)) are Gemma 3's fixed values.
        return {**common, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": common["head_dim"],
                "sliding_window": int(_field(reader, f"{arch}.attention.sliding_window")),
                "sliding_window_pattern": 6, "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 1e6)),
                "rope_local_base_freq": 10_000.0, "final_logit_softcapping": None, "attn_logit_softcapping": None}
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "mlp_bias": False, "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary pairs interleaved -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    """Every tensor dequantised to float32 under its HF name and layout."""
    from gguf import quants

    out = {}
    gemma = config["model_type"] == "gemma3_text"
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            name = (_GEMMA3_LAYER if gemma else _LAYER).get(rest)
            name = name and f"model.layers.{layer}.{name}"
        else:
            name = _GLOBAL.get(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":
                raise ValueError("GGUF rope frequency factors (rope_freqs.weight) are not supported yet")
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart in a {config['model_type']} model")
        try:
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name!r} uses quantisation {t.tensor_type.name}, which the gguf package "
                             f"cannot dequantise: {e}") from None
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost first
        if gemma:
            if t.name.endswith("norm.weight"):
                w = w - np.float32(1.0)  # llama.cpp stored 1 + w
        elif name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def convert(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write GGUF file `path` as an HF-format directory `out` (float32 weights, tokenizer)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    path, out = Path(path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(path))
    config = hf_config(reader)
    save_file(hf_tensors(reader, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    tokenizer.save_pretrained(str(out))
    return out
