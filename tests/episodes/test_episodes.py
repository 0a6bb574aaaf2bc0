"""Multi-turn episodes end to end on a tiny model (grpo_jax.episodes.runner): scripted
environments answer through the engine's slots, the engine's trajectory is the host's (sampled
tokens as sampled, environment tokens between turns), its sampled log-probs equal a teacher-forced
pass, a tool call's closing tag ends a turn, an environment that raises costs only its own
episodes, and slow tools run while the other slots decode."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from teacher_forcing import assert_same_experts, teacher_forced, teacher_forced_experts, tiny_moe

from grpo_jax import EnvStep
from grpo_jax.config import GRPOConfig, SamplingConfig
from grpo_jax.learner.grpo import policy_loss
from grpo_jax.data.tokenizer import char_tokenizer
from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.episodes.episode import EpisodeLimits
from grpo_jax.episodes.runner import run_episodes, trajectory_capacity

TEMPLATE = ("{% for m in messages %}{{ '[' + m.role + ']' + m.content + eos_token + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}")
TOK = char_tokenizer(add_bos=True, chat_template=TEMPLATE)
STOPS = tuple(TOK.convert_tokens_to_ids(list("0123456789"))) + (TOK.eos_token_id,)
EXAMPLES = [{"prompt": "Add 2 and 3."}, {"prompt": "Multiply 4 by 5."}, {"prompt": "Halve 8."}]


class Scripted:
    """A tool answer after the first turn, done after the second; `fail_on` prompts raise; `delay_s`
    per step; `tool_call_end`: a closing tag that ends a turn."""

    tool_call_end = None

    def __init__(self, fail_on: str = "", delay_s: float = 0.0, tag: str | None = None):
        self.fail_on, self.delay_s, self.turns = fail_on, delay_s, 0
        if tag:
            self.tool_call_end = tag

    def reset(self, example):
        self.prompt = example["prompt"]
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, completion):
        time.sleep(self.delay_s)
        if self.fail_on and self.fail_on in self.prompt:
            raise RuntimeError("the tool is down")
        self.turns += 1
        if self.turns == 1:
            return EnvStep([{"role": "tool", "content": "ok"}])
        return EnvStep([], reward=1.0, done=True)


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny("qwen3", vocab_size=len(TOK)), rngs=nnx.Rngs(0))


def config(**kw):
    return SamplingConfig(**{"group_size": 2, "max_new_tokens": 24, "temperature": 1.0, "stop_token_ids": STOPS,
                             "prompt_buckets": (40,), "pad_token_id": 0, "engine": "continuous", "slots": 4, **kw})


LIMITS = EpisodeLimits(max_turns=3, max_env_tokens=40, max_model_tokens=24, timeout_s=10.0)


def run(model, make_env, seed=0, park=True, padding=0, **kw):
    return run_episodes(model, EXAMPLES, TOK, make_env, config(**kw), LIMITS, jax.random.key(seed), segment_steps=4,
                        park=park, padding=padding)


def teacher_forced_batch(model, batch) -> np.ndarray:
    live = np.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]
    return teacher_forced(model, batch.prompt_ids, batch.prompt_mask, np.where(live, batch.tokens, 0), group_size=2)


def test_episodes_run_through_the_engine_token_exact(model):
    batch = run(model, Scripted)
    logp = teacher_forced_batch(model, batch)
    finished = 0
    for r, ep in enumerate(batch.episodes):
        assert ep.error is None and ep.done, (r, ep.error)
        if ep.truncated:  # the model-token budget ran out before the second turn ended
            assert ep.model_tokens == LIMITS.max_model_tokens and ep.env_reward != 1.0
        else:
            assert ep.env_reward == 1.0 and ep.turns == 2 and ep.tool_calls == 1
            finished += 1
        n = int(batch.lengths[r])
        assert batch.tokens[r, :n].tolist() == ep.ids  # the engine's trajectory is the host's
        assert (~batch.env[r, :n]).astype(int).tolist() == ep.loss_mask
        if ep.turns == 2:
            assert "[tool]ok<eos>\n[assistant]" + ep.transcript[1]["model"] in TOK.decode(ep.prompt_ids + ep.ids)
        sampled = np.array(ep.loss_mask, bool)
        np.testing.assert_allclose(np.array(ep.logprobs)[sampled], logp[r, :n][sampled], atol=1e-5)
    assert finished >= 4
    rows, eps = batch.rows(pad_id=0), batch.episodes
    assert batch.experts is None and rows.experts is None and rows.prompt_experts is None  # a dense model's
    assert rows.mask.sum() == sum(ep.model_tokens for ep in eps) and not batch.failed.any()
    live = np.arange(rows.tokens.shape[1])[None] < rows.lengths[:, None]
    assert (rows.tokens[~live] == 0).all() and (rows.logprobs[rows.mask == 0] == 0).all()
    assert rows.truncated.tolist() == [ep.truncated for ep in eps]
    assert batch.final_turns() == [ep.transcript[-1]["model"] for ep in eps]
    m = batch.metrics()
    assert m["env/errors"] == 0 and m["env/tool_calls_mean"] == np.mean([ep.tool_calls for ep in eps])
    assert m["completion/env_tokens_mean"] * len(eps) == (batch.env & live).sum()
    # The GRPO loss over these rows has no gradient at environment positions, and one at sampled ones.
    lp, adv = jnp.asarray(rows.logprobs), jnp.linspace(-1.0, 1.0, len(eps))
    grad = np.asarray(jax.grad(lambda x: policy_loss(x, lp, adv, rows.mask, GRPOConfig(beta=0.04),
                                                     ref_logprobs=lp - 0.1)[0])(lp + 0.05))
    env_positions = live & batch.env
    assert env_positions.sum() > 0 and (grad[env_positions] == 0).all() and (grad[rows.mask == 1] != 0).all()


def test_episodes_record_the_experts_of_every_token_fed_the_environments_too():
    """A mixture-of-experts model's episodes: each trajectory position (model and environment
    tokens) holds the experts a teacher-forced pass over the whole row routes it to, and so do the
    rows the batch takes (0 past each trajectory, each row its prompt's experts)."""
    moe = tiny_moe(len(TOK))
    batch = run(moe, Scripted)
    T = batch.tokens.shape[1]
    live = np.arange(T)[None] < batch.lengths[:, None]
    assert batch.lengths.max() < T and (live & batch.env).sum() > 0  # every live token was fed; some are the tool's
    want_prompt, want = teacher_forced_experts(moe, batch.prompt_ids, batch.prompt_mask,
                                               np.where(live, batch.tokens, 0), group_size=2)
    assert_same_experts(batch.experts, want, live, "trajectory")
    assert_same_experts(batch.prompt_experts, want_prompt, batch.prompt_mask.astype(bool), "prompt")
    rows = batch.rows(pad_id=0)
    assert rows.experts.dtype == np.uint8 and (rows.experts[~live] == 0).all()
    np.testing.assert_array_equal(rows.experts[live], batch.experts[live])
    np.testing.assert_array_equal(rows.prompt_experts, np.repeat(batch.prompt_experts, 2, axis=0))


def test_a_failing_environment_costs_only_its_own_episodes_and_tags_end_turns(model):
    batch = run(model, lambda: Scripted(fail_on="Multiply"), seed=1)
    errors = [ep.error for ep in batch.episodes]
    assert errors[2:4] == ["environment.step: RuntimeError: the tool is down"] * 2
    assert all(e is None for i, e in enumerate(errors) if i not in (2, 3))
    assert batch.metrics()["env/failed"] == 2 and batch.failed.tolist() == [i in (2, 3) for i in range(6)]
    tagged = run(model, lambda: Scripted(tag="5"), seed=2, stop_token_ids=(TOK.eos_token_id,))
    firsts = [ep.transcript[0]["model"] for ep in tagged.episodes]
    assert all(turn.endswith("5") and "5" not in turn[:-1] for turn in firsts if "5" in turn)
    # A turn the tag ended mid-way (the slot rewound: the model had drawn on past the tag).
    assert any(turn.endswith("5") and len(turn) < LIMITS.max_model_tokens for turn in firsts)
    logp = teacher_forced_batch(model, tagged)
    for r, ep in enumerate(tagged.episodes):
        n, sampled = int(tagged.lengths[r]), np.array(ep.loss_mask, bool)
        assert tagged.tokens[r, :n].tolist() == ep.ids
        np.testing.assert_allclose(np.array(ep.logprobs)[sampled], logp[r, :n][sampled], atol=1e-5)


def test_slow_environment_steps_overlap_with_decoding_and_free_their_slots(model):
    """A slow environment neither stalls the other slots nor holds its own: the episode leaves its
    slot to a waiting one and comes back to its cache as it was (the same trajectories as when it
    keeps the slot, and the teacher-forced log-probs)."""
    import threading

    lock, live, most = threading.Lock(), [0], [0]

    class Counted(Scripted):
        def step(self, completion):
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])
            try:
                return super().step(completion)
            finally:
                with lock:
                    live[0] -= 1

    moved = run(model, lambda: Counted(delay_s=0.3))
    # 6 episodes x 2 steps of 0.3 s: the steps ran side by side, not one after another (counted,
    # not timed: a wall-clock bound failed on a loaded machine).
    assert most[0] >= 2, most
    kept = run(model, lambda: Scripted(delay_s=0.3), park=False)
    assert moved.parks >= 2 and kept.parks == 0 and moved.metrics()["env/parks"] == moved.parks
    for name in ("tokens", "lengths", "env"):
        np.testing.assert_array_equal(getattr(moved, name), getattr(kept, name), err_msg=name)
    np.testing.assert_allclose(moved.logprobs, kept.logprobs, atol=1e-6)
    logp = teacher_forced_batch(model, moved)
    for r, ep in enumerate(moved.episodes):
        n, sampled = int(moved.lengths[r]), np.array(ep.loss_mask, bool)
        assert ep.error is None and moved.tokens[r, :n].tolist() == ep.ids
        np.testing.assert_allclose(np.array(ep.logprobs)[sampled], logp[r, :n][sampled], atol=1e-5)


