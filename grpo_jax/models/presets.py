"""Small architectures for demos, smoke runs and benchmarks (random weights, no download)."""

from __future__ import annotations

from grpo_jax.models.config import SUPPORTED_FAMILIES, RopeConfig, TransformerConfig


def tiny(family: str = "qwen3", **overrides) -> TransformerConfig:
    """A few-layer model of `family` with every switch of that family turned on."""
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {list(SUPPORTED_FAMILIES)}")
    base = dict(family=family, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        base.update(rope={"full_attention": RopeConfig(theta=500_000.0, rope_type="llama3", factor=8.0,
                                                       original_max_position_embeddings=64)})
    elif family == "qwen2":
        base.update(qkv_bias=True, tie_word_embeddings=True,
                    rope={"full_attention": RopeConfig(theta=1_000_000.0)})
    elif family == "qwen3":
        base.update(qk_norm=True, rope={"full_attention": RopeConfig(theta=1_000_000.0)})
    elif family == "qwen3_moe":
        base.update(qk_norm=True, rope={"full_attention": RopeConfig(theta=1_000_000.0)}, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001)
    elif family == "mixtral":
        # Mixtral's config.json has one MLP width, the experts'.
        base.update(intermediate_size=32, rope={"full_attention": RopeConfig(theta=1_000_000.0)}, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001)
    else:
        base.update(num_layers=3, qk_norm=True, norm_plus_one=True, scale_embeddings=True, post_norms=True,
                    activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, tie_word_embeddings=True,
                    layer_types=("sliding_attention", "sliding_attention", "full_attention"), sliding_window=8,
                    rope={"full_attention": RopeConfig(theta=1_000_000.0),
                          "sliding_attention": RopeConfig(theta=10_000.0)})
    base.update(overrides)
    return TransformerConfig(**base)
