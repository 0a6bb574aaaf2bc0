"""One multi-turn episode on the host: the environment's calls (each under a time limit:
grpo_jax.env.workers), the trajectory they build, and the limits that end it.

The trajectory after the opening prompt is one token sequence: each model turn's tokens as sampled
(`loss_mask` 1, with their sampler log-probs) and, between turns, the environment's tokens
(`loss_mask` 0, log-prob 0) from grpo_jax.episodes.transcript. An environment that raises, returns
something malformed or takes longer than `timeout_s` ends its episode with `error` set: the episode
is dropped (and counted as `env/failed`), its batch-mates are not. A user environment named in the
config runs in a worker process, where a timed-out call is ended with the process
(grpo_jax.usercode.workers); one in the trainer's process holds one of its bounded threads.
So does an opening or an answer the chat template or the tokenizer refuses, and an opening longer
than `max_prompt_tokens`. Each failure has a `failure` reason (FAILURES: `env/failed/<reason>`).

Limits (each ends the episode as truncated): `max_turns` model turns, `max_env_tokens` environment
tokens after one turn, `max_model_tokens` sampled tokens over all turns. Lengths are bounded by
characters before anything is tokenised (`transcript.too_many_tokens`): an 8 MB tool answer is
refused at once, not after seconds of tokenising on the host's thread.
"""

from __future__ import annotations

import dataclasses
import time

from grpo_jax.env import workers
from grpo_jax.env.protocol import OPENING_ROLES, MalformedAnswer, check_messages, check_step
from grpo_jax.episodes.transcript import encode, extension, guard, render, too_many_tokens
from grpo_jax.faults import one_line
from grpo_jax.usercode import Call, CallStopped, CallTimeout, WorkerLost

# Why an episode failed (`Episode.failure`; counted as `env/failed/<reason>`): the environment raised;
# a call ran past its time limit; an answer broke the protocol (not messages, a bad role, text that
# is not valid Unicode, the G episodes of an example opened differently); the chat template or the
# tokenizer refused the conversation (roles that must alternate); the opening is longer than the
# prompt limit; a padding row of an evaluation chunk (no episode played); the run gave up on the call
# because it is stopping (a stop signal: grpo_jax.usercode.CallStopped); the worker process that held
# the episode's environment ended (crashed, or killed with a hung call: grpo_jax.usercode.WorkerLost).
FAILURES = ("raised", "timeout", "malformed", "template", "too_long", "padding", "stopped", "lost")


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_env_tokens: int = 256
    max_model_tokens: int = 256
    timeout_s: float = 30.0
    max_prompt_tokens: int | None = None  # the opening's tokens (run_episodes: the largest prompt bucket)


