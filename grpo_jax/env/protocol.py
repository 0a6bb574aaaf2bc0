"""The environment protocol (pinned in DESIGN.md).

    class MyEnv:                                  # one instance per episode: MyEnv(**kwargs)
        def reset(self, example: dict) -> list[dict]: ...   # the chat messages that open the episode
        def step(self, completion: str) -> EnvStep: ...     # called after each model turn

`EnvStep.messages` are what the environment answers (role "tool" or "user"), appended before the
next model turn; `reward` is added to the episode's reward (None: nothing); `done` ends the
episode after this turn. An environment that raises, answers with something that is not an
EnvStep of well-formed messages (text must be valid Unicode: no lone surrogates), or exceeds
`environment.timeout_s` ends its episode, which is dropped and counted (`env/failed`, and by
reason `env/failed/<reason>`); the run goes on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

ENV_ROLES = ("tool", "user")  # who may answer a model turn
OPENING_ROLES = ("system", "user", "assistant", "tool")


class MalformedAnswer(ValueError):
    """An environment's answer that breaks the protocol (its episode fails as `malformed`)."""


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """What an environment returns after a model turn."""

    messages: list[dict[str, Any]]
    reward: float | None = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """Any class with these two methods; the run makes one instance per episode."""

    def reset(self, example: dict) -> list[dict]: ...

    def step(self, completion: str) -> EnvStep: ...


def check_messages(messages: Any, *, roles: tuple[str, ...], who: str) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} dicts with string content and a role in
    `roles`, or MalformedAnswer (a ValueError) naming `who` and what is wrong. The content must be
    text a tokenizer can take: a lone surrogate (`"\\udc80"`, from bytes decoded with
    `errors="surrogateescape"`) is refused here, not in the tokenizer's TypeError."""
    if not isinstance(messages, (list, tuple)):
        raise MalformedAnswer(f"{who} must return a list of messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise MalformedAnswer(f"{who}: message {i} must be a dict with a 'role' and a string 'content', "
                                  f"got {m!r:.200}")
        if m["role"] not in roles:
            raise MalformedAnswer(f"{who}: message {i} has role {m['role']!r}; expected one of {', '.join(roles)}")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:
            raise MalformedAnswer(f"{who}: message {i}'s content is not valid Unicode text ({e.reason} at "
                                  f"character {e.start}: {m['content'][max(0, e.start - 20):e.start + 1]!a})") from None
        out.append(dict(m))
    return out


def check_step(result: Any, *, who: str) -> EnvStep:
    """An environment's `step` result, checked: an EnvStep of well-formed "tool"/"user" messages, a
    finite reward or None, a bool `done`; MalformedAnswer (a ValueError) otherwise."""
    if not isinstance(result, EnvStep):
        raise MalformedAnswer(f"{who}.step must return an EnvStep, got {type(result).__name__}")
    messages = check_messages(result.messages, roles=ENV_ROLES, who=f"{who}.step")
    reward = result.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise MalformedAnswer(f"{who}.step: reward must be a finite number or None, got {reward!r}")
        reward = float(reward)
    if not isinstance(result.done, bool):
        raise MalformedAnswer(f"{who}.step: done must be a bool, got {result.done!r}")
    if not messages and not result.done:
        raise MalformedAnswer(f"{who}.step: an episode that goes on needs at least one message for the next turn")
    return EnvStep(messages=messages, reward=reward, done=result.done)


def opening_messages(example: dict) -> list[dict]:
    """The messages that open an episode of a dataset row: its chat messages when the data has them
    (`prompt_messages`), else one user message with the rendered prompt (`prompt`)."""
    if example.get("prompt_messages"):
        return [dict(m) for m in example["prompt_messages"]]
    if isinstance(example.get("prompt"), str):
        return [{"role": "user", "content": example["prompt"]}]
    raise ValueError(f"the example has neither prompt_messages nor a prompt text: fields {sorted(example)}")
