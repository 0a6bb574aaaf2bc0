"""Run multi-turn episodes: the host's side (grpo_jax.episodes.episode: environments, the trajectory's
environment tokens, limits, errors) driving the engine's slots (grpo_jax.episodes.turns).

The host advances the engine `segment_steps` decode steps at a time. Between segments it
- hands every turn that ended (a paused slot) to its episode, which starts the environment's step
  on its own thread, so a slow tool runs while the other slots keep decoding;
- cuts a turn at the environment's tool-call closing tag (`tool_call_end`) when the model wrote
  one: the slot rewinds to just after the tag and the turn goes to the environment;
- feeds each finished environment answer to its slot as forced tokens, or releases the slot when
  the episode is over (done, a limit, an error), so the next waiting episode takes it.
The G episodes of an example share the prompt's prefill, so their environments must open them
with the same messages; one that does not is dropped as failed (`error`). So is one whose opening
is longer than the largest prompt bucket (`EpisodeLimits.max_prompt_tokens`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from grpo_jax.config import SamplingConfig
from grpo_jax.episodes.episode import FAILURES, Episode, EpisodeLimits
from grpo_jax.episodes.transcript import encode
from grpo_jax.engine.draw import SampleRows
from grpo_jax.engine.sampling import engine_metrics, pad_prompts
from grpo_jax.episodes.host import EpisodeHost
from grpo_jax.episodes.turns import turn_programs
from grpo_jax.engine.engines import engine_of
from grpo_jax.engine.paged import pool_of
from grpo_jax.runtime.sharding import mesh_or_one_device


@dataclasses.dataclass
class EpisodeBatch:
    """The finished episodes (row r = episode j of example i, r = i*G + j) and their trajectories as
    the engine recorded them: tokens, logprobs [R, T] (T = the trajectory capacity), env bool
    [R, T] (environment positions), lengths [R], prompt ids/mask [N, P]; a mixture-of-experts
    model's experts (engine.routing) of every token fed, model and environment tokens alike,
    [R, T, L, Kx], and of the prompts' prefill [N, P, L, Kx] (None for a dense model)."""

    episodes: list[Episode]
    tokens: np.ndarray
    logprobs: np.ndarray
    env: np.ndarray
    lengths: np.ndarray
    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    parks: int = 0  # times an episode left its slot while its environment worked
    experts: np.ndarray | None = None
    prompt_experts: np.ndarray | None = None
    engine: dict = dataclasses.field(default_factory=dict)  # the engine's counts (`engine.paged.STATS`)

    def rows(self, pad_id: int) -> SampleRows:
        """The trajectories as a rollout's rows: tokens (pad past each length), logprobs (0 off the
        loss), `mask` = the loss mask (1 exactly on model-sampled tokens of every turn), `lengths`
        (the whole trajectory), `truncated` (a limit ended the episode), the experts (0 past each
        length: a turn cut at a tool call leaves what was fed past the cut there) and each row's
        prompt's experts."""
        live = np.arange(self.tokens.shape[1])[None] < self.lengths[:, None]
        loss = live & ~self.env
        routing = {}
        if self.experts is not None:
            G = len(self.episodes) // len(self.prompt_ids)
            routing = {"experts": np.where(live[..., None, None], self.experts, 0).astype(self.experts.dtype),
                       "prompt_experts": np.repeat(self.prompt_experts, G, axis=0)}
        return SampleRows(tokens=np.where(live, self.tokens, pad_id).astype(np.int32),
                          logprobs=np.where(loss, self.logprobs, 0.0).astype(np.float32),
                          mask=loss.astype(np.int32), lengths=self.lengths.astype(np.int32),
                          truncated=np.array([ep.truncated for ep in self.episodes], bool), **routing)

    @property
    def failed(self) -> np.ndarray:
        """bool [R]: an environment error ended the episode (it is dropped)."""
        return np.array([ep.error is not None for ep in self.episodes])

    def final_turns(self) -> list[str]:
        """Each episode's last model turn (what the run's `rewards` score)."""
        return [ep.transcript[-1]["model"] if ep.transcript else "" for ep in self.episodes]

    def metrics(self) -> dict[str, float]:
        """env/turns_mean, env/tool_calls_mean, env/failed (episodes dropped; `env/errors` is the same
        count under its round-3 name) and env/failed/<reason> (by `Episode.failure`, every reason of
        `episode.FAILURES`), env/time_s (environment
        seconds, summed over episodes), completion/model_tokens_mean, completion/env_tokens_mean,
        env/template_fallbacks (episodes), env/parks (episodes moved out of their slot while their
        environment worked, counted per move), and the engine's `engine/preemptions` and
        `engine/pages_used_frac` (`engine.sampling.engine_metrics`)."""
        eps = self.episodes
        return {"env/turns_mean": float(np.mean([ep.turns for ep in eps])),
                "env/tool_calls_mean": float(np.mean([ep.tool_calls for ep in eps])),
                "env/failed": (failed := float(sum(ep.error is not None for ep in eps))),
                "env/errors": failed,
                **{f"env/failed/{why}": float(sum(ep.failure == why for ep in eps)) for why in FAILURES},
                "env/time_s": float(sum(ep.env_seconds for ep in eps)),
                "completion/model_tokens_mean": float(np.mean([ep.model_tokens for ep in eps])),
                "completion/env_tokens_mean": float(np.mean([ep.env_tokens for ep in eps])),
                # Episodes whose chat template broke the extension property at some turn (the
                # new messages were rendered alone: grpo_jax.episodes.transcript).
                "env/template_fallbacks": float(sum(not ep.exact for ep in eps)),
                "env/parks": float(self.parks), **engine_metrics(self.engine)}


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
    mesh: Any = None  # the engine's slots split over its row shards (one host)

    def run(self, model, examples, sampling: SamplingConfig, rng: jax.Array, padding: int = 0) -> EpisodeBatch:
        """`padding`: the last examples only fill the batch's shape (see `run_episodes`)."""
        rows = [{**ex.fields, "prompt": _user_text(ex)} for ex in examples]
        return run_episodes(model, rows, self.tokenizer, self.make_env, sampling, self.limits, rng,
                            segment_steps=self.segment_steps, name=self.name, padding=padding, mesh=self.mesh)


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
                 rng: jax.Array, *, segment_steps: int = 16, name: str = "environment", park: bool = True,
                 padding: int = 0, mesh=None) -> EpisodeBatch:
    """Run `config.group_size` episodes of each example to their end (see the module docstring).
    The model-token budget per episode is `limits.max_model_tokens` (it replaces
    `config.max_new_tokens`). `park`: an episode whose environment is still working one segment
    after its turn ended leaves its slot while other episodes wait for one (`turns.move_slots`);
    the trajectories are the same either way. `padding`: the last examples only fill a fixed shape;
    their episodes are failed without opening: no environment call, and their slots are freed at the
    host's first look (at most one segment of decoding). `mesh`: the engine's slots split over its
    row shards (data x fsdp x expert; the model placed on it), on one host."""
    G = config.group_size
    limits = dataclasses.replace(limits, max_prompt_tokens=min(limits.max_prompt_tokens or 1 << 62,
                                                               max(config.prompt_buckets)))
    episodes = [Episode(make_env, ex, tokenizer, limits, name=name) for ex in examples for _ in range(G)]
    for ep in episodes[len(episodes) - padding * G:]:
        ep.fail(ValueError("a padding example (no episode is played)"), "reset", "padding")
    prompts = _open(episodes, G)
    ids, mask = pad_prompts(prompts, config.prompt_buckets, config.pad_id)
    T, U = trajectory_capacity(limits), limits.max_env_tokens
    graphdef, state = nnx.split(model)
    cfg = dataclasses.replace(engine_of(config).settings(config), max_new_tokens=limits.max_model_tokens)
    start, advance, update, move = turn_programs(graphdef, cfg, mesh_or_one_device(mesh, state), T, U)
    st = start(state, ids, mask, rng)
    shards = st.engine.seq.shape[0]
    host = EpisodeHost(episodes, tokenizer, config.stop_token_ids, U, shards=shards, park=park)
    while int(np.asarray(st.engine.done).sum()) < len(episodes):
        st = advance(state, st, segment_steps)
        answers = host.answer(st)
        if answers.quiet and host.waiting_on_environments():
            time.sleep(0.002)  # every busy slot waits for an environment: let its thread run
        if answers.move_args is not None:
            st = move(st, *answers.move_args)
        st = update(st, *answers.update_args)
    out = {k: np.asarray(x).reshape(len(episodes), *x.shape[2:])  # [Z, Rb, ...] -> episode rows
           for k, x in (("tokens", st.engine.tokens), ("logprobs", st.engine.logprobs), ("env", st.env),
                        ("lengths", st.engine.lengths), ("experts", st.engine.experts)) if x is not None}
    if st.engine.prompt_experts is not None:  # [Z, Np, P, L, Kx] -> the prompts' rows [N, P, L, Kx]
        p = np.asarray(st.engine.prompt_experts)
        out["prompt_experts"] = p.reshape(-1, *p.shape[2:])
    for ep in episodes:
        ep.close()
        if not ep.done:  # the engine ended it: the trajectory's capacity
            ep.done = ep.truncated = True
    cache, pool = st.engine.cache, pool_of(st.engine.cache)  # pool 0: one reservation per slot
    engine = {**st.engine.counts, "pool_pages": pool, "shards": shards,
              "pages_held_at_end": int((pool - np.asarray(cache.nfree)).sum()) if pool else 0}
    return EpisodeBatch(episodes=episodes, prompt_ids=ids, prompt_mask=mask, parks=host.parks, engine=engine, **out)


