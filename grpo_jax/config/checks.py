"""The checks every config section's `__post_init__` shares: the leaf of the config package
(standard library only, no grpo_jax module)."""

from __future__ import annotations


def choice_in(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    """`section.name` must be one of `choices` (a Literal's `typing.get_args`)."""
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {list(choices)}")


def positive(section: str, name: str, value: float) -> None:
    """`section.name` must be > 0."""
    if not value > 0:
        raise ValueError(f"{section}.{name} must be > 0, got {value}")


def non_negative(section: str, name: str, value: float) -> None:
    """`section.name` must be >= 0."""
    if not value >= 0:
        raise ValueError(f"{section}.{name} must be >= 0, got {value}")


def check_micro_batches(rows: int, micro_batches: int, what: str) -> None:
    """The one rule for micro-batching: the rows each device updates on split evenly into
    `train.micro_batches` (checked on the config, on each batch shard before compiling, and on
    every Batch the train step takes)."""
    if rows % micro_batches:
        raise ValueError(f"{what} = {rows} rows do not split into train.micro_batches={micro_batches}")
