"""The pinned public API (DESIGN.md, "Public API"): the names and keywords that docs and external
checks call, exercised by keyword so that a rename fails here first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


from grpo_jax.models import Transformer
from grpo_jax.models.presets import tiny
from grpo_jax.engine.sampling import Rollout, check_rollout, pad_prompts

# --- models and sampling

PROMPTS = [[5, 9, 13, 40], [22, 23]]


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))


def test_model_call_by_keyword(model):
    ids, mask = pad_prompts(PROMPTS, (6,), 0)  # left-padded: row 1 has 4 pads
    by_keyword = model(input_ids=ids, positions=None, attention_mask=mask)
    assert by_keyword.shape == (2, 6, model.config.vocab_size) and by_keyword.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(by_keyword), np.asarray(model(ids, None, mask)))
    # positions=None counts real tokens only: the same as explicit positions, and as the row unpadded.
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    explicit = model(input_ids=ids, positions=positions, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(explicit), np.asarray(by_keyword), atol=1e-6)
    alone = model(input_ids=np.asarray([PROMPTS[1]], np.int32))
    np.testing.assert_allclose(np.asarray(by_keyword)[1, -2:], np.asarray(alone)[0], atol=1e-5)
    h = model.hidden_states(input_ids=ids, positions=positions, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(model.logits(h)), np.asarray(by_keyword), atol=1e-6)


def test_prefill_and_decode_step_by_keyword(model):
    ids, mask = pad_prompts(PROMPTS, (6,), 0)
    logits, cache = model.prefill(input_ids=ids, attention_mask=mask, decode_steps=2)
    full = model(input_ids=ids, attention_mask=mask)
    assert logits.shape == (2, 6, model.config.vocab_size)
    np.testing.assert_allclose(np.asarray(logits)[mask == 1], np.asarray(full)[mask == 1], atol=1e-5)
    step = np.asarray([7, 8], np.int32)
    step_logits, cache = model.decode_step(input_ids=step, cache=cache)
    assert step_logits.shape == (2, model.config.vocab_size) and int(cache.length) == 1
    longer = model(input_ids=np.concatenate([ids, step[:, None]], axis=1),
                   attention_mask=np.concatenate([mask, np.ones((2, 1), np.int32)], axis=1))
    np.testing.assert_allclose(np.asarray(step_logits), np.asarray(longer)[:, -1], atol=1e-5)


def test_generate_by_keyword(model):
    from grpo_jax import SamplingConfig, generate

    config = SamplingConfig(group_size=3, max_new_tokens=5, prompt_buckets=(8,))
    rollout = generate(model=model, prompts=PROMPTS, config=config, rng=jax.random.key(0))
    assert isinstance(rollout, Rollout)
    assert rollout.tokens.shape == rollout.logprobs.shape == rollout.mask.shape == (6, 5)
    assert rollout.lengths.shape == rollout.truncated.shape == (6,)
    assert rollout.prompt_ids.shape == rollout.prompt_mask.shape == (2, 8)
    assert rollout.group_size == 3
    check_rollout(rollout, rows=6, max_new_tokens=5)


# --- the package's main API, the advantages, the config and the loop -------------------------------

def test_the_package_exports_the_main_api_lazily():
    import subprocess
    import sys

    import grpo_jax

    expected = {"from_pretrained", "save_pretrained", "generate", "SamplingConfig", "group_advantages", "gae",
                "policy_loss", "get_reward_fn", "RunConfig", "load_config", "train", "mesh_device_grid",
                "Environment", "EnvStep", "RunResult"}
    assert set(grpo_jax.__all__) == expected and expected <= set(dir(grpo_jax))
    from grpo_jax import config, models
    from grpo_jax.learner import grpo
    from grpo_jax.engine import sampling
    from grpo_jax.trainer import loop as trainer

    assert grpo_jax.from_pretrained is models.from_pretrained and grpo_jax.save_pretrained is models.save_pretrained
    assert grpo_jax.generate is sampling.generate and grpo_jax.group_advantages is grpo.group_advantages
    assert grpo_jax.SamplingConfig is config.SamplingConfig and grpo_jax.RunConfig is config.RunConfig
    assert grpo_jax.load_config is config.load_config and grpo_jax.train is trainer.train
    from grpo_jax import env
    assert grpo_jax.Environment is env.Environment and grpo_jax.EnvStep is env.EnvStep
    assert grpo_jax.EnvStep(messages=[], reward=None, done=True).done
    from grpo_jax import rewards
    from grpo_jax.learner import ppo

    assert grpo_jax.gae is ppo.gae and grpo_jax.policy_loss is grpo.policy_loss
    assert grpo_jax.get_reward_fn is rewards.get_reward_fn
    from grpo_jax.runtime import sharding

    assert grpo_jax.mesh_device_grid is sharding.mesh_device_grid
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        grpo_jax.nope  # noqa: B018
    code = "import sys, grpo_jax; grpo_jax.RunConfig; print('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_mesh_device_grid_by_keyword():
    from grpo_jax import mesh_device_grid
    from grpo_jax.config import MeshConfig

    # One process of 8 CPU devices: their own order, shaped [data, fsdp, expert, tensor] with -1
    # resolved. (Pod layouts with fake devices: tests/runtime/test_mesh_grid.py.)
    grid = mesh_device_grid(mesh_config=MeshConfig(data=2, fsdp=-1, tensor=2), devices=jax.devices())
    assert isinstance(grid, np.ndarray) and grid.shape == (2, 2, 1, 2) and list(grid.flat) == jax.devices()


def test_group_advantages_by_keyword():
    from grpo_jax import group_advantages

    rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    out = group_advantages(rewards=rewards, group_size=4, scale="none", estimator="rloo")
    # RLOO: r_i minus the mean of the group's other rewards.
    np.testing.assert_allclose(np.asarray(out.advantages), [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0], rtol=1e-6)
    assert np.asarray(out.zero_std).tolist() == [False, True] and bool(np.asarray(out.valid).all())
    bessel = group_advantages(rewards=rewards, group_size=4, scale="group", estimator="grpo", eps=0.0, ddof=1)
    np.testing.assert_allclose(np.asarray(bessel.advantages)[:4], np.array([0.75, -0.25, -0.25, -0.25]) / 0.5,
                               rtol=1e-6)  # the group's sample std (ddof 1) is 0.5


def test_gae_by_keyword():
    from grpo_jax import gae

    # One row, reward 1 on its last real token, values 0.5: with gamma = lam = 1 the advantage of
    # every token is the return minus its value.
    adv, ret = gae(rewards=jnp.asarray([[0.0, 1.0, 0.0]]), values=jnp.full((1, 3), 0.5),
                   mask=jnp.asarray([[1, 1, 0]]), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(np.asarray(adv), [[0.5, 0.5, 0.0]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), [[1.0, 1.0, 0.0]], atol=1e-6)


def test_load_config_and_train_by_keyword(tmp_path):
    import yaml

    from grpo_jax import RunConfig, load_config, train
    from grpo_jax.config import ConfigError

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "no_model")}, "rewards": [{"name": "format"}],
                                    "data": {"data_dir": str(tmp_path / "tfds")}}))
    config = load_config(path=path, overrides=["train.steps=3"])
    assert isinstance(config, RunConfig) and config.train.steps == 3
    with pytest.raises((ConfigError, FileNotFoundError), match="no_model"):
        train(config=config, run_dir=tmp_path / "run", hooks=(), log=lambda line: None)
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


def test_from_pretrained_and_save_pretrained_by_keyword(tmp_path):
    from grpo_jax import from_pretrained, save_pretrained
    from grpo_jax.models import Transformer
    from grpo_jax.models.presets import tiny

    model = Transformer(tiny("llama"), rngs=nnx.Rngs(0))
    save_pretrained(model=model, path=tmp_path / "hf")
    loaded = from_pretrained(path=tmp_path / "hf", dtype=jnp.float32, param_dtype=jnp.float32)
    ids = jnp.asarray([[1, 5, 9, 3]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(input_ids=ids)), np.asarray(model(input_ids=ids)))


def test_reward_models_and_their_scorer_by_keyword(tmp_path):
    from grpo_jax.data import char_tokenizer
    from grpo_jax.models.presets import tiny
    from grpo_jax.models.reward_model import RewardModel, load_reward_model, save_reward_model
    from grpo_jax.rewards import RewardModelReward, parse_score

    model = RewardModel(tiny("qwen3"), pad_token_id=0, num_labels=1, rngs=nnx.Rngs(0))
    save_reward_model(model=model, path=tmp_path / "rm", tokenizer=char_tokenizer(add_bos=True))
    loaded = load_reward_model(path=tmp_path / "rm", dtype=jnp.float32, param_dtype=jnp.float32)
    ids = jnp.asarray([[1, 5, 9, 3], [1, 7, 0, 0]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(input_ids=ids, attention_mask=ids != 0)),
                                  np.asarray(model(input_ids=ids, attention_mask=ids != 0)))
    scorer = RewardModelReward(path=str(tmp_path / "rm"), batch_size=2, normalize=False, max_length=16)
    assert len(scorer(prompts=["1+1=", "1+1="], completions=["2", "2 and some more than sixteen"])) == 2
    assert scorer.truncated == 1  # cut to its last 16 tokens, and counted
    assert parse_score(text="Score: 5", pattern=r"score:\s*(\d+)", max_score=10.0) == 0.5


def test_policy_loss_by_keyword():
    from grpo_jax import policy_loss
    from grpo_jax.config import GRPOConfig

    # mu = 1 (old == current): ratio 1, so the loss is minus the mean advantage over the valid
    # rows' tokens; the dropped row (valid False) and the KL term at ref == current add nothing.
    logp = jnp.full((3, 2), -1.0)
    loss, sums = policy_loss(logprobs=logp, old_logprobs=logp, advantages=jnp.asarray([1.0, -0.5, 7.0]),
                             mask=jnp.ones((3, 2), jnp.int32), config=GRPOConfig(beta=0.1),
                             valid=jnp.asarray([True, True, False]), truncated=jnp.zeros(3, bool),
                             ref_logprobs=logp, entropy=jnp.zeros((3, 2)), normaliser=None, sampler_logprobs=logp)
    np.testing.assert_allclose(float(loss), -(1.0 - 0.5) / 2, rtol=1e-6)
    assert float(sums["tokens"]) == 4.0 and float(sums["kl/k3"]) == 0.0


def test_get_reward_fn_by_keyword(tmp_path):
    from grpo_jax import get_reward_fn

    assert get_reward_fn(name="math_accuracy")(prompts=["1+1="], completions=["2"], answer=["2"]) == [1.0]
    (tmp_path / "mine.py").write_text("def shout(prompts, completions, **fields):\n"
                                      "    return [float(c.isupper()) for c in completions]\n")
    assert get_reward_fn(name=f"{tmp_path / 'mine.py'}:shout")(prompts=["a", "b"], completions=["HI", "hi"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="did you mean 'math_accuracy'"):
        get_reward_fn(name="math_acuracy")