def _open(episodes: list[Episode], G: int) -> list[list[int]]:
    """Open every episode -> each example's prompt ids (its first episode that opened; an example
    whose every episode failed gets a one-token placeholder, and its rows are released at once)."""
    opening = [ep for ep in episodes if ep.error is None]
    for ep in opening:  # every reset side by side, then each waited for
        ep.start_open()
    for ep in opening:
        ep.finish_open()
    prompts = []
    for i in range(0, len(episodes), G):
        group = episodes[i:i + G]
        opened = [ep for ep in group if ep.error is None]
        prompt = opened[0].prompt_ids if opened else [0]
        for ep in opened[1:]:
            if ep.prompt_ids != prompt:
                ep.fail(ValueError("reset opened the episodes of one example with different messages; "
                                   "they share one prefill (put per-episode randomness in step)"), "reset",
                        "malformed")
        prompts.append(prompt)
    return prompts


def worked_episodes(runner: EpisodeRunner, examples, turns: Sequence[str], stop_ids: Sequence[int]) -> list[Episode]:
    """Episodes of `examples` played with scripted model turns, the worked transcripts of a
    supervised warm start: model turn k is `turns[k]` formatted with the row's fields. A turn that
    ends with the environment's `tool_call_end` ends there, as the engine cuts it; any other ends
    with `stop_ids[0]`. The environment answers each turn for real, so the trajectory (`prompt_ids`,
    `ids`, `loss_mask`) is token for token what a sampled episode with these turns would hold.
    An episode whose template fails, whose turn the sampler would have ended earlier (a stop token
    or the tool tag inside it), that hits a limit, or that the environment has not ended after the
    last scripted turn is failed (`error` says why)."""
    rows = [{**ex.fields, "prompt": _user_text(ex)} for ex in examples]
    played = [Episode(runner.make_env, row, runner.tokenizer, runner.limits, name=runner.name) for row in rows]
    for ep in played:  # every episode side by side: each phase's calls are started, then waited for
        ep.start_open()
    live = [(ep, row) for ep, row in zip(played, rows) if ep.finish_open() is not None]
    for template in turns:
        calls = []
        for ep, row in live:
            turn = _worked_turn(runner, ep, row, template, stop_ids)
            call = None if turn is None else ep.add_turn(turn[0], [0.0] * len(turn[0]), stopped=not turn[1])
            if call is not None:
                calls.append((ep, row, call))
        live = [(ep, row) for ep, row, call in calls if ep.respond(call) is not None]
    for ep in played:
        ep.close()
        if ep.error is None and (ep.truncated or not ep.done):
            why = "hit a limit (environment.max_turns, max_env_tokens or sampling.max_new_tokens)" if ep.truncated \
                else f"was not over after the {len(turns)} turns of sft.turns"
            ep.fail(ValueError(f"the worked episode {why}"), "worked turn")
    return played


def _worked_turn(runner: EpisodeRunner, ep: Episode, row: dict, template: str,
                 stop_ids: Sequence[int]) -> tuple[list[int], bool] | None:
    """(the tokens of a worked turn, `template` over `row`; it ends at the tool call's closing tag),
    or None with the episode failed (the template does not fit the row; the sampler would have
    ended the turn earlier)."""
    try:
        text = template.format(**row)
    except (KeyError, IndexError, ValueError) as e:
        return ep.fail(ValueError(f"sft.turns template {template!r}: {type(e).__name__}: {e} "
                                  f"(the row has {sorted(row)})"), "worked turn")
    end = getattr(ep.env, "tool_call_end", None)
    cut = bool(end) and text.endswith(end)
    ids = encode(runner.tokenizer, text) + ([] if cut else [stop_ids[0]])
    if set(ids[:-1]) & set(stop_ids) or (end and end in (text[:-len(end)] if cut else text)):
        return ep.fail(ValueError(f"sft.turns turn {text!r} would end before its end when sampled (a stop "
                                  "token or the tool call's closing tag inside it)"), "worked turn")
    return ids, cut
