"""Held-out evaluation's bookkeeping (grpo_jax.rollout.evaluation) without a model: episodes that
their environment failed are wrong answers, in the accuracy's denominator and counted apart."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from grpo_jax.config import SamplingConfig
from grpo_jax.rewards import RewardSpec
from grpo_jax.rollout.evaluation import evaluate
from grpo_jax.runtime.sharding import one_device_mesh


class Example:
    def __init__(self, prompt):
        self.prompt_text, self.fields, self.prompt_ids = prompt, {"answer": "4"}, [1]


class Episodes:
    """Plays each prompt's k episodes: "easy" ones answer 4, "hard" ones fail (the policy made the
    environment fail them), "odd" ones answer what the judge cannot read."""

    def __init__(self, k):
        self.k = k

    def run(self, model, part, sampling, rng, padding=0):
        kinds = [ex.prompt_text for ex in part for _ in range(self.k)]
        texts = {"easy": "4", "hard": "", "odd": "?"}
        return types.SimpleNamespace(final_turns=lambda: [texts[kind] for kind in kinds],
                                     failed=np.array([kind == "hard" for kind in kinds]))


def judge(prompts, completions, answer, **_):
    return [None if c == "?" else float(c == a) for c, a in zip(completions, answer)]


@pytest.mark.parametrize("chunk", [64, 3])  # one call, or chunks padded with repeats of a prompt
def test_failed_episodes_are_wrong_answers_and_counted_apart(chunk):
    examples = [Example(p) for p in ("easy", "hard", "easy", "hard", "odd")]
    sampling = SamplingConfig(group_size=2, max_new_tokens=4, prompt_buckets=(8,), pad_token_id=0)
    spec = RewardSpec("acc", judge)
    m = evaluate(None, examples, reward=spec, verifier=spec, sampling=sampling, tokenizer=None,
                 rng=jax.random.key(0), mesh=one_device_mesh(), chunk=chunk, episodes=Episodes(2))
    # 4 correct of 8 answers: the 4 failed ones count as wrong (leaving them out would say 4/4),
    # the 2 the judge could not read are left out.
    assert m["eval/accuracy"] == m["eval/verifier_accuracy"] == 0.5
    assert m["eval/failed"] == 4 and m["eval/unjudged"] == 2 and m["eval/pass@k"] == 0.4
    assert m["eval/reward_mean"] == 1.0 and m["health/verifier_disagreement"] == 0.0


def test_the_gold_judges_mean_score_is_over_the_samples_it_judged():
    """eval/verifier_reward_mean: a gold reward model's mean held-out score, the over-optimisation
    check's gold curve; the training judge's own mean is eval/reward_mean."""
    examples = [Example(p) for p in ("easy", "hard", "easy", "odd")]
    sampling = SamplingConfig(group_size=2, max_new_tokens=4, prompt_buckets=(8,), pad_token_id=0)
    gold = RewardSpec("gold", lambda prompts, completions, answer, **_: [{"4": 0.9, "": 0.2, "?": -0.4}[c]
                                                                        for c in completions])
    m = evaluate(None, examples, reward=RewardSpec("acc", judge), verifier=gold, sampling=sampling, tokenizer=None,
                 rng=jax.random.key(0), mesh=one_device_mesh(), episodes=Episodes(2))
    # 4 "easy" samples score 0.9, 2 "odd" ones -0.4; the 2 failed episodes are not judged
    assert m["eval/verifier_reward_mean"] == pytest.approx((4 * 0.9 - 2 * 0.4) / 6)
    assert m["eval/verifier_accuracy"] == pytest.approx(4 / 8)  # > 0.5 of the judged and the failed