def test_episodes_on_a_short_pool_are_those_of_a_whole_trajectory_per_slot(model):
    """A slow environment's episode parks (its pages held at the spot, taken back when the pool runs
    short: then it replays its trajectory on return), and a pool of about one trajectory preempts
    and replays others: the trajectories, log-probs and transcripts are those of a whole
    trajectory's pages per slot (`engine: continuous`, nothing preempted), the run counts it, and
    every page is back in the pool at the end."""
    from grpo_jax.engine.pages import page_bytes, pages_needed

    cfg = model.config
    Tp, most = pages_needed(40, trajectory_capacity(LIMITS), 8)
    pool = (1 + len(EXAMPLES) * Tp + most) * page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, 4)
    want = run(model, lambda: Scripted(delay_s=0.3))
    parked = run(model, lambda: Scripted(delay_s=0.3), engine="paged", page_size=8, kv_cache_bytes=pool)
    # Without parking the paused episodes keep their pages: the pool runs short.
    kept = run(model, lambda: Scripted(delay_s=0.3), park=False, engine="paged", page_size=8, kv_cache_bytes=pool)
    assert parked.parks >= 1 and kept.metrics()["engine/preemptions"] > 0, (parked.metrics(), kept.metrics())
    assert 0 < parked.metrics()["engine/pages_used_frac"] <= 1
    for got in (parked, kept):
        assert got.engine["pages_held_at_end"] == 0
        for name in ("tokens", "lengths", "env"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        assert [ep.transcript for ep in got.episodes] == [ep.transcript for ep in want.episodes]
    assert want.metrics()["engine/preemptions"] == 0 and want.engine["pages_held_at_end"] == 0


def test_padding_examples_play_no_episode(model):
    """Evaluation fills its last chunk with copies of a prompt: those episodes never open an
    environment and leave their slot at the host's first look (one segment), and the real ones are
    the same as without the padding."""
    made = []

    def counted():
        made.append(1)
        return Scripted()

    padded, plain = run(model, counted, padding=1), run(model, Scripted)
    assert len(made) == 4 and [ep.error is not None for ep in padded.episodes] == [False] * 4 + [True] * 2
    assert all(ep.turns == 0 and "padding" in ep.error for ep in padded.episodes[4:])
    np.testing.assert_array_equal(padded.tokens[:4], plain.tokens[:4])
    assert (padded.lengths[4:] <= 4).all()  # segment_steps


def test_episodes_on_a_mesh_equal_one_device(model):
    """Slots split over the mesh's row shards (each shard's episodes park and come back within
    it) give the one-device trajectories: each sequence draws with its own uniforms."""
    from grpo_jax.config import MeshConfig
    from grpo_jax.runtime.sharding import make_mesh, place_model

    examples = [*EXAMPLES, {"prompt": "Subtract 1 from 9."}]
    limits = EpisodeLimits(max_turns=2, max_env_tokens=40, max_model_tokens=16, timeout_s=10.0)

    def go(m, mesh, delay_s=0.8, **kw):
        # 0.8 s: longer than a segment of 4 decode steps on the mesh even on a loaded machine
        # (at 0.3 s a CI run's environments answered before the poll and nothing parked).
        return run_episodes(m, examples, TOK, lambda: Scripted(delay_s=delay_s), config(slots=4, max_new_tokens=16, **kw),
                            limits, jax.random.key(5), segment_steps=4, mesh=mesh)

    alone = go(model, None, delay_s=0.3)  # the reference trajectories: the delay changes when, not what
    # 4 of the 8 devices: two row shards of two slots, the model split over the other axis too.
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
    sharded = Transformer(tiny("qwen3", vocab_size=len(TOK)), rngs=nnx.Rngs(0))
    place_model(sharded, mesh)
    # The paged engine's too: each row shard its own pool, its own preempted and parked episodes.
    for split in (go(sharded, mesh), go(sharded, mesh, engine="paged", page_size=8)):
        assert split.parks > 0  # a slow environment's episode makes way for its shard-mates
        for name in ("tokens", "lengths", "env"):
            np.testing.assert_array_equal(getattr(split, name), getattr(alone, name), err_msg=name)
        np.testing.assert_allclose(split.logprobs, alone.logprobs, atol=1e-5)
        assert [ep.transcript for ep in split.episodes] == [ep.transcript for ep in alone.episodes]


def test_bad_openings_and_answers_fail_only_their_episodes_counted_by_reason(model):
    """Issue 44: under a template that requires alternating roles, an opening of two user messages,
    a 5,000-character opening and lone surrogates in `reset` or `step` used to crash the batch;
    each now fails its own episodes only (counted by reason, shown in one line), an 8 MB answer ends
    its episode as truncated, and `<eos>` a tool writes is fed as characters. The good episodes are
    token for token those of a batch without the bad ones."""
    from grpo_jax.rollout.episode_source import failure_line

    alternating = ("{% for m in messages %}{% if loop.index0 and m.role == 'user' and messages[loop.index0 - 1].role"
                   " == 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}"
                   "{{ '[' + m.role + ']' + m.content + eos_token + '\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}")
    tok = char_tokenizer(add_bos=True, chat_template=alternating)

    class Bad(Scripted):
        def reset(self, example):
            self.prompt, kind = example["prompt"], example.get("kind")
            return {"twice": [{"role": "user", "content": "Hi."}] * 2, "long": [{"role": "user", "content": "9" * 5000}],
                    "surrogate": [{"role": "user", "content": "caf\udce9"}]}.get(kind, super().reset(example))

        def step(self, completion):
            kind = {"Tell": "surrogate", "Echo": "eos", "Flood": "huge"}.get(self.prompt.split()[0])
            if kind:
                content = {"surrogate": "\ud800", "eos": "a<eos>b", "huge": "x" * 8_000_000}[kind]
                return EnvStep([{"role": "tool", "content": content}])
            return super().step(completion)

    bad = [{"prompt": "A", "kind": "twice"}, {"prompt": "B", "kind": "long"}, {"prompt": "C", "kind": "surrogate"},
           {"prompt": "Tell me."}, {"prompt": "Echo me."}, {"prompt": "Flood me."}]
    batch = run_episodes(model, EXAMPLES + bad, tok, Bad, config(), LIMITS, jax.random.key(3), segment_steps=4)
    clean = run_episodes(model, EXAMPLES * 3, tok, Bad, config(), LIMITS, jax.random.key(3), segment_steps=4)
    eps = batch.episodes
    reasons = [ep.failure for ep in eps[6:]]
    assert reasons[:6] == ["template"] * 2 + ["too_long"] * 2 + ["malformed"] * 2
    assert "roles must alternate" in eps[6].error and "more than 40 tokens" in eps[8].error
    answered = [ep.model_tokens < LIMITS.max_model_tokens for ep in eps]  # else the budget ended the turn
    for ep, asked in zip(eps[12:14], answered[12:14]):  # a surrogate in step's answer
        assert ep.failure == "malformed" if asked else ep.truncated and ep.error is None
    for ep in eps[:6] + eps[14:]:  # the good ones, the tool's "<eos>" and the 8 MB answer: no error
        assert ep.error is None and ep.failure is None and ep.done
    for ep, asked in zip(eps[14:16], answered[14:16]):
        if asked:  # the tool's "<eos>" is five characters; the template's are the token
            fed = [i for i, m in zip(ep.ids, ep.loss_mask) if m == 0]
            text = "".join(t["env"] for t in ep.transcript)
            assert "[tool]a<eos>b<eos>\n[assistant]" in text and TOK.decode(fed) == text
            assert fed.count(TOK.eos_token_id) == text.count("<eos>") - text.count("a<eos>b")
    assert any(answered[12:14]) and any(answered[14:16])
    for ep in eps[16:18]:  # the 8 MB answer ends the episode as over max_env_tokens
        assert ep.truncated and ep.turns == 1 and ep.env_tokens == 0
    m = batch.metrics()
    n_failed = sum(ep.error is not None for ep in eps)
    assert m["env/failed"] == m["env/errors"] == n_failed == batch.failed.sum() and m["env/failed/template"] == 2
    assert m["env/failed/too_long"] == 2 and m["env/failed/malformed"] == n_failed - 4
    assert m["env/failed/raised"] == m["env/failed/timeout"] == m["env/failed/padding"] == 0
    line = failure_line(eps)
    assert line.startswith(f"the environment failed {n_failed} of 18 episodes (dropped; ") and "2 template" in line
    assert "\n" not in line and "2 too_long" in line
    for name in ("tokens", "lengths", "env"):
        np.testing.assert_array_equal(getattr(batch, name)[:6], getattr(clean, name)[:6], err_msg=name)
    # the same draws; log-probs to float rounding (other rows change how XLA:CPU blocks the batch's matmuls)
    np.testing.assert_allclose(batch.logprobs[:6], clean.logprobs[:6], rtol=0, atol=1e-5)
