"""Hugging Face checkpoints: `from_pretrained` and `save_pretrained` for safetensors directories.

Weights are read tensor by tensor (safetensors memory-maps them), checked against the shapes the
config implies, converted to our layout and stacked over layers. Nothing is random-initialised:
a missing tensor, a tensor of the wrong shape, or a tensor we would not use is an error that names
it. HF linear weights are [out, in]; ours put the input axes first and split heads out
([E, H, D] for q, [H, D, E] for o), so conversion is a transpose plus a reshape. The experts of
mixture-of-experts layers (many HF tensors per parameter, in two layouts) are read and written by `hf_moe`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import save_file

from grpo_jax.models import lora
from grpo_jax.models.config import TransformerConfig
from grpo_jax.models.gguf import hf_dir, is_gguf
from grpo_jax.models.hf_config import config_from_hf, config_to_hf
from grpo_jax.models.hf_moe import MOE_PARAMS, expert_tensors, read_experts
from grpo_jax.models.layer_scan import mlp_stack
from grpo_jax.models.hf_tensors import TensorReader, read_tensor
from grpo_jax.models.transformer import Transformer, layer_param_specs
from grpo_jax.runtime.sharding import RULES, host_to_mesh, param_shardings
from grpo_jax.runtime.storage import is_remote, local_copy

# Our per-layer parameter -> (HF name inside `layers.{i}.`, number of leading "input" axes of our
# layout; None for vectors). Gemma's sandwich norms reuse HF names with other meanings, see below.
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", None),
    "q_proj": ("self_attn.q_proj.weight", 1),
    "k_proj": ("self_attn.k_proj.weight", 1),
    "v_proj": ("self_attn.v_proj.weight", 1),
    "o_proj": ("self_attn.o_proj.weight", 2),
    "q_bias": ("self_attn.q_proj.bias", None),
    "k_bias": ("self_attn.k_proj.bias", None),
    "v_bias": ("self_attn.v_proj.bias", None),
    "o_bias": ("self_attn.o_proj.bias", None),
    "q_norm": ("self_attn.q_norm.weight", None),
    "k_norm": ("self_attn.k_norm.weight", None),
    "mlp_norm": ("post_attention_layernorm.weight", None),
    "gate_proj": ("mlp.gate_proj.weight", 1),
    "up_proj": ("mlp.up_proj.weight", 1),
    "down_proj": ("mlp.down_proj.weight", 1),
    "gate_bias": ("mlp.gate_proj.bias", None),
    "up_bias": ("mlp.up_proj.bias", None),
    "down_bias": ("mlp.down_proj.bias", None),
}
# In Gemma, post_attention_layernorm normalises the attention output and the pre-MLP norm has its own name.
_SANDWICH_NAMES = {
    "attn_post_norm": ("post_attention_layernorm.weight", None),
    "mlp_norm": ("pre_feedforward_layernorm.weight", None),
    "mlp_post_norm": ("post_feedforward_layernorm.weight", None),
}
# Non-persistent buffers that old checkpoints sometimes contain.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_PREFIXES = ("model.", "")


def _hf_shape(shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    if n_in is None:
        return (math.prod(shape),)
    return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _to_ours(w: np.ndarray, shape: tuple[int, ...], n_in: int | None) -> np.ndarray:
    return w.reshape(shape) if n_in is None else w.T.reshape(shape)


def _to_hf(w: np.ndarray, n_in: int | None) -> np.ndarray:
    if n_in is None:
        return w.reshape(-1)
    return np.ascontiguousarray(w.reshape(math.prod(w.shape[:n_in]), -1).T)


def _layer_table(config: TransformerConfig) -> dict[str, tuple[tuple[int, ...], str, int | None]]:
    """our per-layer param -> (our shape without L, HF suffix, n_in), for this config; the experts
    of a mixture-of-experts layer, which are many HF tensors each, are `hf_moe`'s."""
    names = dict(_LAYER_NAMES)
    if config.post_norms:
        names.update(_SANDWICH_NAMES)
    return {name: (shape, *names[name]) for name, (shape, _) in layer_param_specs(config).items()
            if name not in MOE_PARAMS}


def _stack_layers(config: TransformerConfig, name: str) -> tuple[int, ...]:
    """The layers (HF indices) a parameter's stack holds, in order: every layer, or in a mixed
    dense/MoE stack its MLP's layers."""
    stack = mlp_stack(config, name)
    return {"layers": tuple(range(config.num_layers)), "experts": config.sparse_layers,
            "dense": config.dense_layers}[stack]


