"""Multi-turn episodes in the engine's slots (grpo_jax.episodes.turns), driven by a scripted host:
environment tokens fed through the decode steps between model turns, earlier turns never
recomputed. The trajectory's sampled log-probs equal a teacher-forced pass over prompt and whole
trajectory, environment positions are marked and carry log-prob 0, a turn cut at a tool call
continues from the cut, and none of it depends on the number of slots or the host's timing."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from teacher_forcing import teacher_forced

from grpo_jax.config import SamplingConfig
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.engine.sampling import pad_prompts
from grpo_jax.episodes.turns import PAUSED, turn_programs
from grpo_jax.runtime.sharding import one_device_mesh

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7], [12], [80, 81, 82, 83]]
FORCED = [100, 101, 102]  # the scripted environment's answer after every turn but the last
CAPACITY, ENV_TOKENS, BUDGET = 40, 4, 14


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))


def run(model, slots: int, segment: int, cut_at: int | None = None, turns: int = 2):
    """Episodes of `turns` model turns; with `cut_at`, a first turn longer than that is cut there
    (as at a tool call's closing tag)."""
    cfg = SamplingConfig(group_size=2, max_new_tokens=BUDGET, temperature=1.0, stop_token_ids=tuple(range(3, 60)),
                         prompt_buckets=(8,), pad_token_id=0, engine="continuous", slots=slots)
    graphdef, state = nnx.split(model)
    start, advance, update, _ = turn_programs(graphdef, cfg, one_device_mesh(), CAPACITY, ENV_TOKENS)
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    st = start(state, ids, mask, jax.random.key(4))
    done_turns, turn_start = {}, {}
    while True:
        st = advance(state, st, segment)
        seq, mode, t = (np.array(x)[0] for x in (st.engine.seq, st.mode, st.engine.cache.slot_t))
        if int(np.asarray(st.engine.done).min()) == len(PROMPTS) * 2:
            break
        J = seq.shape[0]
        release, forced = np.zeros((1, J), bool), np.zeros((1, J, ENV_TOKENS), np.int32)
        n, rewind = np.zeros((1, J), np.int32), np.full((1, J), -1, np.int32)
        for j in np.flatnonzero(seq >= 0):
            r = int(seq[j])
            start_t = turn_start.setdefault(r, 0)
            cut = cut_at is not None and done_turns.get(r, 0) == 0 and t[j] - start_t > cut_at
            if mode[j] != PAUSED and not cut:
                continue
            if cut:
                rewind[0, j] = t[j] = start_t + cut_at
            done_turns[r] = done_turns.get(r, 0) + 1
            if done_turns[r] < turns:
                forced[0, j, :len(FORCED)], n[0, j] = FORCED, len(FORCED)
                turn_start[r] = int(t[j]) + len(FORCED)
            else:
                release[0, j] = True
        st = update(st, release, forced, n, rewind)
    out = {k: np.asarray(x)[0] for k, x in (("tokens", st.engine.tokens), ("logprobs", st.engine.logprobs),
                                            ("env", st.env), ("lengths", st.engine.lengths))}
    return out, ids, mask, done_turns


def check_trajectories(model, out, ids, mask):
    lengths, env = out["lengths"], out["env"]
    live = np.arange(CAPACITY)[None] < lengths[:, None]
    model_pos, env_pos = live & ~env, live & env
    for r in range(len(lengths)):  # each episode: a turn, the environment's 3 tokens, a turn
        assert env_pos[r].sum() == len(FORCED) and (out["tokens"][r][env_pos[r]] == FORCED).all()
        first = np.flatnonzero(env_pos[r])
        assert (np.diff(first) == 1).all() and first[0] > 0 and model_pos[r, first[-1] + 1:lengths[r]].all()
    tokens = np.where(live, out["tokens"], 0)
    reference = teacher_forced(model, ids, mask, tokens, group_size=2)
    np.testing.assert_allclose(out["logprobs"][model_pos], reference[model_pos],
                               atol=1e-5)
    assert (out["logprobs"][env_pos] == 0).all()


def test_episodes_feed_environment_tokens_between_turns_exactly(model):
    out, ids, mask, done_turns = run(model, slots=3, segment=3)
    assert set(done_turns.values()) == {2}
    check_trajectories(model, out, ids, mask)
    # The same episodes with other slot counts and host timing.
    for slots, segment in ((2, 5), (8, 1)):
        other = run(model, slots=slots, segment=segment)[0]
        np.testing.assert_array_equal(other["lengths"], out["lengths"])
        live = np.arange(CAPACITY)[None] < out["lengths"][:, None]
        for key in ("tokens", "env"):
            np.testing.assert_array_equal(np.where(live, other[key], 0), np.where(live, out[key], 0), err_msg=key)


def first_turn_lengths(out) -> np.ndarray:
    return np.argmax(out["env"], axis=1)  # the first environment position


def test_a_turn_cut_at_a_tool_call_continues_from_the_cut(model):
    uncut = run(model, slots=2, segment=4)[0]
    out, ids, mask, _ = run(model, slots=2, segment=4, cut_at=2)
    assert (first_turn_lengths(uncut) > 2).sum() >= 2  # turns the host cuts
    assert (first_turn_lengths(out) <= 2).all()
    check_trajectories(model, out, ids, mask)
    cut = run(model, slots=3, segment=1, cut_at=2)[0]  # cut at other times: some turns had stopped
    np.testing.assert_array_equal(cut["lengths"], out["lengths"])
