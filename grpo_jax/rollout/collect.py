"""One step's samples: sampling rounds with DAPO's dynamic sampling, and what is logged of them.

`collect` is a plain function over a `draw` function (sample and score one round of prompts), so
dynamic sampling is tested without a model. With `dynamic_sampling`, groups whose rewards carry no
signal (`grpo.uniform_groups`) are set aside and fresh prompts drawn, up to `max_resample_rounds`
extra rounds; a batch still short is filled with copies of set-aside groups whose rewards are NaN
(no gradient, not in the loss normaliser), counted in `dynamic/filled_groups`. The batch always
has the same shape, so the train step compiles once.

Reward statistics (`reward_metrics`) describe the first round's samples: the policy as it is,
not the filtered batch. Row i*G + j of every array is sample j of prompt i.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from grpo_jax.engine.draw import SampleRows
from grpo_jax.groups import uniform_groups
from grpo_jax.rewards import RewardResult


@dataclasses.dataclass
class Round:
    """One sampling round of this host's prompts: N_h prompts, N_h x G samples."""

    examples: list  # grpo_jax.data.Example, one per prompt
    rows: SampleRows  # the samples [N_h*G, ...]
    texts: list[str]  # the decoded completions [N_h*G]
    rewards: RewardResult  # total [N_h*G], NaN = the sample was dropped
    sample_s: float = 0.0  # seconds spent sampling
    reward_s: float = 0.0  # seconds spent scoring
    # What the update learns from [N_h*G]: rewards.total, unless a control replaces it
    # (reward_control: random); reward statistics always describe `rewards`.
    scores: np.ndarray | None = None
    # Multi-turn episodes [N_h*G]: each episode's turns ({"model", "env", "reward"}), for samples.jsonl.
    turns: list | None = None
    errors: list | None = None  # multi-turn episodes [N_h*G]: why each failed (Episode.error), None if it did not

    def __post_init__(self):
        if self.scores is None:
            self.scores = self.rewards.total

    @property
    def env_error(self) -> str | None:
        """The round's first environment error (multi-turn episodes), or None."""
        return next((e for e in self.errors or () if e), None)


@dataclasses.dataclass
class Collected:
    """The groups chosen for one step on this host, and how they were found."""

    examples: list  # [N_h]
    rows: SampleRows  # [N_h*G, ...], as in Round.rows
    rewards: np.ndarray  # float32 [N_h*G]: the rounds' scores; NaN for the samples of filler groups
    first: Round  # the first round: what reward statistics and logged samples describe
    stats: dict[str, float]  # this host's dynamic/* counters, sample_tokens, sample_s, reward_s


def collect(draw: Callable[[int], Round], *, num_groups: int, group_size: int, dynamic_sampling: bool = False,
            max_resample_rounds: int = 0, any_short: Callable[[bool], bool] = bool) -> Collected:
    """Draw rounds (`draw(round_index)`) until `num_groups` groups are chosen.

    Without dynamic sampling the first round's groups are the batch. With it, uniform groups are
    set aside and rounds continue while any host is short (`any_short`, a collective decision on
    several hosts: every host must run the same rounds) and at most `max_resample_rounds` extra
    rounds; missing groups are filled with set-aside groups (else chosen ones) with NaN rewards.
    """
    rounds: list[Round] = []
    kept: list[tuple[Round, int]] = []
    spare: list[tuple[Round, int]] = []
    while True:
        rnd = draw(len(rounds))
        rounds.append(rnd)
        uniform = np.asarray(uniform_groups(rnd.scores, group_size))
        for i in range(len(rnd.examples)):
            (spare if dynamic_sampling and uniform[i] else kept).append((rnd, i))
        if (not dynamic_sampling or len(rounds) > max_resample_rounds
                or not any_short(len(kept) < num_groups)):
            break
    return assemble(rounds, kept, spare, num_groups=num_groups, group_size=group_size, first=rounds[0],
                    stats={"dynamic/rounds": float(len(rounds))})


def assemble(rounds: list[Round], kept: list[tuple[Round, int]], spare: list[tuple[Round, int]], *,
             num_groups: int, group_size: int, first: Round, stats: dict[str, float]) -> Collected:
    """The batch of `num_groups` groups: the first kept ones, then copies of set-aside ones (else
    kept ones) with NaN rewards; `stats` gains dynamic/dropped_groups, dynamic/filled_groups and
    the rounds' tokens and seconds."""
    filled = max(0, num_groups - len(kept))
    source = spare or kept
    chosen = [(r, i, True) for r, i in kept[:num_groups]]
    chosen += [(*source[j % len(source)], False) for j in range(filled)]

    def group(r: Round, i: int) -> slice:
        return slice(i * group_size, (i + 1) * group_size)

    rows = SampleRows.concat([r.rows.take(group(r, i)) for r, i, _ in chosen])
    rewards = np.concatenate([r.scores[group(r, i)] if real else np.full(group_size, np.nan)
                              for r, i, real in chosen]).astype(np.float32)
    stats = {"dynamic/dropped_groups": float(len(spare)), "dynamic/filled_groups": float(filled),
             "sample_tokens": float(sum(int(r.rows.lengths.sum()) for r in rounds)),
             "sample_s": sum(r.sample_s for r in rounds), "reward_s": sum(r.reward_s for r in rounds), **stats}
    return Collected(examples=[r.examples[i] for r, i, _ in chosen], rows=rows, rewards=rewards, first=first,
                     stats=stats)


def step_key(rng: jax.Array, step: int, round_index: int) -> jax.Array:
    """The sampler's key for one round of one step: distinct for every (step, round) pair."""
    return jax.random.fold_in(jax.random.fold_in(rng, step), round_index)


def reward_metrics(result: RewardResult, group_size: int) -> dict[str, float]:
    """`reward/*` and `groups/frac_zero_std` of a round's samples (every host's rows put together)."""
    total = result.total
    judged = total[~np.isnan(total)]
    out = {"reward/mean": float(judged.mean()) if judged.size else float("nan"),
           "reward/std": float(judged.std()) if judged.size else float("nan"),
           "groups/frac_zero_std": float(np.asarray(uniform_groups(total, group_size)).mean()),
           "reward/dropped": float(np.isnan(total).sum())}
    out.update(result.metrics())
    out.update({f"reward/{name}/failures": float(n) for name, n in result.failures.items()})
    return out


def sample_records(rnd: Round, group_size: int, count: int) -> list[dict]:
    """The first sample of each of the round's first `count` prompts, with its rewards (samples.jsonl),
    and an episode's turns (and `env_error`, why it failed, when it did)."""
    rows = []
    for r in range(0, min(count * group_size, len(rnd.texts)), group_size):
        rows.append({"prompt": rnd.examples[r // group_size].prompt_text, "completion": rnd.texts[r],
                     "reward": float(rnd.rewards.total[r]),
                     **{f"reward/{k}": float(v[r]) for k, v in rnd.rewards.per_fn.items()},
                     **({"turns": rnd.turns[r]} if rnd.turns is not None else {}),
                     **({"env_error": rnd.errors[r]} if rnd.errors is not None and rnd.errors[r] else {})})
    return rows