def model_dir(path: str | os.PathLike) -> Path:
    """The local HF directory of a model path: a model directory as it is, or a `.gguf` file's cached
    HF conversion (`models.gguf.hf_dir`); a remote one (`gs://...`) is downloaded into the local
    cache first (`storage.local_copy`)."""
    if is_remote(path):
        path = local_copy(str(path))
    if is_gguf(path):
        return hf_dir(path)
    return Path(path)


def load_config(path: str | os.PathLike) -> TransformerConfig:
    """The TransformerConfig of a model path's config.json (any path `model_dir` takes)."""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) and not Path(path).exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist here; if it is a Hugging Face Hub ID, note that runs read "
            "local files only (nothing is downloaded at run time): fetch it "
            f"where there is network (`hf download {path} --local-dir models/{Path(path).name}`, or "
            f"save_pretrained), copy the directory here and set model.path: models/{Path(path).name}")
    path = model_dir(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a directory; pass a Hugging Face model directory "
            "(config.json + *.safetensors), e.g. one written by save_pretrained"
        )
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json; it is not a Hugging Face model directory")
    return config_from_hf(json.loads(cfg_file.read_text()))


def from_pretrained(path: str | os.PathLike, dtype=jnp.float32, param_dtype=jnp.float32,
                    remat: str = "none", scan_layers: bool = True, *, attention: str = "auto",
                    mesh: Mesh | None = None, rules: Mapping[str, str | None] = RULES,
                    on_host: bool = False) -> Transformer:
    """Load an HF-format directory (config.json + one or sharded safetensors), or a `.gguf` file
    (dequantised once into a cached HF directory, `models.gguf`), into a Transformer (`remat`,
    `scan_layers`, `attention`: see `Transformer`). With a `mesh`, each parameter goes from host memory straight
    to its shards by `rules` (`sharding.host_to_mesh`); with `on_host`, the parameters stay NumPy
    arrays in host memory (for a model placed later: `sharding.place_model` cuts them there);
    otherwise onto the default device."""
    path = model_dir(path)
    config = load_config(path)
    reader = TensorReader(path)
    try:
        values = read_values(reader, config, path, jnp.dtype(param_dtype))
    finally:
        reader.close()
    abstract = nnx.eval_shape(
        lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, remat=remat,
                            scan_layers=scan_layers, attention=attention))
    return fill_params(abstract, values, mesh, rules, on_host=on_host)


