"""Architecture of the decoder: one frozen config whose switches cover every supported family.

The model code never branches on the family name; it reads the switches below. `family` is kept
only so that `save_pretrained` can write a config.json of the same `model_type`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text"]
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text")

LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")

RopeType = Literal["default", "linear", "llama3"]
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

Activation = Literal["silu", "gelu_pytorch_tanh", "gelu"]
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh", "gelu")


DENSE_MLP = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")
"""A dense MLP's per-layer parameters."""
EXPERT_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")
"""A mixture-of-experts layer's MLP parameters."""


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(choices)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding of one layer type, as Hugging Face's `rope_parameters` describe it."""

    theta: float
    rope_type: RopeType = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _check_choice("rope_type", self.rope_type, ROPE_TYPES)
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.rope_type != "default" and self.factor <= 0:
            raise ValueError(f"rope factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Decoder-only transformer; see `grpo_jax.models.hf` for how HF config.json maps here."""

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Gemma's RMSNorm scales by (1 + w) and stores w around 0.
    norm_plus_one: bool = False
    # Gemma multiplies token embeddings by sqrt(hidden_size).
    scale_embeddings: bool = False
    # Gemma's sandwich norms: a norm on the attention output and on the MLP output.
    post_norms: bool = False
    activation: Activation = "silu"
    # Attention scores are scaled by query_pre_attn_scalar**-0.5 (Gemma), else head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_types: tuple[LayerType, ...] | None = None  # None: every layer is full attention
    sliding_window: int | None = None
    # (layer type, rope) pairs, one per layer type in use; a dict is accepted and stored as pairs so
    # that the config stays hashable (NNX keeps it as static graph data).
    rope: tuple[tuple[str, RopeConfig], ...] = (("full_attention", RopeConfig(theta=10_000.0)),)
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Mixture of experts (Qwen3-MoE; Mixtral is the same with norm_topk_prob): every layer's MLP is `num_experts` experts of width
    # `moe_intermediate_size`, each token sent to its top `num_experts_per_tok` by a linear router
    # (softmax in float32, the top-k weights renormalised to sum 1 when `norm_topk_prob`); the
    # load-balancing loss (Switch Transformer's, as HF computes it) enters the training loss times
    # `router_aux_loss_coef`. 0 experts: the dense MLP of width `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    # A mixed stack (Qwen3-MoE's mlp_only_layers / decoder_sparse_step): the layers whose MLP is
    # the dense one of width `intermediate_size`; the others' are experts. () = every layer sparse.
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.rope, dict):
            object.__setattr__(self, "rope", tuple(sorted(self.rope.items())))
        layer_types = self.layer_types or ("full_attention",) * self.num_layers
        object.__setattr__(self, "layer_types", tuple(layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        _check_choice("model_type", self.family, SUPPORTED_FAMILIES)
        _check_choice("activation", self.activation, ACTIVATIONS)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers={self.num_layers}"
            )
        for t in self.layer_types:
            _check_choice("layer type", t, LAYER_TYPES)
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding_attention layers need a positive sliding_window")
        missing = sorted(set(self.layer_types) - set(dict(self.rope)))
        if missing:
            raise ValueError(f"rope has no parameters for layer types {missing}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                                 f"{self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
            if self.router_aux_loss_coef < 0:
                raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        elif self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        object.__setattr__(self, "dense_layers", tuple(sorted({int(i) for i in self.dense_layers})))
        if self.dense_layers:
            if not self.num_experts:
                raise ValueError("dense_layers names the dense layers of a mixture of experts; this model has no "
                                 "experts (every layer is dense)")
            outside = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
            if outside:
                raise ValueError(f"dense_layers {outside} are not layers of a {self.num_layers}-layer model")
            if len(self.dense_layers) == self.num_layers:
                raise ValueError("dense_layers names every layer: the model has no expert layer (num_experts 0 is "
                                 "the dense model)")
        for cap_name in ("attn_logit_softcap", "final_logit_softcap"):
            cap = getattr(self, cap_name)
            if cap is not None and cap <= 0:
                raise ValueError(f"{cap_name} must be positive or None, got {cap}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mixed(self) -> bool:
        """A mixture of experts with some dense layers (`dense_layers`)."""
        return bool(self.dense_layers)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is experts (none for a dense model)."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers) if self.is_moe else ()

    def layer_is_sparse(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    def mlp_slot(self, layer: int) -> int:
        """Layer `layer`'s index in its MLP's stack: among the sparse layers, or among the dense ones."""
        group = self.sparse_layers if self.layer_is_sparse(layer) else self.dense_layers or range(self.num_layers)
        return list(group).index(layer)

    @property
    def query_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct layer types in a fixed order; layer i uses kinds.index(layer_types[i])."""
        return tuple(t for t in LAYER_TYPES if t in self.layer_types)

    def rope_of(self, kind: str) -> RopeConfig:
        return dict(self.rope)[kind]

    def window_of(self, kind: str) -> int | None:
        return self.sliding_window if kind == "sliding_attention" else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)
