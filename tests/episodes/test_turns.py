"""Multi-turn episodes in the engine's slots (grpo_jax.episodes.turns), driven by a scripted host:
environment tokens fed through the decode steps between model turns, earlier turns never
recomputed. The trajectory's sampled log-probs equal a teacher-forced pass over prompt and whole
trajectory, environment positions are marked and carry log-prob 0, a turn cut at a tool call
continues from the cut, and none of it depends on the number of slots or the host's timing.
With a pool so short that episodes are preempted and replayed, paused ones too, the episodes are
token for token those of one whole trajectory's reservation per slot (`engine: continuous`, read in
place, never short), and every page is back in the pool at the end."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from teacher_forcing import assert_same_experts, teacher_forced, teacher_forced_experts, tiny_moe

from grpo_jax.config import SamplingConfig
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.engine.sampling import pad_prompts
from grpo_jax.engine.pages import page_bytes, pages_needed
from grpo_jax.engine.paged import pool_of
from grpo_jax.episodes.turns import PAUSED, turn_programs
from grpo_jax.runtime.sharding import one_device_mesh

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7], [12], [80, 81, 82, 83]]
FORCED = [100, 101, 102]  # the scripted environment's answer after every turn but the last
CAPACITY, ENV_TOKENS, BUDGET = 40, 4, 14


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))


def pool_bytes(model, page_size: int, trajectories: float) -> int:
    """A paged pool of the prompts' pages and `trajectories` whole trajectories' pages."""
    cfg = model.config
    Tp, most = pages_needed(8, CAPACITY, page_size)
    pages = 1 + len(PROMPTS) * Tp + int(trajectories * most)
    return pages * page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, 4)


def run(model, slots: int, segment: int, cut_at: int | None = None, turns: int = 2, stops=tuple(range(3, 60)),
        **paged):
    """Episodes of `turns` model turns; with `cut_at`, a first turn longer than that is cut there
    (as at a tool call's closing tag). `paged`: page_size and kv_cache_bytes (none: engine continuous,
    a whole trajectory per slot)."""
    cfg = SamplingConfig(group_size=2, max_new_tokens=BUDGET, temperature=1.0, stop_token_ids=stops,
                         prompt_buckets=(8,), pad_token_id=0, engine="paged" if paged else "continuous", slots=slots,
                         **paged)
    graphdef, state = nnx.split(model)
    start, advance, update, _ = turn_programs(graphdef, cfg, one_device_mesh(), CAPACITY, ENV_TOKENS)
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    st = start(state, ids, mask, jax.random.key(4))
    done_turns, turn_start, off_slot = {}, {}, [0]
    R = len(PROMPTS) * 2
    while True:
        st = advance(state, st, segment)
        seq, mode, t = (np.array(x)[0] for x in st.host_view()[:3])
        if int(np.asarray(st.engine.done).min()) == R:
            break
        J = seq.shape[0]
        # Per slot, and on pages per episode (those preempted out of their slot): release or end,
        # forced tokens and their count, rewind.
        slot = [np.zeros((1, J), bool), np.zeros((1, J, ENV_TOKENS), np.int32), np.zeros((1, J), np.int32),
                np.full((1, J), -1, np.int32)]
        episode = [np.zeros((1, R), bool), np.zeros((1, R, ENV_TOKENS), np.int32), np.zeros((1, R), np.int32),
                   np.full((1, R), -1, np.int32)]
        places = [(int(seq[j]), int(t[j]), mode[j], slot, j) for j in np.flatnonzero(seq >= 0)]
        ep_mode, ep_t, out_of_slot = (np.asarray(x)[0] for x in st.episode_view())
        places += [(int(i), int(ep_t[i]), ep_mode[i], episode, i) for i in np.flatnonzero(out_of_slot)]
        for r, t_r, mode_r, (release, forced, n, rewind), k in places:
            start_t = turn_start.setdefault(r, 0)
            cut = cut_at is not None and done_turns.get(r, 0) == 0 and t_r - start_t > cut_at
            if mode_r != PAUSED and not cut:
                continue
            off_slot[0] += rewind is episode[3]
            if cut:
                rewind[0, k] = t_r = start_t + cut_at
            done_turns[r] = done_turns.get(r, 0) + 1
            if done_turns[r] < turns:
                forced[0, k, :len(FORCED)], n[0, k] = FORCED, len(FORCED)
                turn_start[r] = t_r + len(FORCED)
            else:
                release[0, k] = True
        release, forced, n, rewind = slot
        ep_end, ep_forced, ep_n, ep_rewind = episode
        st = update(st, release, forced, n, rewind, ep_forced, ep_n, ep_end, ep_rewind)
    out = {k: np.asarray(x)[0] for k, x in (("tokens", st.engine.tokens), ("logprobs", st.engine.logprobs),
                                            ("env", st.env), ("lengths", st.engine.lengths),
                                            ("experts", st.engine.experts), ("prompt_experts", st.engine.prompt_experts))
           if x is not None}
    cache = st.engine.cache
    out["pooled"] = pool_of(cache) > 0  # else one reservation per slot: nothing to give back
    out["pages_back"] = not out["pooled"] or int(cache.nfree[0]) == cache.pool
    out["stats"] = {k: int(v) for k, v in st.engine.counts.items()}
    out["answered_out_of_slot"] = off_slot[0]
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


def assert_same_episodes(got, want):
    np.testing.assert_array_equal(got["lengths"], want["lengths"])
    live = np.arange(CAPACITY)[None] < want["lengths"][:, None]
    for key in ("tokens", "env"):
        np.testing.assert_array_equal(np.where(live, got[key], 0), np.where(live, want[key], 0), err_msg=key)


def test_episodes_on_a_short_pool_are_those_of_a_whole_trajectory_per_slot_with_preemption_and_cuts(model):
    """A pool of one trajectory's pages for 3 slots (turns of up to 14 tokens: fewer stop tokens):
    episodes are preempted and replayed from their recorded tokens; the trajectories are token for
    token those of a trajectory's reservation per slot (nothing preempted there), with turns cut too (a rewind gives back the pages above the
    cut), and every page comes back. An episode preempted while paused is answered out of its
    slot (by episode) and admitted again only then."""
    stops = tuple(range(3, 20))
    for cut_at in (None, 2):
        want = run(model, slots=3, segment=3, cut_at=cut_at, stops=stops)[0]
        assert want["stats"]["preemptions"] == 0 and not want["pooled"]
        out, ids, mask, done_turns = run(model, slots=3, segment=3, cut_at=cut_at, stops=stops, page_size=4,
                                         kv_cache_bytes=pool_bytes(model, 4, 1.0))
        assert set(done_turns.values()) == {2}
        assert out["stats"]["preemptions"] > 0 and out["stats"]["recomputed_tokens"] > 0, out["stats"]
        assert out["pooled"] and out["pages_back"]
        if cut_at is None:
            assert out["answered_out_of_slot"] > 0
        assert_same_episodes(out, want)
        check_trajectories(model, out, ids, mask)


def test_episodes_on_pages_record_the_experts_of_every_token_fed_replays_and_environment_tokens_too():
    """A mixture-of-experts model's episodes on a pool short enough to preempt and replay them, with
    turns cut: every position of a trajectory, the environment's tokens included, holds the experts a
    teacher-forced pass over prompt and trajectory routes it to (a replay records its own routing
    over the first, which a cut's rewind or the pool took back)."""
    moe = tiny_moe()
    out, ids, mask, done_turns = run(moe, slots=3, segment=3, cut_at=2, stops=tuple(range(3, 20)), page_size=4,
                                     kv_cache_bytes=pool_bytes(moe, 4, 1.0))
    assert set(done_turns.values()) == {2} and out["stats"]["recomputed_tokens"] > 0, out["stats"]
    check_trajectories(moe, out, ids, mask)
    live = np.arange(CAPACITY)[None] < out["lengths"][:, None]
    assert (live & out["env"]).sum() == len(FORCED) * len(out["lengths"])  # every position is fed: none at capacity
    want_prompt, want = teacher_forced_experts(moe, ids, mask, np.where(live, out["tokens"], 0), group_size=2)
    assert_same_experts(out["experts"], want, live, "trajectory")
    assert_same_experts(out["prompt_experts"], want_prompt, mask.astype(bool), "prompt")
