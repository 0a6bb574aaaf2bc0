"""Hugging Face config.json <-> TransformerConfig.

Reads both layouts: transformers 4 (`rope_theta`, `rope_scaling`, `rope_local_base_freq`,
`sliding_window_pattern`), which most published checkpoints use, and transformers 5
(`rope_parameters`, nested by layer type for Gemma 3). Defaults for absent keys are those of the
transformers config classes. Writes the transformers 4 layout, which transformers 5 also reads.
"""

from __future__ import annotations

from typing import Any

from grpo_jax.config import ConfigError
from grpo_jax.models.config import SUPPORTED_FAMILIES, RopeConfig, TransformerConfig

# Keys of config.json that change the architecture but that no supported checkpoint needs; a
# config that sets them to a non-default value is refused rather than silently run without them.
_REFUSED = {
    "partial_rotary_factor": (None, 1.0),
    "use_bidirectional_attention": (None, False),
    # Mixtral's router input noise, which transformers applies in training only.
    "router_jitter_noise": (None, 0.0),
}

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


class UnsupportedModelError(ConfigError):
    """config.json describes a model this package does not implement (a ConfigError: the CLI reports
    it as a user error)."""


def _required(d: dict, key: str) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"config.json has no {key!r}; it is required for model_type {d.get('model_type')!r}")
    return d[key]


def _rope_from_dict(params: dict, *, theta: float, max_pos: int) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported rope types: default, linear, llama3"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    kwargs: dict[str, Any] = {"theta": float(params.get("rope_theta", theta)), "rope_type": rope_type}
    if rope_type != "default":
        kwargs["factor"] = float(_required(params, "factor"))
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = float(_required(params, "low_freq_factor"))
        kwargs["high_freq_factor"] = float(_required(params, "high_freq_factor"))
        kwargs["original_max_position_embeddings"] = int(params.get("original_max_position_embeddings", max_pos))
    return RopeConfig(**kwargs)


def _global_rope(d: dict, max_pos: int, default_theta: float = 10_000.0) -> RopeConfig:
    # transformers prefers rope_scaling over rope_parameters when both are present.
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    return _rope_from_dict(params, theta=float(d.get("rope_theta", default_theta)), max_pos=max_pos)


def _gemma3_ropes(d: dict, max_pos: int) -> dict[str, RopeConfig]:
    nested = d.get("rope_parameters") or {}
    if nested and not set(nested) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"Gemma 3 rope_parameters must be nested by layer type, got keys {sorted(nested)}")
    full = dict(nested.get("full_attention") or {"rope_type": "default"})
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    return {
        "full_attention": _rope_from_dict(full, theta=float(d.get("rope_theta", 1_000_000.0)), max_pos=max_pos),
        "sliding_attention": _rope_from_dict(local, theta=float(d.get("rope_local_base_freq", 10_000.0)),
                                             max_pos=max_pos),
    }


def _gemma3_config(d: dict, common: dict, max_pos: int) -> TransformerConfig:
    """Gemma 3's norms, scalings and soft caps, and its pattern of sliding and full attention layers."""
    L = common["num_layers"]
    window = d.get("sliding_window", 4096)
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = int(d.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    return TransformerConfig(
        **common,
        qk_norm=True,
        norm_plus_one=True,
        scale_embeddings=True,
        post_norms=True,
        qkv_bias=bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)),
        activation=d.get("hidden_activation", "gelu_pytorch_tanh"),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        attn_logit_softcap=d.get("attn_logit_softcapping"),
        final_logit_softcap=d.get("final_logit_softcapping"),
        layer_types=tuple(layer_types),
        sliding_window=window,
        rope={k: v for k, v in _gemma3_ropes(d, max_pos).items() if k in layer_types},
    )


def config_from_hf(d: dict) -> TransformerConfig:
    """TransformerConfig from a parsed config.json (either transformers layout)."""
    family = _check_supported(d)
    common, max_pos = _common_fields(d, family)
    if family == "gemma3_text":
        return _gemma3_config(d, common, max_pos)
    return _llama_qwen_config(d, common, max_pos)


