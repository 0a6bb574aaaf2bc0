"""The paged engine with one max-length reservation per slot (`sampling.kv_cache_bytes: 0`, the
per-slot engine's settings, which `sampling.engine: continuous` names): fewer slots than sequences,
so slots are refilled mid-loop, and still every sequence is what it would be alone.

- greedy: every sequence equals the static engine's (ragged prompts, G = 1 and 4, stops at
  different steps, sequences that reach max_new_tokens);
- sampled: the same rollout with 2, 3 and 8 slots and with one slot per sequence (the lock-step
  loop), log-probs equal to a teacher-forced pass, the
  prompts prefilled once each, every slot-step that drew a token counted as useful;
- sharded: slots split over a (2, 2, 2) mesh give the one-device rollout.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from teacher_forcing import teacher_forced

from grpo_jax.config import MeshConfig, SamplingConfig
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.engine.engines import engine_of
from grpo_jax.engine.sampling import generate, pad_prompts
from grpo_jax.runtime.sharding import make_mesh, one_device_mesh, place_model

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7], [12], [80, 81, 82, 83, 84, 85, 86, 87], [30, 31], [4, 4, 4, 4],
           [70, 9, 1, 2, 3, 6, 8], [100, 101]]
M = 10


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))


def config(**kw) -> SamplingConfig:
    return SamplingConfig(**{"max_new_tokens": M, "prompt_buckets": (8,), "pad_token_id": 0, "engine": "static", **kw})


def arrays(rollout) -> dict[str, np.ndarray]:
    return {k: np.asarray(getattr(rollout, k)) for k in ("tokens", "logprobs", "mask", "lengths", "truncated")}


@pytest.mark.parametrize("group_size", [1, 4])
def test_greedy_sequences_equal_the_static_engines(model, group_size):
    free = generate(model, PROMPTS, config(group_size=1, temperature=0.0, stop_token_ids=(1,)), jax.random.key(0))
    tokens = np.asarray(free.tokens)
    # Each prompt's greedy continuation stops where one of these tokens first appears: at
    # different steps for different prompts, and never for some (they reach max_new_tokens).
    stops = tuple(sorted({int(tokens[i, (3 * i) % M]) for i in range(0, len(PROMPTS), 2)} - {0}))
    cfg = config(group_size=group_size, temperature=0.0, stop_token_ids=stops)
    static = arrays(generate(model, PROMPTS, cfg, jax.random.key(0)))
    assert len(set(static["lengths"].tolist())) >= 3 and 0 < static["truncated"].sum() < len(static["truncated"])
    R = len(PROMPTS) * group_size
    for slots in (3, R - 1):  # refills happen: fewer slots than sequences
        got = arrays(generate(model, PROMPTS, dataclasses.replace(cfg, engine="paged", slots=slots),
                              jax.random.key(0)))
        for key in ("tokens", "mask", "lengths", "truncated"):
            np.testing.assert_array_equal(got[key], static[key], err_msg=f"{key}, {slots} slots")
        np.testing.assert_allclose(got["logprobs"], static["logprobs"], atol=1e-5)


def test_sliding_window_layers_in_slots_equal_the_static_engine():
    """Gemma 3's sliding layers (window 8 here, shorter than prompt + completion) and soft caps."""
    gemma = Transformer(tiny("gemma3_text"), rngs=nnx.Rngs(1))
    for temperature in (0.0, 1.0):
        cfg = config(group_size=4, temperature=temperature, stop_token_ids=(7, 8, 9))
        rollout = generate(gemma, PROMPTS, dataclasses.replace(cfg, engine="paged", slots=5), jax.random.key(0))
        got = arrays(rollout)
        assert got["lengths"].max() > 8  # with any prompt, prompt + completion outrun the window of 8
        if temperature == 0:
            static = arrays(generate(gemma, PROMPTS, cfg, jax.random.key(0)))
            for key in ("tokens", "mask", "lengths", "truncated"):
                np.testing.assert_array_equal(got[key], static[key], err_msg=key)
            np.testing.assert_allclose(got["logprobs"], static["logprobs"], atol=1e-5)
        else:  # its own draws: compare with a teacher-forced pass of gemma itself
            m = got["mask"].astype(bool)
            np.testing.assert_allclose(got["logprobs"][m], teacher_forced_rollout(gemma, rollout, 1.0)[m], atol=1e-5)


