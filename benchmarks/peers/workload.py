"""The GRPO workload that every peer script runs (benchmarks/configs/peers.yaml), in plain Python.

Imported by trl_step.py and tunix_step.py (each in its own virtualenv), so it depends on nothing
but the standard library: the model shape, the prompts, the reward and the JSON record.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

# Model shape (Llama-style decoder, random init) and the GRPO step.
VOCAB_SIZE = 2048
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 768
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6
MAX_POSITIONS = 256

PROMPTS_PER_STEP = 8
GROUP_SIZE = 8
PROMPT_LEN = 64
COMPLETION_LEN = 128
BETA = 0.04
EPSILON = 0.2
NUM_ITERATIONS = 1
LEARNING_RATE = 1e-6
MAX_GRAD_NORM = 1.0
TEMPERATURE = 1.0
WARMUP_STEPS = 2
TIMED_STEPS = 5

# With the character tokenizer (one token per character, plus <bos>) this template gives prompts
# of exactly 64 tokens for any two 2-digit operands: 1 + 63 characters.
PROMPT_TEMPLATE = "Add both numbers and answer with the sum only: What is {a} + {b}?"


def prompt_texts(step: int, n: int = PROMPTS_PER_STEP) -> list[str]:
    """The `n` prompts of step `step`: the same texts for every system (seeded by the step)."""
    rng = random.Random(1000 + step)
    return [PROMPT_TEMPLATE.format(a=rng.randint(10, 99), b=rng.randint(10, 99)) for _ in range(n)]


def all_prompts(steps: int = WARMUP_STEPS + TIMED_STEPS) -> list[str]:
    """Every prompt of a run, step after step."""
    return [p for s in range(steps) for p in prompt_texts(s)]


def check_prompt_lengths(tokenizer, prompts: list[str]) -> None:
    """Every prompt encodes (with the tokenizer's BOS) to exactly PROMPT_LEN tokens."""
    lengths = {len(tokenizer(p)["input_ids"]) for p in prompts}
    if lengths != {PROMPT_LEN}:
        raise SystemExit(f"prompts must encode to exactly {PROMPT_LEN} tokens, got lengths {sorted(lengths)}")


def digit_share(completion: str) -> float:
    """The reward, identical in every peer: the share of digit characters in the completion."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def record(system: str, version: str, step_s: list[float], sample_s: list[float] | None,
           ref_s: list[float] | None, train_s: list[float] | None, notes: str = "",
           micro_batch_rows: int = PROMPTS_PER_STEP * GROUP_SIZE) -> dict:
    """The JSON record that run.sh tabulates (medians over the timed steps)."""
    def median(xs):
        return None if xs is None else statistics.median(xs)

    step_median = statistics.median(step_s)
    return {
        "system": system,
        "version": version,
        "step_s_median": step_median,
        "sample_s_median": median(sample_s),
        "ref_s_median": median(ref_s),
        "train_s_median": median(train_s),
        "tokens_per_s": PROMPTS_PER_STEP * GROUP_SIZE * COMPLETION_LEN / step_median,
        "steps_timed": len(step_s),
        "step_s": step_s,
        "sample_s": sample_s,
        "ref_s": ref_s,
        "train_s": train_s,
        "notes": notes,
        "workload": {
            "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP_SIZE,
            "prompt_len": PROMPT_LEN,
            "completion_len": COMPLETION_LEN,
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN_SIZE,
            "num_layers": NUM_LAYERS,
            "micro_batch_rows": micro_batch_rows,
        },
    }


def write_record(path: str | Path, rec: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=2) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, list)}, indent=2))


def parse_args(doc: str) -> argparse.Namespace:
    """The command line every peer script takes: the weights directory, the output JSON, the steps."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, type=Path, help="directory written by make_weights.py")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS)
    parser.add_argument("--steps", type=int, default=TIMED_STEPS, help="timed steps")
    rows = PROMPTS_PER_STEP * GROUP_SIZE
    parser.add_argument("--micro-batch-rows", type=int, default=rows,
                        help=f"completions per forward/backward micro-batch of the update, whole groups dividing the "
                             f"{rows} rows (default: all {rows}, one pass); gradients accumulate into one AdamW step")
    args = parser.parse_args()
    if args.micro_batch_rows < GROUP_SIZE or rows % args.micro_batch_rows or args.micro_batch_rows % GROUP_SIZE:
        parser.error(f"--micro-batch-rows must be a multiple of the group size {GROUP_SIZE} dividing {rows}")
    return args