def _check_supported(d: dict) -> str:
    """config.json's model_type, once it is a supported family that sets no refused key."""
    family = d.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        hint = " (for Gemma 3, use the text-only Gemma3ForCausalLM checkpoint)" if family == "gemma3" else ""
        raise UnsupportedModelError(
            f"model_type {family!r} is not supported{hint}; supported model types: {', '.join(SUPPORTED_FAMILIES)}"
        )
    for key, allowed in _REFUSED.items():
        if d.get(key) not in allowed:
            raise UnsupportedModelError(f"config.json sets {key}={d[key]!r}, which grpo_jax does not implement")
    return family


def _common_fields(d: dict, family: str) -> tuple[dict, int]:
    """(the TransformerConfig fields every family reads the same way, max_position_embeddings),
    with each family's transformers defaults for absent keys."""
    E = int(_required(d, "hidden_size"))
    H = int(_required(d, "num_attention_heads"))
    L = int(_required(d, "num_hidden_layers"))
    default_head_dim = {"qwen3": 128, "gemma3_text": 256}.get(family, E // H)
    head_dim = int(d.get("head_dim") or default_head_dim)
    max_pos = int(d.get("max_position_embeddings")
                  or {"llama": 2048, "gemma3_text": 131_072, "mixtral": 131_072}.get(family, 32_768))
    common = dict(
        family=family,
        vocab_size=int(_required(d, "vocab_size")),
        hidden_size=E,
        intermediate_size=int(_required(d, "intermediate_size")),
        num_layers=L,
        num_heads=H,
        num_kv_heads=int(d.get("num_key_value_heads") or H),
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5 if family == "mixtral" else 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", family == "gemma3_text")),
        max_position_embeddings=max_pos,
        initializer_range=float(d.get("initializer_range", 0.02)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )
    return common, max_pos


def _llama_qwen_config(d: dict, common: dict, max_pos: int) -> TransformerConfig:
    """Llama, Qwen and Mixtral: one rope for every layer, no norms beyond Qwen3's on q and k."""
    family = common["family"]
    window, layer_types = _sliding_layers(d, family, common["num_layers"])
    attention_bias = bool(d.get("attention_bias", False)) and family != "mixtral"
    rope = _global_rope(d, max_pos, default_theta=1_000_000.0 if family == "mixtral" else 10_000.0)
    return TransformerConfig(
        **common,
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        activation=d.get("hidden_act", "silu"),
        layer_types=layer_types,
        sliding_window=window,
        rope={t: rope for t in set(layer_types)},
        **_moe_fields(d, family, common["num_layers"]),
    )


def _sliding_layers(d: dict, family: str, L: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, layer types), as transformers builds them: with `use_sliding_window`, Qwen2
    and Qwen3 slide from layer `max_window_layers` up and Qwen3-MoE on every layer; Mixtral slides on
    every layer whenever `sliding_window` is set."""
    full = ("full_attention",) * L
    if family == "mixtral":
        window = d.get("sliding_window")
        return (window, ("sliding_attention",) * L) if window else (None, full)
    if family not in ("qwen2", "qwen3", "qwen3_moe") or not d.get("use_sliding_window"):
        return None, full
    window = d.get("sliding_window", 4096)
    if window is None:
        return None, full
    if family == "qwen3_moe":
        return window, ("sliding_attention",) * L
    return window, tuple(d.get("layer_types") or [
        "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention" for i in range(L)])


def _moe_fields(d: dict, family: str, L: int) -> dict[str, Any]:
    """The mixture-of-experts fields of TransformerConfig for Qwen3-MoE and Mixtral (none for dense
    families). A Qwen3-MoE config's dense layers (mlp_only_layers, decoder_sparse_step) are
    `dense_layers`; one with no expert layer at all is refused."""
    if family == "mixtral":
        return dict(num_experts=int(d.get("num_local_experts", 8)),
                    num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(_required(d, "intermediate_size")), norm_topk_prob=True,
                    router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)))
    if family != "qwen3_moe":
        return {}
    # Published checkpoints say num_experts; transformers 5 writes its alias num_local_experts.
    experts = int(d.get("num_experts", d.get("num_local_experts", 128)))
    step, only = int(d.get("decoder_sparse_step", 1)), list(d.get("mlp_only_layers") or [])
    # transformers' rule (Qwen3MoeDecoderLayer): experts where not listed in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0; the other layers keep the dense MLP of intermediate_size.
    dense = [i for i in range(L) if i in only or not (experts > 0 and step > 0 and (i + 1) % step == 0)]
    if len(dense) == L:
        raise UnsupportedModelError(
            f"config.json makes every layer a dense MLP (decoder_sparse_step={step}, mlp_only_layers={only}, "
            f"num_experts={experts}): a Qwen3-MoE with no expert layer; use the dense family (qwen3)")
    return dict(num_experts=experts, num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)), dense_layers=tuple(dense))


def _rope_to_dict(r: RopeConfig) -> dict | None:
    if r.rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": r.rope_type, "factor": r.factor}
    if r.rope_type == "llama3":
        out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                   original_max_position_embeddings=r.original_max_position_embeddings)
    return out


def config_to_hf(cfg: TransformerConfig, *, dtype_name: str) -> dict:
    """config.json contents (transformers 4 layout, also read by transformers 5)."""
    gemma = cfg.family == "gemma3_text"
    d: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": dtype_name,
        "layer_types": list(cfg.layer_types),
    }
    if gemma:
        ropes = dict(cfg.rope)
        full = ropes.get("full_attention")
        local = ropes.get("sliding_attention")
        d.update(
            hidden_activation=cfg.activation,
            attention_bias=cfg.qkv_bias,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            attn_logit_softcapping=cfg.attn_logit_softcap,
            final_logit_softcapping=cfg.final_logit_softcap,
            sliding_window=cfg.sliding_window,
            rope_theta=full.theta if full else 1_000_000.0,
            rope_local_base_freq=local.theta if local else 10_000.0,
            rope_scaling=_rope_to_dict(full) if full else None,
        )
        return d
    rope = cfg.rope_of(cfg.layer_types[0])
    d.update(hidden_act=cfg.activation, rope_theta=rope.theta, rope_scaling=_rope_to_dict(rope))
    if cfg.family == "llama":
        d.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.family in ("qwen3", "qwen3_moe"):
        d.update(attention_bias=cfg.qkv_bias)
    if cfg.family in ("qwen3_moe", "mixtral"):
        d.update(_moe_to_hf(cfg))
    if cfg.family in ("qwen2", "qwen3"):
        sliding = cfg.sliding_window is not None and "sliding_attention" in cfg.layer_types
        d.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window,
                 max_window_layers=cfg.layer_types.index("sliding_attention") if sliding else cfg.num_layers)
    return d


def _moe_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    """config.json's mixture-of-experts keys (and sliding window, on every layer or none) of a
    Qwen3-MoE or Mixtral config, under the names of published checkpoints."""
    sliding = "sliding_attention" in cfg.layer_types
    if sliding and "full_attention" in cfg.layer_types:
        raise ValueError(f"a {cfg.family} config.json slides on every layer or on none; layer_types "
                         f"{list(cfg.layer_types)} mix the two")
    window = cfg.sliding_window if sliding else None
    if cfg.family == "mixtral":
        if cfg.dense_layers:
            raise ValueError(f"Mixtral has no dense layers: dense_layers={list(cfg.dense_layers)} needs family qwen3_moe")
        if not cfg.norm_topk_prob:
            raise ValueError("Mixtral always renormalises its top-k router weights: a mixtral config needs "
                             "norm_topk_prob=True (or family qwen3_moe)")
        return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                    intermediate_size=cfg.moe_intermediate_size, router_aux_loss_coef=cfg.router_aux_loss_coef,
                    sliding_window=window)
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                router_aux_loss_coef=cfg.router_aux_loss_coef, decoder_sparse_step=1,
                mlp_only_layers=list(cfg.dense_layers), use_sliding_window=sliding, sliding_window=window)
