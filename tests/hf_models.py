"""Tiny random Hugging Face models, built with transformers in the test process (no downloads)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

# One entry per case: transformers config class kwargs. Chosen so that every switch of the
# decoder is exercised somewhere: GQA, tied/untied heads, biases, q/k norm, a head_dim that is not
# hidden/heads, llama3 and linear rope scaling, Gemma's sliding window shorter than the sequence,
# query_pre_attn_scalar != head_dim, and final logit soft-capping.
CASES: dict[str, tuple[type, dict]] = {
    "llama": (transformers.LlamaConfig, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
        rope_theta=500_000.0)),
    "llama_tied_bias": (transformers.LlamaConfig, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2": (transformers.Qwen2Config, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0)),
    "qwen3": (transformers.Qwen3Config, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Mixtures of experts: 8 experts, top 2, every layer sparse; Qwen3-MoE without renormalising the
    # top-k weights (norm_topk_prob False, transformers' default), Mixtral with (always) and a
    # sliding window on every layer. randomize_ makes the routers spread tokens over all experts.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=False, rope_theta=1_000_000.0)),
    # A mixed dense/MoE stack (Qwen3-MoE's mlp_only_layers): layer 0 keeps the dense MLP.
    "qwen3_moe_mixed": (transformers.Qwen3MoeConfig, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0], rope_theta=1_000_000.0)),
    "mixtral": (transformers.MixtralConfig, dict(
        vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=5)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=10_000.0, rope_theta=1_000_000.0)),
}


def build_hf_model(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random model whose every weight (norms and biases too) is far from its default init."""
    cls, kwargs = CASES[case]
    config = cls(**kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    return randomize_(model)


def randomize_(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """`model` with every weight redrawn far from its default init (norms around their identity)."""
    gemma = model.config.model_type == "gemma3_text"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if gemma else 1.0))
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    return model


def left_padded_batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (pad = 0) and mask, left-padded to max(lengths)."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids = np.zeros((len(lengths), T), np.int32)
    mask = np.zeros((len(lengths), T), np.int32)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = rng.integers(3, vocab, n)
        mask[b, T - n:] = 1
    return ids, mask


def torch_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits with the positions generate() would use for left padding."""
    ids_t = torch.as_tensor(ids, dtype=torch.long)
    mask_t = torch.as_tensor(mask, dtype=torch.long)
    pos_t = (mask_t.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids_t, attention_mask=mask_t, position_ids=pos_t)
    return out.logits.float().numpy()