class Episode:
    """The host's side of one episode (see the module docstring). `make_env()` builds its
    environment; `example`: the dataset row's fields (given to `reset`)."""

    def __init__(self, make_env, example: dict, tokenizer, limits: EpisodeLimits, *, name: str = "environment"):
        self.make_env, self.example, self.tokenizer, self.limits, self.name = make_env, example, tokenizer, limits, name
        self.env = None
        self.tools: list[dict] | None = None
        self.history: list[dict] = []  # the conversation: opening messages, then turns
        self.transcript: list[dict] = []  # per turn: {"model": text, "env": text, "reward": r}
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []  # after the prompt: sampled and environment tokens
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns = self.tool_calls = self.model_tokens = self.env_tokens = 0
        self.env_reward: float | None = None
        self.env_seconds = 0.0
        self.done = self.truncated = False
        self.error: str | None = None
        self.failure: str | None = None  # with `error`: one of FAILURES
        self.exact = True  # every extension was the template's own (no fallback)

    def open(self) -> list[int] | None:
        """Build the environment and render its opening messages -> the prompt's tokens (None: the
        episode failed, see `error`)."""
        self.start_open()
        return self.finish_open()

    def start_open(self) -> None:
        """Start building the environment and its `reset` (episodes open side by side: start
        each, then finish each)."""
        env, self._opening = workers.start_reset(self.make_env, self.example, self._built)
        self.env = env if env is not None else self.env

    def _built(self, env) -> None:
        self.env = env

    def finish_open(self) -> list[int] | None:
        """Wait for `reset` (what is left of `timeout_s`) -> the prompt's tokens (None: failed)."""
        call = self._opening
        try:
            self.history = check_messages(call.result(self.limits.timeout_s), roles=OPENING_ROLES,
                                          who=f"{self.name}.reset")
        except BaseException as e:  # noqa: BLE001
            return self.fail(e, "reset")
        finally:
            self.env_seconds += time.monotonic() - call.started
        # An environment may declare `tools` (JSON schemas): every render describes them.
        self.tools = getattr(self.env, "tools", None) or None
        limit = self.limits.max_prompt_tokens
        if limit is not None and too_many_tokens(self.tokenizer, [m["content"] for m in self.history], limit):
            return self.fail(ValueError(f"the opening's {sum(len(m['content']) for m in self.history)} characters "
                                        f"are more than {limit} tokens"), "reset", "too_long")
        # The opening's assistant messages are the environment's text too (the model's later turns
        # are left as sampled): guarded here once, so every later render reads them as text.
        self.history = guard(self.tokenizer, self.history, assistant=True)
        try:
            self.prompt_ids = encode(self.tokenizer, render(self.tokenizer, guard(self.tokenizer, self.history),
                                                            generation_prompt=True, tools=self.tools))
        except Exception as e:  # noqa: BLE001 - a template or tokenizer that refuses this opening
            return self.fail(e, "reset", "template")
        if limit is not None and len(self.prompt_ids) > limit:
            return self.fail(ValueError(f"the opening has {len(self.prompt_ids)} tokens, more than {limit}"),
                             "reset", "too_long")
        return self.prompt_ids

    def close(self) -> None:
        """The episode is over: its environment's worker forgets it."""
        workers.close(self.env)

    def add_turn(self, ids: list[int], logprobs: list[float], *, stopped: bool) -> Call | None:
        """Record a model turn as sampled (`stopped`: it ended with a stop token, the last of `ids`;
        else at the environment's tool-call end, or cut by the token budget) and start the
        environment's step on it -> the call, or None when the budget ended the episode."""
        self.ids += list(ids)
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.model_tokens += len(ids)
        self.turns += 1
        self._sampled = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        # The message's content: the turn without its stop token when that is a special token the
        # template writes itself (<|im_end|>, <eos>); a stop on plain text (a digit) stays in it.
        marker = stopped and len(ids) > 0 and int(ids[-1]) in set(self.tokenizer.all_special_ids)
        self._content = self.tokenizer.decode(list(ids[:-1]) if marker else list(ids), skip_special_tokens=False)
        if self.model_tokens >= self.limits.max_model_tokens and not stopped:
            self.done = self.truncated = True  # cut mid-turn: nothing for the environment to answer
            self.transcript.append({"model": self._content, "env": "", "reward": None})
            return None
        return workers.start_step(self.env, self._content)

    def respond(self, call: Call) -> list[int] | None:
        """The environment's answer to the last turn as the tokens to feed before the next one (they
        are appended to the trajectory); None when the episode is over (done, a limit, an error)."""
        try:
            step = check_step(call.result(self.limits.timeout_s), who=self.name)
        except BaseException as e:  # noqa: BLE001
            return self.fail(e, "step")
        finally:
            self.env_seconds += time.monotonic() - call.started
        if step.reward is not None:
            self.env_reward = (self.env_reward or 0.0) + step.reward
        self.tool_calls += any(m["role"] == "tool" for m in step.messages)
        turn = {"model": self._content, "env": "", "reward": step.reward}
        self.transcript.append(turn)
        if step.done:
            self.done = True
            return None
        if (self.turns >= self.limits.max_turns or self.model_tokens >= self.limits.max_model_tokens
                or too_many_tokens(self.tokenizer, [m["content"] for m in step.messages], self.limits.max_env_tokens)):
            self.done = self.truncated = True
            return None
        try:
            ext = extension(self.tokenizer, self.history, self._sampled, self._content, step.messages, tools=self.tools)
        except Exception as e:  # noqa: BLE001 - a template or tokenizer that refuses this answer
            return self.fail(e, "step", "template")
        if len(ext.ids) > self.limits.max_env_tokens:
            self.done = self.truncated = True
            return None
        turn["env"] = ext.text
        self.exact &= ext.exact
        self.history += [{"role": "assistant", "content": self._content}, *step.messages]
        self.ids += ext.ids
        self.loss_mask += [0] * len(ext.ids)
        self.logprobs += [0.0] * len(ext.ids)
        self.env_tokens += len(ext.ids)
        return ext.ids

    def fail(self, error: BaseException, where: str, reason: str | None = None) -> None:
        """End the episode as failed (it will be dropped and counted); `reason` (one of FAILURES)
        by default from the error: a timeout, a malformed answer, else the environment raised."""
        self.error = f"{self.name}.{where}: {type(error).__name__}: {one_line(error)}"
        self.failure = reason or ("timeout" if isinstance(error, CallTimeout) else
                                  "malformed" if isinstance(error, MalformedAnswer) else
                                  "stopped" if isinstance(error, CallStopped) else
                                  "lost" if isinstance(error, WorkerLost) else "raised")
        self.done = True
        return None
