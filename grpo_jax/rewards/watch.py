"""Reward failures made visible during a run (`RewardWatch`, called once per step by the loop).

Each failing function's first message of the step (this host's samples) is logged; one that failed
on every sample of the batch for `max_failure_steps` steps in a row stops the run with its message
(decided from the global counts in the step's metrics, so every host stops together), and so does
a step whose every episode failed (`env/errors`: the environment, not the policy, is broken): the
watch returns the reason, and the loop saves the step and stops with it in one line. Rewards that
take more than half of a step are reported once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from grpo_jax.faults import one_line
from grpo_jax.rewards.combine import RewardSpec


class RewardWatch:
    def __init__(self, specs: Sequence[RewardSpec], *, rows: int, max_failure_steps: int,
                 log: Callable[[str], None]):
        """`rows`: the samples of one step's batch (all hosts)."""
        self.specs, self.rows, self.limit, self.log = list(specs), rows, max_failure_steps, log
        self.streaks: dict[str, int] = {}  # reward name -> steps in a row it failed on every sample
        self.slow_said = False

    def check(self, step: int, metrics: Mapping[str, float], messages: Mapping[str, str],
              env_error: str | None = None) -> str | None:
        """After a step: `metrics` hold `reward/<name>/failures` (global counts), `perf/reward_s` and
        `perf/step_s` (and `env/errors` with episodes); `messages` each failing reward's first error on
        this host, `env_error` the step's first environment error. -> why the run must stop (a reward
        failed on every sample for too many steps in a row; every episode of the step failed, but not
        because a stop signal ended their calls), or None."""
        reward_s, step_s = metrics["perf/reward_s"], metrics["perf/step_s"]
        if reward_s > 0.5 * step_s and not self.slow_said:
            self.slow_said = True
            self.log(f"step {step}: rewards took {reward_s:.1f} s of a {step_s:.1f} s step (perf/reward_s); the "
                     "reward functions, not the model, set the pace")
        for spec in self.specs:
            failed = int(metrics.get(f"reward/{spec.name}/failures", 0))
            message = messages.get(spec.name)
            if failed and message:
                self.log(f"step {step}: reward {spec.name!r} raised on {failed} of {self.rows} samples (scored None, "
                         f"dropped): {one_line(message)}")
            self.streaks[spec.name] = self.streaks.get(spec.name, 0) + 1 if failed >= self.rows else 0
            if self.streaks[spec.name] >= self.limit:
                return (f"reward function {spec.name!r} raised on every sample for {self.limit} steps in a row "
                        f"(train.max_reward_failure_steps); last error: {message or 'on another host'}")
        if metrics.get("env/errors", 0) >= self.rows and metrics.get("env/failed/stopped", 0) < self.rows:
            return f"every episode of step {step} failed; the first: {env_error or 'on another host'}"
        return None