def teacher_forced_rollout(model, rollout, temperature: float = 0.8) -> np.ndarray:
    return teacher_forced(model, rollout.prompt_ids, rollout.prompt_mask, rollout.tokens,
                          group_size=rollout.group_size, temperature=temperature)


def test_a_sampled_rollout_does_not_depend_on_the_slots_and_its_logprobs_are_exact(model, monkeypatch):
    prefills = []

    def counting(name):
        original = getattr(Transformer, name)

        def counted(self, ids, mask=None, **kw):
            prefills.append(ids.shape)
            return original(self, ids, mask, **kw)
        monkeypatch.setattr(Transformer, name, counted)

    counting("prefill_kv")  # the slot loop's prompt pass
    counting("prefill")  # the lock-step loop's
    cfg = config(group_size=4, temperature=0.8, stop_token_ids=tuple(range(3, 30)), engine="paged")
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    graphdef, state = nnx.split(model)
    runs = {}
    # 0: one slot per sequence, nothing to refill: the engine runs the lock-step loop with the
    # sequences' own uniforms, and draws the same rollout.
    for slots in (2, 3, 8, 0):
        prefills.clear()
        rollout, stats = engine_of(cfg).program(graphdef, dataclasses.replace(cfg, slots=slots), one_device_mesh())(
            state, ids, mask, jax.random.key(7))
        assert prefills == [(len(PROMPTS), 8)]  # one pass over the N prompts, not N x G rows
        runs[slots] = arrays(rollout)
        lengths = runs[slots]["lengths"]
        # Every slot-step that drew a token drew one of a sequence's tokens, and only those.
        assert int(stats["useful_slot_steps"]) == lengths.sum()
        width = slots or len(lengths)
        assert int(stats["steps"]) >= -(-lengths.sum() // width)
        assert int(stats["pool_pages"]) == 0 and int(stats["preemptions"]) == 0  # a reservation per slot: no pool
        if slots == 8:  # the drain ran on 4 slots once the queue was empty (paged.compact_paged)
            assert lengths.sum() <= int(stats["slot_steps"]) < int(stats["steps"]) * width
        else:
            assert int(stats["slot_steps"]) == int(stats["steps"]) * width
    assert len(set(runs[2]["lengths"].tolist())) >= 4 and runs[2]["truncated"].any()
    for slots in (3, 8, 0):
        for key in ("tokens", "mask", "lengths", "truncated"):
            np.testing.assert_array_equal(runs[slots][key], runs[2][key], err_msg=f"{key}, {slots} slots")
        np.testing.assert_allclose(runs[slots]["logprobs"], runs[2]["logprobs"], atol=1e-6)
    m = runs[2]["mask"].astype(bool)
    np.testing.assert_allclose(runs[2]["logprobs"][m], teacher_forced_rollout(model, rollout)[m], atol=1e-5)
    assert (runs[2]["tokens"][~m] == 0).all() and (runs[2]["logprobs"][~m] == 0).all()
    assert rollout.experts is None and rollout.prompt_experts is None  # a dense model routes nothing


def test_min_new_tokens_holds_in_every_slot(model):
    cfg = config(group_size=4, temperature=1.0, stop_token_ids=tuple(range(3, 120)), min_new_tokens=4,
                 engine="continuous", slots=5)
    out = arrays(generate(model, PROMPTS, cfg, jax.random.key(2)))
    assert out["lengths"].min() >= 5 and (out["lengths"] < M).any()  # stops drawn right after the ban


def test_sharded_slots_equal_one_device(model):
    cfg = config(group_size=4, temperature=1.0, stop_token_ids=tuple(range(3, 40)), engine="continuous", slots=8)
    alone = arrays(generate(model, PROMPTS, cfg, jax.random.key(3)))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded_model = Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))
    place_model(sharded_model, mesh)
    rollout = generate(sharded_model, PROMPTS, cfg, jax.random.key(3), mesh=mesh)
    assert len(rollout.tokens.sharding.device_set) == 8
    got = arrays(rollout)
    for key in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(got[key], alone[key], err_msg=key)
    np.testing.assert_allclose(got["logprobs"], alone["logprobs"], atol=1e-5)


