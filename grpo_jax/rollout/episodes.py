"""Run multi-turn episodes: the host's side (grpo_jax.rollout.env.episode: environments, the trajectory's
environment tokens, limits, errors) driving the engine's slots (grpo_jax.rollout.turns).

The host advances the engine `segment_steps` decode steps at a time. Between segments it
- hands every turn that ended (a paused slot) to its episode, which starts the environment's step
  on its own thread, so a slow tool runs while the other slots keep decoding;
- cuts a turn at the environment's tool-call closing tag (`tool_call_end`) when the model wrote
  one: the slot rewinds to just after the tag and the turn goes to the environment;
- feeds each finished environment answer to its slot as forced tokens, or releases the slot when
  the episode is over (done, a limit, an error), so the next waiting episode takes it.
The G episodes of an example share the prompt's prefill, so their environments must open them
with the same messages; one that does not is dropped as failed (`error`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from grpo_jax.config import SamplingConfig
from grpo_jax.rollout.env.episode import Episode, EpisodeLimits
from grpo_jax.rollout.sampling import pad_prompts
from grpo_jax.rollout.turns import PAUSED, turn_programs


@dataclasses.dataclass
class EpisodeBatch:
    """The finished episodes (row r = episode j of example i, r = i*G + j) and their trajectories as
    the engine recorded them: tokens, logprobs [R, T] (T = the trajectory capacity), env bool
    [R, T] (environment positions), lengths [R], prompt ids/mask [N, P]."""

    episodes: list[Episode]
    tokens: np.ndarray
    logprobs: np.ndarray
    env: np.ndarray
    lengths: np.ndarray
    prompt_ids: np.ndarray
    prompt_mask: np.ndarray

    def rows(self, pad_id: int) -> dict[str, np.ndarray]:
        """The trajectories as a rollout's rows: tokens (pad past each length), logprobs (0 off the
        loss), `mask` = the loss mask (1 exactly on model-sampled tokens of every turn), `lengths`
        (the whole trajectory), `truncated` (a limit ended the episode), `failed` (an environment
        error: the episode is dropped)."""
        live = np.arange(self.tokens.shape[1])[None] < self.lengths[:, None]
        loss = live & ~self.env
        return {"tokens": np.where(live, self.tokens, pad_id).astype(np.int32),
                "logprobs": np.where(loss, self.logprobs, 0.0).astype(np.float32),
                "mask": loss.astype(np.int32), "lengths": self.lengths.astype(np.int32),
                "truncated": np.array([ep.truncated for ep in self.episodes]),
                "failed": np.array([ep.error is not None for ep in self.episodes])}

    def final_turns(self) -> list[str]:
        """Each episode's last model turn (what the run's `rewards` score)."""
        return [ep.transcript[-1]["model"] if ep.transcript else "" for ep in self.episodes]

    def metrics(self) -> dict[str, float]:
        """env/turns_mean, env/tool_calls_mean, env/errors (episodes), env/time_s (environment
        seconds, summed over episodes), completion/model_tokens_mean, completion/env_tokens_mean,
        env/template_fallbacks (episodes)."""
        eps = self.episodes
        return {"env/turns_mean": float(np.mean([ep.turns for ep in eps])),
                "env/tool_calls_mean": float(np.mean([ep.tool_calls for ep in eps])),
                "env/errors": float(sum(ep.error is not None for ep in eps)),
                "env/time_s": float(sum(ep.env_seconds for ep in eps)),
                "completion/model_tokens_mean": float(np.mean([ep.model_tokens for ep in eps])),
                "completion/env_tokens_mean": float(np.mean([ep.env_tokens for ep in eps])),
                # Episodes whose chat template broke the extension property at some turn (the
                # new messages were rendered alone: grpo_jax.rollout.env.transcript).
                "env/template_fallbacks": float(sum(not ep.exact for ep in eps))}


@dataclasses.dataclass(frozen=True)
class EpisodeRunner:
    """A run's environment (`make_env`, by `name`), limits and tokenizer: `run` plays the episodes
    of data examples (grpo_jax.data's Example: the environment's `reset` gets the row's fields with
    `prompt`, the prompt template's text before any chat template, and `prompt_messages`)."""

    make_env: Any
    limits: EpisodeLimits
    name: str
    tokenizer: Any
    segment_steps: int = 16

    def run(self, model, examples, sampling: SamplingConfig, rng: jax.Array) -> EpisodeBatch:
        rows = [{**ex.fields, "prompt": _user_text(ex)} for ex in examples]
        return run_episodes(model, rows, self.tokenizer, self.make_env, sampling, self.limits, rng,
                            segment_steps=self.segment_steps, name=self.name)


def _user_text(example) -> str:
    """The prompt as the user wrote it: the last message's content when the data has chat messages
    (the prompt text is then the chat template's render), else the prompt text."""
    messages = example.fields.get("prompt_messages")
    return messages[-1]["content"] if messages else example.prompt_text


def trajectory_capacity(limits: EpisodeLimits) -> int:
    """Token positions a trajectory can need: every model token and the environment's answers
    between turns."""
    return limits.max_model_tokens + (limits.max_turns - 1) * limits.max_env_tokens


def run_episodes(model, examples: list[dict], tokenizer, make_env, config: SamplingConfig, limits: EpisodeLimits,
                 rng: jax.Array, *, segment_steps: int = 16, name: str = "environment") -> EpisodeBatch:
    """Run `config.group_size` episodes of each example to their end (see the module docstring).
    The model-token budget per episode is `limits.max_model_tokens` (it replaces
    `config.max_new_tokens`)."""
    G = config.group_size
    episodes = [Episode(make_env, ex, tokenizer, limits, name=name) for ex in examples for _ in range(G)]
    prompts = _open(episodes, G)
    ids, mask = pad_prompts(prompts, config.prompt_buckets, config.pad_id)
    T, E = trajectory_capacity(limits), limits.max_env_tokens
    graphdef, state = nnx.split(model)
    cfg = dataclasses.replace(config, max_new_tokens=limits.max_model_tokens)
    start, advance, update = turn_programs(graphdef, cfg, None, T, E)
    st = start(state, ids, mask, rng)
    host = _Host(episodes, tokenizer, set(config.stop_token_ids), E)
    while int(np.asarray(st["done"]).min()) < len(episodes):
        st = advance(state, st, segment_steps)
        answers = host.answer(st)
        if not any(a.any() for a in (answers[0], answers[2], answers[3] >= 0)) and host.calls:
            time.sleep(0.002)  # every busy slot waits for an environment: let its thread run
        st = update(st, *answers)
    out = {k: np.asarray(st[k])[0] for k in ("tokens", "logprobs", "env", "lengths")}
    for ep in episodes:
        if not ep.done:  # the engine ended it: the trajectory's capacity
            ep.done = ep.truncated = True
    return EpisodeBatch(episodes=episodes, prompt_ids=ids, prompt_mask=mask, **out)


def _open(episodes: list[Episode], G: int) -> list[list[int]]:
    """Open every episode -> each example's prompt ids (its first episode that opened; an example
    whose every episode failed gets a one-token placeholder, and its rows are released at once)."""
    for ep in episodes:
        ep.open()
    prompts = []
    for i in range(0, len(episodes), G):
        group = episodes[i:i + G]
        opened = [ep for ep in group if ep.error is None]
        prompt = opened[0].prompt_ids if opened else [0]
        for ep in opened[1:]:
            if ep.prompt_ids != prompt:
                ep.fail(ValueError("reset opened the episodes of one example with different messages; "
                                   "they share one prefill (put per-episode randomness in step)"), "reset")
        prompts.append(prompt)
    return prompts


class _Host:
    """The host's bookkeeping between segments: per episode, where its current turn starts and the
    environment call in flight."""

    def __init__(self, episodes, tokenizer, stop_ids, env_tokens):
        self.episodes, self.tokenizer, self.stop_ids, self.E = episodes, tokenizer, stop_ids, env_tokens
        self.turn_start = [0] * len(episodes)
        self.calls = {}

    def answer(self, st):
        """The update arrays for `turns.host_update` after a segment."""
        seq, mode, t = (np.array(x)[0] for x in (st["seq"], st["mode"], st["cache"].slot_t))
        tokens = logprobs = None
        J = seq.shape[0]
        release, forced = np.zeros((1, J), bool), np.zeros((1, J, self.E), np.int32)
        n, rewind = np.zeros((1, J), np.int32), np.full((1, J), -1, np.int32)
        for j in np.flatnonzero(seq >= 0):
            r = int(seq[j])
            ep = self.episodes[r]
            if r in self.calls:
                if not self.calls[r].ready(ep.limits.timeout_s):
                    continue
                fed = ep.respond(self.calls.pop(r))
                if fed is None:
                    release[0, j] = True
                else:
                    forced[0, j, :len(fed)], n[0, j] = fed, len(fed)
                    self.turn_start[r] = int(t[j]) + len(fed)
                continue
            if ep.error is not None:
                release[0, j] = True
                continue
            if tokens is None:
                tokens, logprobs = (np.asarray(st[k])[0] for k in ("tokens", "logprobs"))
            end = self._turn_end(r, int(t[j]), mode[j] == PAUSED, tokens[r])
            if end is None:
                continue
            cut = end < t[j]  # at the tool call's closing tag, not at a stop token
            if cut:
                rewind[0, j] = end
            turn = tokens[r, self.turn_start[r]:end]
            call = ep.add_turn(turn.tolist(), logprobs[r, self.turn_start[r]:end].tolist(),
                               stopped=not cut and bool(turn.size) and int(turn[-1]) in self.stop_ids)
            if call is None:
                release[0, j] = True
            else:
                self.calls[r] = call
        return release, forced, n, rewind

    def _turn_end(self, r: int, t: int, paused: bool, tokens) -> int | None:
        """Where episode r's current turn ends: at the environment's tool-call closing tag if the
        model wrote one (the fewest tokens that contain it), else at `t` if the turn ended; None
        while it goes on."""
        tag = getattr(self.episodes[r].env, "tool_call_end", None)
        start = self.turn_start[r]
        if tag:
            text = self.tokenizer.decode(tokens[start:t].tolist(), skip_special_tokens=False)
            if tag in text:
                for k in range(1, t - start + 1):
                    if tag in self.tokenizer.decode(tokens[start:start + k].tolist(), skip_special_tokens=False):
                        return start + k
        return t if paused else None
