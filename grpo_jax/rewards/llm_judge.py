"""`llm_judge`: a generative judge. Any causal model we load reads a prompt built from the question,
the answer and a rubric, writes a verdict (greedy, through our sampler, `batch_size` prompts at a
time), and the verdict's score is parsed from its text.

    rewards:
      - name: llm_judge
        kwargs: {path: DIR_OR_GGUF, rubric: "correct and concise", max_score: 10}

The score is the last match of `pattern` (default "Score: N") divided by `max_score`, so a judge's
0-10 becomes 0-1. A verdict without a score, or with one outside [0, max_score], is None: the sample
is dropped from the loss and counted (`reward/llm_judge/unjudged`), never guessed.

The judge writes with a generation function it is given (`generate`, the actor's
`grpo_jax.engine.sampling.greedy_completions`, handed in by `build_rewards(config, generate=...)`):
rewards/ imports nothing of the actor side.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

# (model, prompt ids, *, max_new_tokens, stop_token_ids, pad_id, batch_size, mesh) -> completion ids
Generate = Callable[..., list[list[int]]]

DEFAULT_TEMPLATE = ("You grade answers. Rubric: {rubric}\n\nQuestion: {question}\nAnswer: {answer}\n\n"
                    "Give a score from 0 to {max_score} and reply exactly 'Score: N'.")
DEFAULT_PATTERN = r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"


def parse_score(text: str, *, pattern: str = DEFAULT_PATTERN, max_score: float = 10.0) -> float | None:
    """The last score `pattern` finds in `text` (case-insensitive; group 1 is the number) divided by
    `max_score`, or None when there is none or it lies outside [0, max_score]."""
    found = re.findall(pattern, text, flags=re.IGNORECASE)
    if not found:
        return None
    last = found[-1][0] if isinstance(found[-1], tuple) else found[-1]
    try:
        value = float(last)
    except ValueError:
        return None
    if not 0.0 <= value <= max_score:
        return None
    return value / max_score


class LLMJudgeReward:
    """The `llm_judge` reward (see the module docstring). path: the judge model (an HF directory or
    a .gguf file, with its tokenizer unless `tokenizer` names another); template: str.format over
    question, answer, rubric and max_score (the question is the prompt's user message); generate: the
greedy generation function the verdicts are written with (see the module docstring)."""

    def __init__(self, *, path: str, rubric: str = "The answer is correct and concise.",
                 template: str = DEFAULT_TEMPLATE, pattern: str = DEFAULT_PATTERN, max_score: float = 10.0,
                 max_new_tokens: int = 16, batch_size: int = 16, max_prompt_tokens: int = 512,
                 chat_template: str = "auto", tokenizer: str | None = None, generate: Generate | None = None):
        from grpo_jax.models import from_pretrained
        from grpo_jax.models.hf import load_tokenizer

        try:
            template.format(question="q", answer="a", rubric="r", max_score=1)
            re.compile(pattern)
        except (KeyError, IndexError, ValueError, re.error) as e:
            raise ValueError(f"llm_judge: template must use only {{question}}, {{answer}}, {{rubric}}, "
                             f"{{max_score}} and pattern must be a regex: {e!r}") from None
        if max_score <= 0 or max_new_tokens < 1 or batch_size < 1:
            raise ValueError("llm_judge: max_score, max_new_tokens and batch_size must be positive")
        if generate is None:
            raise ValueError("llm_judge: no generation function to write verdicts with: build it with "
                             "build_rewards(config, generate=grpo_jax.engine.sampling.greedy_completions) or pass "
                             "generate= yourself")
        if chat_template not in ("auto", "never"):
            raise ValueError(f"llm_judge: chat_template must be 'auto' or 'never', got {chat_template!r}")
        self.model = from_pretrained(path, on_host=True)  # cut onto the run's mesh by `place`
        self.tokenizer = load_tokenizer(tokenizer or path)
        self.use_chat = chat_template == "auto" and bool(getattr(self.tokenizer, "chat_template", None))
        self.rubric, self.template, self.pattern, self.max_score = rubric, template, pattern, float(max_score)
        self.batch_size, self.max_prompt_tokens = int(batch_size), int(max_prompt_tokens)
        self.max_new_tokens, self.generate = int(max_new_tokens), generate
        self.unparsed = 0  # verdicts without a usable score, over the run
        self.last_verdicts: list[str] = []  # the last call's judge outputs (for inspection and tests)
        self.mesh = None

    def place(self, mesh) -> None:
        """Shard the judge on `mesh` by the policy's rules (`rewards.reward_model.place_on`)."""
        from grpo_jax.rewards.reward_model import place_on

        self.mesh = place_on(self.model, mesh)

    def state_dict(self) -> dict:
        """Nothing to keep across a resume: the judge's weights come from its path."""
        return {}

    def load_state_dict(self, state) -> None:
        pass

    def without_updates(self):
        """The judge updates nothing while it scores: itself."""
        return self

    def judge_prompt(self, prompt: str, completion: str, messages=None) -> list[int]:
        """The judge's prompt ids for one sample (the question: the prompt's last user message)."""
        question = prompt
        if messages:
            question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), prompt)
        text = self.template.format(question=question, answer=completion, rubric=self.rubric,
                                    max_score=f"{self.max_score:g}")
        if self.use_chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        ids = list(self.tokenizer.encode(text, add_special_tokens=not self.use_chat))
        return ids[-self.max_prompt_tokens:]

    def verdicts(self, prompt_ids: Sequence[list[int]]) -> list[str]:
        """The judge's greedy outputs for each prompt, `batch_size` prompts per sampler call."""
        if self.mesh is None:
            from grpo_jax.rewards.reward_model import on_default_device

            on_default_device(self.model)
        tok = self.tokenizer
        stops = tuple(self.model.config.eos_token_ids) or ((tok.eos_token_id,) if tok.eos_token_id is not None else ())
        pad = tok.pad_token_id if tok.pad_token_id is not None else (stops[0] if stops else 0)
        completions = self.generate(self.model, prompt_ids, max_new_tokens=self.max_new_tokens, stop_token_ids=stops,
                                    pad_id=pad, batch_size=self.batch_size, mesh=self.mesh)
        return [tok.decode(ids, skip_special_tokens=True) for ids in completions]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], prompt_messages=None,
                 **_fields: Any) -> list[float | None]:
        messages = prompt_messages if prompt_messages is not None else [None] * len(prompts)
        ids = [self.judge_prompt(p, c, m) for p, c, m in zip(prompts, completions, messages)]
        self.last_verdicts = self.verdicts(ids)
        scores = [parse_score(v, pattern=self.pattern, max_score=self.max_score) for v in self.last_verdicts]
        self.unparsed += sum(s is None for s in scores)
        return scores