def test_a_run_says_which_engine_settings_it_does_not_use_as_written():
    from grpo_jax.trainer.prepare import engine_notes

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    (static,) = engine_notes(config(slots=8), mesh, dynamic_sampling=False)
    assert "not used: the static engine" in static
    (rounded,) = engine_notes(config(engine="continuous", slots=6), mesh, dynamic_sampling=True)
    assert "sampling.slots=6 -> 8" in rounded
    assert engine_notes(config(engine="continuous", slots=8), mesh, dynamic_sampling=True) == []
    (segments,) = engine_notes(config(engine="continuous", segment_steps=4), mesh, dynamic_sampling=False)
    assert "over-sampling only" in segments
    (pages,) = engine_notes(config(engine="continuous", slots=8, page_size=64), mesh, dynamic_sampling=False)
    assert "sampling.page_size not used: the continuous engine has no page pool" in pages
    (reserved,) = engine_notes(config(engine="paged", slots=8, page_size=64), mesh, dynamic_sampling=True)
    assert "page_size not used: with kv_cache_bytes 0 each slot reserves" in reserved
    assert engine_notes(config(engine="paged", slots=8, page_size=64, kv_cache_bytes=1 << 20), mesh,
                        dynamic_sampling=True) == []


def test_engine_settings_are_checked():
    with pytest.raises(ValueError, match="sampling.engine"):
        SamplingConfig(engine="vllm")
    for bad, name in (({"page_size": 0}, "page_size"), ({"kv_cache_bytes": -1}, "kv_cache_bytes"),
                      ({"paged_attention": "flash"}, "paged_attention")):
        with pytest.raises(ValueError, match=f"sampling.{name}"):
            SamplingConfig(**bad)
    with pytest.raises(ValueError, match="sampling.slots"):
        SamplingConfig(slots=-1)


class Example:
    def __init__(self, index):
        self.index, self.prompt_text = index, f"prompt {index}"


def fake_scores(informative: set[int], G: int):
    """A reward by prompt: 0 for every sample of a prompt outside `informative` (a uniform group),
    alternating 0/1 over the samples of one inside it."""
    def score(stream, new):
        from grpo_jax.rewards import RewardResult
        from grpo_jax.engine.draw import SampleRows
        from grpo_jax.rollout.collect import Round

        rows = SampleRows.concat([stream.group_rows(int(i)) for i in new])
        total = np.asarray([float(j % 2) if int(i) in informative else 0.0 for i in new for j in range(G)], np.float32)
        return Round(examples=[Example(int(i)) for i in new], rows=rows, texts=[""] * len(total),
                     rewards=RewardResult(total=total, per_fn={"fake": total}, failures={}, messages={}))
    return score


def pool_bytes(model, *, page_size: int, sequences: float) -> int:
    """Paged-engine bytes for the prompt region of `PROMPTS` and `sequences` max-length sequences' pages."""
    from grpo_jax.engine.pages import page_bytes, pages_needed

    c = model.config
    Tp, most = pages_needed(8, M, page_size)
    pages = 1 + len(PROMPTS) * Tp + int(sequences * most)
    return pages * page_bytes(c.num_layers, c.num_kv_heads, c.head_dim, page_size, 4)


def stream_over(model, cfg, informative, num_groups, segment_steps=2):
    from grpo_jax.rollout.stream import EngineStream, stream_collect

    stream = EngineStream(model, pad_prompts(PROMPTS, (8,), 0), cfg, jax.random.key(5), segment_steps=segment_steps)
    score = fake_scores(informative, cfg.group_size)
    return stream, stream_collect(stream, lambda new: score(stream, new), num_groups=num_groups,
                                  group_size=cfg.group_size)