def fill_params(abstract: nnx.Module, values: dict[tuple, np.ndarray], mesh: Mesh | None = None,
                rules: Mapping[str, str | None] = RULES, *, on_host: bool = False) -> nnx.Module:
    """`abstract` (from nnx.eval_shape) with its parameters set from `values`, keyed by NNX state
    path; the two must name the same parameters with the same shapes. With a `mesh`, each is placed
    by `rules` from the host (`host_to_mesh`), so no device ever holds a parameter it does not shard;
    with `on_host`, each stays the NumPy array it is; otherwise each goes to the default device."""
    if on_host and mesh is not None:
        raise ValueError("on_host and mesh exclude each other: a model is either kept on the host or placed")
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(param_shardings(state, mesh, rules).shardings))
    if set(flat) != set(values):
        raise AssertionError(f"loader and model disagree on parameters: {sorted(set(flat) ^ set(values))}")
    for key, var in flat.items():
        if tuple(var.shape) != values[key].shape:
            raise AssertionError(f"{key}: converted shape {values[key].shape} != model shape {var.shape}")
        if on_host:
            var.set_value(values[key])
        elif mesh is None:
            var.set_value(jnp.asarray(values[key]))
        else:
            var.set_value(host_to_mesh(values[key], shardings[key].get_value()))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def read_values(reader: TensorReader, config: TransformerConfig, path: Path, np_dtype,
                consumed: set[str] = frozenset()) -> dict[tuple[str, ...], np.ndarray]:
    """Every parameter of a `Transformer` with `config`, read from `reader` (the checkpoint in
    `path`, named in messages), as a NumPy array of dtype `np_dtype` in our layout (stacked over
    layers), keyed by NNX state path. Strict: a missing, mis-shaped or unused tensor is a
    ValueError that names it. `consumed`: tensors the caller has read itself (a reward model's
    score head), which are not unused."""
    prefix = next((p for p in _PREFIXES if f"{p}embed_tokens.weight" in reader.location), None)
    if prefix is None:
        raise ValueError(f"checkpoint in {path} has no embed_tokens.weight (looked for 'model.embed_tokens.weight')")
    used: set[str] = set(consumed)
    E, V = config.hidden_size, config.vocab_size

    def stacked(name, shape, suffix, n_in):
        # Filled in place: one layer's tensor at a time beside the result, not a list of all layers.
        hf = _hf_shape(shape, n_in)
        layers = _stack_layers(config, name)
        out = np.empty((len(layers), *shape), np_dtype)
        for j, i in enumerate(layers):
            out[j] = _to_ours(read_tensor(reader, f"{prefix}layers.{i}.{suffix}", hf, used), shape, n_in)
        return out

    values = {("layers", name): stacked(name, *spec) for name, spec in _layer_table(config).items()}
    if config.is_moe:
        values.update(read_experts(reader, config, prefix, np_dtype, used))
    embed = read_tensor(reader, f"{prefix}embed_tokens.weight", (V, E), used)
    values[("embed",)] = embed.astype(np_dtype)
    values[("final_norm",)] = read_tensor(reader, f"{prefix}norm.weight", (E,), used).astype(np_dtype)
    if config.tie_word_embeddings:
        if "lm_head.weight" in reader.location:
            head = read_tensor(reader, "lm_head.weight", (V, E), used)
            if not np.array_equal(head, embed):
                raise ValueError("config.json ties word embeddings but lm_head.weight differs from embed_tokens.weight")
    else:
        values[("lm_head",)] = read_tensor(reader, "lm_head.weight", (V, E), used).T.astype(np_dtype)

    unused = sorted(n for n in reader.names() - used if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise ValueError(
            f"checkpoint has {len(unused)} tensors that a {config.family} model with this config does not use, "
            f"e.g. {unused[:5]}; is config.json the one these weights were saved with?"
        )
    return values


def hf_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters under Hugging Face names and layouts (NumPy, storage dtype)."""
    config = model.config
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": np.asarray(jax.device_get(model.embed[...]))}
    layer_arrays = {k: np.asarray(jax.device_get(v)) for k, v in model.layers.arrays().items()}
    for name, (_, suffix, n_in) in _layer_table(config).items():
        for j, i in enumerate(_stack_layers(config, name)):
            out[f"model.layers.{i}.{suffix}"] = _to_hf(layer_arrays[name][j], n_in)
    for j, i in enumerate(config.sparse_layers):
        out.update((f"model.layers.{i}.{k}", v) for k, v in expert_tensors(config, layer_arrays, j).items())
    out["model.norm.weight"] = np.asarray(jax.device_get(model.final_norm[...]))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(model.lm_head[...])).T)
    return out


def save_pretrained(model: Transformer, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
                    tokenizer=None) -> Path:
    """Write an HF-format directory that transformers' AutoModelForCausalLM loads with the same logits.

    Tensors keep the model's storage dtype; more than `max_shard_bytes` of them are split into
    shards with a `model.safetensors.index.json`, as transformers does. A tokenizer, if given, is
    saved beside the weights. A model with LoRA adapters is written merged (W + (alpha / r) A B).
    """
    path = Path(path)
    write_tensors(path, hf_state_dict(lora.merge_adapters(model) if lora.has_adapters(model) else model),
                  max_shard_bytes=max_shard_bytes)
    dtype_name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[model.param_dtype.name]
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype_name=dtype_name), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def write_tensors(path: Path, tensors: dict[str, np.ndarray], *, max_shard_bytes: int = 5 * 2**30) -> None:
    """`tensors` as `model.safetensors`, or in shards of at most `max_shard_bytes` with a
    `model.safetensors.index.json` as transformers writes them (stale weight files removed)."""
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata=meta)
            weight_map.update({n: fname for n in shard})
        total = sum(t.nbytes for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")


def load_tokenizer(path: str | os.PathLike):
    """transformers' AutoTokenizer for a model directory (no hub access).

    transformers 5 builds an empty tokenizer from config.json alone when no tokenizer files exist;
    that is refused here rather than handed to a trainer.
    """
    from transformers import AutoTokenizer

    path = model_dir(path)
    if not any((path / f).exists() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no usable tokenizer in {path}: none of {list(_TOKENIZER_FILES)} exists; "
            "save one there with tokenizer.save_pretrained(path) or save_pretrained(model, path, tokenizer=...)"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no usable tokenizer in {path}: {e}") from e
