"""`PromptStream`: source + sampler + formatter -> batches of prompts, checkpointable."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from grpo_jax.data.prompts import PromptFormatter
from grpo_jax.data.sampler import IndexSampler


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: its ids and text, the row's other fields (answer, numbers, target, id, ...,
    passed to reward functions), and the row's index in the source."""

    prompt_ids: list[int]
    prompt_text: str
    fields: dict[str, Any]
    index: int


def example_fields(row: dict[str, Any], formatter: PromptFormatter, prompt) -> dict[str, Any]:
    """What reward functions get beside (prompts, completions): the row's fields the prompt
    template did not read, and `prompt_messages`, the prompt's messages before any chat template
    (a reward model applies its own); the formatter's `answer_field` (data.answer_field) is also
    passed as `answer`."""
    fields = {k: v for k, v in row.items() if k not in formatter.prompt_fields}
    if formatter.answer_field not in (None, "answer"):
        fields["answer"] = row[formatter.answer_field]
    return {**fields, "prompt_messages": prompt.messages}


def first_usable(source: Sequence[dict[str, Any]], formatter: PromptFormatter, n: int) -> tuple[list[Example], int]:
    """The first `n` rows of `source` the formatter accepts, in order, each at most once (fewer
    when the source has fewer usable rows), and how many rows were rejected on the way."""
    examples, rejected = [], 0
    for index in range(len(source)):
        if len(examples) == n:
            break
        row = source[index]
        prompt = formatter.encode(row)
        if prompt is None:
            rejected += 1
            continue
        examples.append(Example(prompt.ids, prompt.text, example_fields(row, formatter, prompt), index))
    return examples, rejected


class PromptStream:
    """Endless batches of formatted prompts read in the sampler's order.

    Rows the formatter rejects are counted and replaced by the next rows, so a few bad rows
    never stop a run; a whole epoch's worth of consecutive rejected rows means the formatter
    can use no row at all, and raises.
    """

    def __init__(self, source: Sequence[dict[str, Any]], sampler: IndexSampler, formatter: PromptFormatter):
        if sampler.num_records != len(source):
            raise ValueError(f"sampler is for {sampler.num_records} records but the source has {len(source)}")
        self.source = source
        self.sampler = sampler
        self.formatter = formatter
        self._rows_read = 0
        self._consecutive_skips = 0

    def next_batch(self, n: int) -> list[Example]:
        """The next n usable examples."""
        batch: list[Example] = []
        while len(batch) < n:
            for index in self.sampler.next(n - len(batch)):
                row = self.source[index]
                self._rows_read += 1
                prompt = self.formatter.encode(row)
                if prompt is None:
                    self._consecutive_skips += 1
                    if self._consecutive_skips >= self.sampler.epoch_size:
                        self._raise_nothing_usable(row)
                    continue
                self._consecutive_skips = 0
                batch.append(Example(prompt.ids, prompt.text, example_fields(row, self.formatter, prompt), index))
        return batch

    def _raise_nothing_usable(self, row: Any) -> None:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise RuntimeError(
            f"no usable prompt in {self._consecutive_skips} consecutive rows (a whole epoch) of "
            f"{self.source!r}; counters {self.stats}; last reason: {self.formatter.last_skip_reason}; "
            f"row fields: {keys}. Check the template's field names, raise max_prompt_tokens, "
            "or use overlong='truncate'"
        )

    @property
    def stats(self) -> dict[str, int]:
        """rows_read, epoch, and the formatter's counters (formatted, skipped_*, truncated)."""
        return {"rows_read": self._rows_read, "epoch": self.sampler.epoch, **self.formatter.stats}

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict(),
            "counters": dict(self.formatter.stats),
            "rows_read": self._rows_read,
            "consecutive_skips": self._consecutive_skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the stream that wrote `state` was (counters included)."""
        self.sampler.load_state_dict(state["sampler"])
        unknown = set(state["counters"]) - set(self.formatter.stats)
        if unknown:
            raise ValueError(f"stream state has unknown counters {sorted(unknown)}")
        self.formatter.stats.update({k: int(v) for k, v in state["counters"].items()})
        self._rows_read = int(state["rows_read"])
        self._consecutive_skips = int(state["consecutive_skips"])
