"""The `countdown` environment: the countdown game (reach `target` with `numbers` and + - * /) over
several tries. After a wrong answer the environment says why, as the user ("your expression
evaluates to 21, not 24"; "it uses 7, which is not among the numbers"; "no expression found"), and
the model tries again. Reward 1.0 on the try that solves it and the episode ends; 0.0 for each
wrong try, so an episode that never solves it (its turns run out) is worth 0. The scoring is the
`countdown` reward's (grpo_jax.rewards.countdown: exact fractions, no `eval`).
"""

from __future__ import annotations

from collections import Counter

from grpo_jax.rewards.countdown import countdown_reward, evaluate_expression, extract_expression
from grpo_jax.env.protocol import EnvStep, opening_messages


class CountdownFeedback:
    """One episode of the game (see the module docstring). The example needs `numbers` (ints) and
    `target` (an int), as the `countdown` dataset rows have them."""

    def __init__(self, use_all_numbers: bool = False):
        self.use_all_numbers = bool(use_all_numbers)
        self.numbers: list[int] = []
        self.target = 0

    def reset(self, example: dict) -> list[dict]:
        self.numbers, self.target = [int(n) for n in example["numbers"]], int(example["target"])
        return opening_messages(example)

    def step(self, completion: str) -> EnvStep:
        score = countdown_reward([""], [completion], numbers=[self.numbers], target=[self.target],
                                 use_all_numbers=self.use_all_numbers)[0]
        if score is None:
            raise ValueError(f"malformed example: numbers {self.numbers!r}, target {self.target!r}")
        if score == 1.0:
            return EnvStep([], reward=1.0, done=True)
        return EnvStep([{"role": "user", "content": f"Not yet: {self.why(completion)} Try again."}], reward=0.0)

    def why(self, completion: str) -> str:
        """What is wrong with a completion that does not solve the game."""
        expression = extract_expression(completion)
        if expression is None:
            return "no expression found (write it in <answer></answer>)."
        evaluated = evaluate_expression(expression.split("=")[0])
        if evaluated is None:
            left = expression.split("=")[0].strip()
            return f"{left!r} is not an expression of integers with + - * / and parentheses."
        value, used = evaluated
        given, counts = Counter(self.numbers), Counter(used)
        extra = sorted(n for n in counts if counts[n] > given[n])
        if extra:
            return f"it uses {', '.join(map(str, extra))} more often than given (the numbers are {self.numbers})."
        if self.use_all_numbers and counts != given:
            return f"it must use each of {self.numbers} exactly once."
        shown = str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
        return f"it evaluates to {shown}, not {self.target}."
