"""How often a reward model ranks the right sum above its near misses, per kind of miss.

    python benchmarks/rm_near_misses.py runs/rm_demo/hf --output benchmarks/results/rm_near_misses.json

Held-out pair accuracy averages over the builder's kinds of wrong answer; a policy's mistakes are
not spread like them. This scores, for `--prompts` random 2-digit sums "a+b=" (a, b in 10..99,
seeded), the right answer against sum - 10, sum + 10, sum - 1 and sum + 1, and reports the share
ranked right for each miss, split by whether the sum carries from the last digit (the warm-started
demo policy's mistakes are mostly slipped carries: off by 10). A reward model that ranks one of
them near chance gets hacked by GRPO toward exactly that answer (README, "A reward model's pair
accuracy is not enough").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

MISSES = (-10, 10, -1, 1)


def near_miss_accuracy(path: str, prompts: int = 400, seed: int = 1) -> dict[str, float]:
    """{"<carry|no carry> <miss>": share of sums whose right answer scored above sum + miss}."""
    from grpo_jax.rewards.reward_model import RewardModelReward

    scorer = RewardModelReward(path=path, batch_size=512)
    rng = np.random.default_rng(seed)
    right: dict[str, list[bool]] = {}
    for a, b in rng.integers(10, 100, (prompts, 2)):
        s = int(a + b)
        scores = np.asarray(scorer([f"{a}+{b}="] * (1 + len(MISSES)), [str(s)] + [str(s + m) for m in MISSES]))
        carry = "carry" if a % 10 + b % 10 >= 10 else "no carry"
        for miss, score in zip(MISSES, scores[1:]):
            right.setdefault(f"{carry} {miss:+d}", []).append(bool(scores[0] > score))
    return {key: float(np.mean(v)) for key, v in sorted(right.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reward_model", help="an HF *ForSequenceClassification directory (train-rm's OUTPUT/hf)")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    result = {"reward_model": args.reward_model, "prompts": args.prompts, "seed": args.seed,
              "ranked_right": near_miss_accuracy(args.reward_model, args.prompts, args.seed)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