@pytest.mark.parametrize("engine", ["continuous", "paged"])
def test_over_sampling_stops_at_the_informative_groups_it_needs_in_one_pass(model, engine):
    """The paged engine's with a pool of two sequences' pages for 5 slots: sequences wait for pages
    and are preempted, and the chosen groups are still what the one-shot engine samples."""
    G = 4
    paged = {"page_size": 4, "kv_cache_bytes": pool_bytes(model, page_size=4, sequences=2)} if engine == "paged" else {}
    cfg = config(group_size=G, temperature=1.0, stop_token_ids=tuple(range(3, 40)), engine=engine, slots=5, **paged)
    stream, c = stream_over(model, cfg, informative={1, 2, 5, 6, 7}, num_groups=3)
    if engine == "paged":
        assert stream.engine_stats["preemptions"] > 0
    chosen = [ex.index for ex in c.examples]
    assert len(chosen) == len(set(chosen)) == 3 and set(chosen) <= {1, 2, 5, 6, 7}  # no group twice
    assert c.rows.experts is None and c.rows.prompt_experts is None  # a dense model's
    assert not np.isnan(c.rewards).any()
    s = c.stats
    assert s["dynamic/kept_groups"] == 3 and s["dynamic/filled_groups"] == 0 and s["dynamic/rounds"] == 1
    # The counts add up: what finished was kept or set aside (or kept beyond the batch), and what
    # was admitted finished or was dropped in flight; the engine stopped before all 8 ran.
    assert s["dynamic/finished_groups"] >= s["dynamic/kept_groups"] + s["dynamic/dropped_groups"]
    assert s["dynamic/admitted_groups"] == s["dynamic/finished_groups"] + s["dynamic/in_flight_dropped"]
    assert s["dynamic/finished_groups"] < len(PROMPTS) and not stream.done
    # Each chosen group is what the one-shot engine samples for that prompt with the same key.
    whole = arrays(generate(model, PROMPTS, cfg, jax.random.key(5)))
    for g, i in enumerate(chosen):
        for key in ("tokens", "lengths", "truncated", "mask"):
            np.testing.assert_array_equal(getattr(c.rows, key)[g * G:(g + 1) * G], whole[key][i * G:(i + 1) * G], err_msg=key)
        np.testing.assert_allclose(c.rows.logprobs[g * G:(g + 1) * G], whole["logprobs"][i * G:(i + 1) * G],
                                   atol=1e-6)


def test_over_sampling_that_runs_out_of_candidates_fills_without_rewards(model):
    G = 4
    cfg = config(group_size=G, temperature=1.0, stop_token_ids=tuple(range(3, 40)), engine="continuous", slots=5)
    stream, c = stream_over(model, cfg, informative={3}, num_groups=3, segment_steps=4)
    assert stream.done and [ex.index for ex in c.examples][0] == 3
    s = c.stats
    assert s["dynamic/finished_groups"] == s["dynamic/admitted_groups"] == len(PROMPTS)
    assert s["dynamic/kept_groups"] == 1 and s["dynamic/dropped_groups"] == 7 and s["dynamic/filled_groups"] == 2
    assert s["dynamic/in_flight_dropped"] == 0
    assert np.isnan(c.rewards[G:]).all() and not np.isnan(c.rewards[:G]).any()


def test_the_continuous_engine_is_the_paged_one_with_a_reservation_per_slot(model):
    """`engine: continuous` (the per-slot engine of earlier releases) runs the paged engine's
    program with one max-length reservation per slot whatever `kv_cache_bytes` says: no pool, and
    the rollout of `paged` at `kv_cache_bytes: 0`, token for token."""
    cfg = config(group_size=4, temperature=0.9, stop_token_ids=tuple(range(3, 30)), slots=5)
    ids, mask = pad_prompts(PROMPTS, (8,), 0)
    graphdef, state = nnx.split(model)
    runs = {}
    for name, kw in (("paged", {}), ("continuous", {"kv_cache_bytes": 1 << 20, "paged_attention": "gather"})):
        c = dataclasses.replace(cfg, engine=name, **kw)
        rollout, stats = engine_of(c).program(graphdef, c, one_device_mesh())(state, ids, mask, jax.random.key(3))
        assert int(stats["pool_pages"]) == 0 and int(stats["steps"]) > 0, (name, stats)
        runs[name] = arrays(rollout)
    for key in ("tokens", "logprobs", "lengths"):
        np.testing.assert_array_equal(runs["continuous"][key], runs["paged"][key], err_msg=key)
