"""Write the shared random weights and tokenizer that every peer starts from.

    /work/main/.venv/bin/python benchmarks/peers/make_weights.py DIR

DIR gets an HF Llama checkpoint (transformers' LlamaForCausalLM with the workload's shape, torch
seed 0, float32, safetensors) and grpo_jax's character tokenizer with <bos>. Runs in the project's
virtualenv (grpo_jax provides the tokenizer); the peers only load the directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_jax.data import char_tokenizer

    tokenizer = char_tokenizer(add_bos=True, model_max_length=w.MAX_POSITIONS)
    if len(tokenizer) > w.VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens, more than the model's {w.VOCAB_SIZE}")
    w.check_prompt_lengths(tokenizer, w.all_prompts())

    config = LlamaConfig(
        vocab_size=w.VOCAB_SIZE,
        hidden_size=w.HIDDEN_SIZE,
        intermediate_size=w.INTERMEDIATE_SIZE,
        num_hidden_layers=w.NUM_LAYERS,
        num_attention_heads=w.NUM_HEADS,
        num_key_value_heads=w.NUM_KV_HEADS,
        head_dim=w.HEAD_DIM,
        max_position_embeddings=w.MAX_POSITIONS,
        rms_norm_eps=w.RMS_NORM_EPS,
        rope_theta=w.ROPE_THETA,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"tokenizer of {len(tokenizer)} tokens")


if __name__ == "__main__":
    main()
