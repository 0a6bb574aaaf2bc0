"""The paged engine driven from the host in segments, for over-sampling: DAPO's
dynamic sampling in one pass instead of resampling rounds.

`EngineStream` prefills a step's candidate prompts once (more than the step needs), then runs the
engine's loop `segment_steps` decode steps at a time (`advance`): the slots keep admitting the
candidates' sequences in order, and after each segment the host reads which groups have finished
(every one of their G sequences stopped), so the caller can score each group as it completes and
stop as soon as it has enough informative groups. What is still in flight then is dropped: one
pass, no second round trip, and candidates never admitted cost only their prefill.

`stream_collect` is that caller for a training step (grpo_jax.rollout.source uses it when
`sampling.engine` is continuous or paged and `train.dynamic_sampling` is set). On a page pool
the candidates' sequences are admitted by free pages and may be preempted and recomputed, as in a
whole call (grpo_jax.engine.paged); a group has finished when all G sequences have.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.engine.draw import SampleRows
from grpo_jax.groups import uniform_groups
from grpo_jax.rewards import RewardResult
from grpo_jax.rollout.collect import Collected, Round, assemble
from grpo_jax.engine.paged import paged_step, pool_of, resume_paged, rollout_experts
from grpo_jax.runtime.sharding import batch_sharding, mesh_or_one_device, replicated
from grpo_jax.engine.engines import engine_of

FIELDS = ("tokens", "logprobs", "lengths", "truncated", "admitted")


@functools.lru_cache(maxsize=16)
def stream_programs(graphdef, config: SamplingConfig, mesh: Mesh):
    """(start, advance, outputs, routing), jitted: start(state, ids [N, P], mask, key) -> the paged
    engine's PagedState; advance(state, PagedState, steps) -> the state after up to `steps` more
    steps (fewer when every sequence is done); outputs(PagedState) -> tokens, logprobs [R, M],
    lengths, truncated, admitted [R] (rows split over the mesh's batch axes) and the useful
    slot-steps; routing(PagedState) -> a mixture-of-experts model's experts [R, M, L, Kx] and each
    row's prompt's experts [R, P, L, Kx] (`Rollout`'s; {} for a dense model)."""

    engine = engine_of(config)
    config = engine.settings(config)

    def start(state, ids, mask, rng):
        return engine.start(nnx.merge(graphdef, state), ids, mask, rng, config=config, mesh=mesh)[1]

    def advance(state, st, steps):
        loop = resume_paged(nnx.merge(graphdef, state), config, mesh, st)
        end = st.counts["steps"] + steps
        return jax.lax.while_loop(lambda s: jnp.any(s.done < loop.lay.sequences) & (s.counts["steps"] < end),
                                  functools.partial(paged_step, loop), st)

    def outputs(st):
        Z, Rb, M = st.tokens.shape
        rows = {"tokens": st.tokens.reshape(Z * Rb, M), "logprobs": st.logprobs.reshape(Z * Rb, M),
                "lengths": st.lengths.reshape(Z * Rb), "truncated": st.truncated.reshape(Z * Rb),
                "admitted": st.started.reshape(Z * Rb)}  # has entered a slot
        return rows, st.counts["useful_slot_steps"]

    def routing(st):
        out = rollout_experts(st)
        if out:
            G = config.group_size
            out["prompt_experts"] = jnp.repeat(out["prompt_experts"], G, axis=0)
        return out

    rows = {k: batch_sharding(mesh, 2 if k in ("tokens", "logprobs") else 1) for k in FIELDS}
    return (jax.jit(start, in_shardings=(None, batch_sharding(mesh, 2), batch_sharding(mesh, 2), None)),
            jax.jit(advance, donate_argnums=1), jax.jit(outputs, out_shardings=(rows, replicated(mesh))),
            jax.jit(routing, out_shardings=batch_sharding(mesh, 4)))


class EngineStream:
    """One step's candidates in the paged engine, advanced a segment at a time from the host.

    `prompts`: (ids [N, P], mask [N, P]) as `generate` takes them (global arrays on several hosts);
    `read(rows) -> dict` turns the engine's outputs (a dict of `FIELDS`, rows split over the
    mesh) into this host's NumPy rows (`hosts.local_rows` on several hosts). `finished` says, per prompt of this host, whether all
    G of its sequences have stopped."""

    def __init__(self, model, prompts, config: SamplingConfig, rng: jax.Array, *, mesh=None, segment_steps: int = 16,
                 read=None):
        if segment_steps < 1:
            raise ValueError(f"segment_steps must be >= 1, got {segment_steps}")
        self.graphdef, self.state = nnx.split(model)
        self.config, self.segment_steps = config, int(segment_steps)
        self.mesh = mesh_or_one_device(mesh, self.state)
        self.start, self.advance_fn, self.outputs, self.routing = stream_programs(self.graphdef, config, self.mesh)
        self.read = read or (lambda rows: {k: np.asarray(v) for k, v in rows.items()})
        self.st = self.start(self.state, *prompts, rng)
        self.segments = 0
        self._read()

    def _read(self) -> None:
        rows, useful = self.outputs(self.st)
        self.rows, self.counts = self.read(rows), (int(useful),)

    @property
    def finished(self) -> np.ndarray:
        """bool [this host's prompts]: every one of the group's sequences has stopped."""
        return (self.rows["lengths"] > 0).reshape(-1, self.config.group_size).all(axis=1)

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def advance(self) -> np.ndarray:
        """Run one more segment; returns the indices of this host's prompts whose groups finished in it."""
        before = self.finished
        self.st = self.advance_fn(self.state, self.st, jnp.int32(self.segment_steps))
        self._read()
        self.segments += 1
        return np.flatnonzero(self.finished & ~before)

    def group_rows(self, prompt: int) -> SampleRows:
        """The finished group of this host's prompt `prompt`: its G rows of every output, with the
        loss mask (1 on each completion's tokens, its stop token included)."""
        G = self.config.group_size
        rows = {k: v[prompt * G:(prompt + 1) * G] for k, v in self.rows.items() if k != "admitted"}
        M = rows["tokens"].shape[1]
        mask = (np.arange(M)[None] < rows["lengths"][:, None]).astype(np.int32)
        return SampleRows(mask=mask, **rows)

    def routing_rows(self) -> dict:
        """A mixture-of-experts model's experts of this host's rows, read now: {"experts" [R_h, M, L,
        Kx], "prompt_experts" [R_h, P, L, Kx]} ({} for a dense model). A finished group's do not
        change as the stream goes on, so they are read once, at the end (`stream_collect`), not
        after every segment. Every host must call it (one program over the mesh)."""
        if self.st.experts is None:
            return {}
        return self.read(self.routing(self.st))

    @property
    def useful_tokens(self) -> float:
        """Tokens drawn so far by the slots, finished groups or not: this host's share (the count
        covers every host's slots; with several hosts each reports an equal part of it)."""
        return float(self.counts[0]) / jax.process_count()

    @property
    def engine_stats(self) -> dict:
        """The engine's counts so far (`engine.paged.STATS`, for `engine_metrics`)."""
        return {**self.st.counts, "pool_pages": pool_of(self.st.cache), "shards": self.st.seq.shape[0]}

    @property
    def admitted_groups(self) -> int:
        """Groups of this host's prompts that have entered a slot (all of them, or in flight)."""
        return int(self.rows["admitted"].reshape(-1, self.config.group_size).any(axis=1).sum())


def stream_collect(stream: EngineStream, score: Callable[[np.ndarray], Round], *, num_groups: int, group_size: int,
                   any_short: Callable[[bool], bool] = bool) -> Collected:
    """Advance `stream` until `num_groups` of this host's groups are informative (their scores not
    all equal) or every candidate has finished, on every host (`any_short`: all hosts advance
    together); `score(prompt indices) -> Round` scores the groups that finished in a segment. Then
    the batch is put together as `collect.assemble` does (set-aside uniform groups fill a short
    batch with NaN rewards). `first`, which reward statistics, health and logged samples describe,
    is the first `num_groups` groups to finish: the policy's samples, but the shorter ones first."""
    rounds: list[Round] = []
    scored: list[np.ndarray] = []  # the stream's prompts of each round
    kept: list[tuple[Round, int]] = []
    spare: list[tuple[Round, int]] = []
    finished: list[tuple[Round, int]] = []
    sample_s = 0.0
    while True:
        t0 = time.perf_counter()
        new = stream.advance()
        sample_s += time.perf_counter() - t0
        if len(new):
            rnd = score(new)
            rounds.append(rnd)
            scored.append(new)
            uniform = np.asarray(uniform_groups(rnd.scores, group_size))
            for i in range(len(new)):
                (spare if uniform[i] else kept).append((rnd, i))
                finished.append((rnd, i))
        if not any_short(len(kept) < num_groups and not stream.done):
            break
    if len(finished) < num_groups:
        raise RuntimeError(f"the engine finished {len(finished)} groups of {num_groups} needed")  # n_cap >= num_groups
    add_routing(stream, rounds, scored, group_size)
    admitted = stream.admitted_groups
    stats = {"dynamic/rounds": 1.0, "dynamic/segments": float(stream.segments),
             "dynamic/admitted_groups": float(admitted), "dynamic/finished_groups": float(len(finished)),
             "dynamic/kept_groups": float(min(len(kept), num_groups)),
             "dynamic/in_flight_dropped": float(admitted - len(finished)),
             "sample_tokens": float(stream.useful_tokens), "sample_s": sample_s}
    return assemble(rounds, kept, spare, num_groups=num_groups, group_size=group_size,
                    first=merge_groups(finished[:num_groups], group_size), stats=stats)


def add_routing(stream: EngineStream, rounds: list[Round], prompts: list[np.ndarray], group_size: int) -> None:
    """Give each round's rows (the groups of the stream's `prompts`, one array per round) their
    experts, read from the stream once (a mixture-of-experts model; nothing for a dense one)."""
    routing = stream.routing_rows()
    for rnd, new in zip(rounds, prompts):
        rows = np.concatenate([np.arange(i * group_size, (i + 1) * group_size) for i in new])
        rnd.rows = rnd.rows.replace(**{k: v[rows] for k, v in routing.items()})


def merge_groups(groups: list[tuple[Round, int]], group_size: int) -> Round:
    """One Round of the given groups (group i of each round), in order: their examples, rows, texts,
    rewards and scores; failure counts and messages are those of every round they come from."""
    G = group_size
    rounds = list({id(r): r for r, _ in groups}.values())

    def cut(x, i):
        return x[i * G:(i + 1) * G]

    rewards = RewardResult(
        total=np.concatenate([cut(r.rewards.total, i) for r, i in groups]),
        per_fn={k: np.concatenate([cut(r.rewards.per_fn[k], i) for r, i in groups]) for k in rounds[0].rewards.per_fn},
        failures={k: sum(r.rewards.failures.get(k, 0) for r in rounds) for r in rounds for k in r.rewards.failures},
        messages={k: v for r in reversed(rounds) for k, v in r.rewards.messages.items()})
    return Round(examples=[r.examples[i] for r, i in groups],
                 rows=SampleRows.concat([r.rows.take(slice(i * G, (i + 1) * G)) for r, i in groups]),
                 texts=[t for r, i in groups for t in cut(r.texts, i)], rewards=rewards,
                 scores=np.concatenate([cut(r.scores, i) for r, i in groups]))
