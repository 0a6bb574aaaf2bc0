"""Pipelined runs (grpo_jax.rollout.pipeline): with `rollout.staleness` k the batch of step t is
sampled with the parameters after step t - 1 - k, exactly (a hand-written loop that samples with
the older parameters gives the same parameters), the staleness is logged, and the sampler on its
own devices (`rollout.sampler_devices`) with k = 0 is the shared synchronous run."""

from __future__ import annotations

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import CONFIG, assert_same_run

from grpo_jax.config import ConfigError, config_from_dict
from grpo_jax.trainer.loop import Trainer
from grpo_jax.trainer.prepare import prepare
from grpo_jax.trainer.setup import build

STEPS = 3


def pipeline_config(lora=None, **rollout):
    cfg = copy.deepcopy(CONFIG)
    if lora:
        cfg["lora"] = lora
    cfg["data"].update(prompts_per_step=8)
    cfg["sft"] = {"steps": 20, "learning_rate": 0.003, "batch_size": 32}
    cfg["train"].update(steps=STEPS, samples_every=0)
    cfg["eval"] = {"every": 0, "num_prompts": 4, "k": 2}
    cfg["checkpoint"] = {"every": 2}
    cfg["mesh"] = {"data": 4, "fsdp": 1, "tensor": 1}
    cfg["rollout"] = rollout
    return config_from_dict(cfg)


def params_of(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def trained(tmp_path, name, lora=None, **rollout):
    trainer = Trainer(pipeline_config(lora, **rollout), tmp_path / name, log=lambda line: None)
    trainer.run()
    rows = [r for r in map(dict, _metrics(tmp_path / name)) if "train/loss" in r]
    return params_of(trainer.built.learner.params(trainer.state)), rows


def _metrics(run_dir):
    from grpo_jax.observe.writers import read_metrics
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("stale")
    return (*trained(root, "run", staleness=1), root / "run")


def test_staleness_one_equals_a_loop_that_samples_with_the_older_parameters(stale_run, tmp_path):
    got, rows, _ = stale_run
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]  # steps 1 and 2: the starting parameters
    # The reference: the run's own pieces, driven by hand.
    prepared = prepare(pipeline_config())
    b = build(prepared, run_dir=tmp_path / "ref", saved_base=None, resuming=False, log=lambda line: None)
    sampler, learner, state = b.source, b.learner, b.state
    start = params_of(learner.params(state))

    def sample_with(params, step):
        sampler.sync(jax.tree.map(jnp.copy, params))
        return sampler.next(step)

    theta = {0: jax.tree.map(jnp.copy, learner.params(state))}
    batches = {1: sample_with(theta[0], 1), 2: sample_with(theta[0], 2)}
    for t in range(1, STEPS + 1):
        state, _ = learner.update(state, batches.pop(t))
        theta[t] = jax.tree.map(jnp.copy, learner.params(state))
        if t + 1 + 1 <= STEPS:
            batches[t + 2] = sample_with(theta[t], t + 2)  # step t + 2's batch: the parameters after step t
    want = params_of(learner.params(state))
    assert any(not np.array_equal(a, b) for a, b in zip(start, want))  # the updates moved the parameters
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_sampler_on_its_own_devices_is_the_synchronous_run(tmp_path):
    shared, _ = trained(tmp_path, "shared")
    split, rows = trained(tmp_path, "split", sampler_devices=4)
    assert all(r["rollout/staleness"] == 0.0 and r["perf/weight_sync_s"] > 0 for r in rows)
    for a, b in zip(split, shared):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_with_lora_only_the_adapters_go_to_the_sampler_which_merges_them(tmp_path):
    """The learner's adapters are all that moves after an update; on its own devices the sampler
    folds them into its copy of the base and samples the learner's policy (the sampler-vs-trainer
    log-prob check stays at float rounding)."""
    split, rows = trained(tmp_path, "split", lora={"rank": 4, "alpha": 8.0}, sampler_devices=4)
    adapters = sum(a.nbytes for a in split)  # what the learner trains: the adapters
    assert all(r["perf/weight_sync_bytes"] == adapters for r in rows)
    assert adapters < sum(v.nbytes for v in jax.tree.leaves(CONFIG_PARAMS(tmp_path / "split"))) / 4
    assert all(r["health/sampler_train_logprob_diff"] < 1e-5 for r in rows)
    # The adapters moved the policy from the base (so a sampler left on the base would differ).
    assert rows[-1]["kl/k3"] > 1e-6


def CONFIG_PARAMS(run_dir):
    from grpo_jax.trainer.checkpoint import load_policy
    from flax import nnx
    return nnx.state(load_policy(run_dir)[0], nnx.Param)


def test_a_pipeline_that_cannot_run_is_refused(tmp_path):
    for rollout, message in [({"staleness": -1}, "rollout.staleness must be >= 0"),
                             ({"sampler_devices": 3}, "multiple of rollout.sampler_devices=3")]:
        with pytest.raises((ConfigError, ValueError), match=message):
            prepare(pipeline_config(**rollout))


def test_a_resumed_stale_run_equals_the_uninterrupted_one(stale_run, tmp_path):
    """Stopped after step 2's checkpoint, whose batch in flight (step 3's, sampled with the
    parameters after step 1) the checkpoint holds the parameters of: the rerun samples it again
    and ends where the uninterrupted run ended."""
    got, _, run_dir = stale_run
    stopped = tmp_path / "stopped"
    shutil.copytree(run_dir, stopped)
    shutil.rmtree(stopped / "checkpoints" / str(STEPS))
    lines = (stopped / "metrics.jsonl").read_text().splitlines()
    (stopped / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= 2))
    trainer = Trainer(pipeline_config(staleness=1), stopped, log=lambda line: None)
    trainer.run()
    for a, b in zip(params_of(trainer.built.learner.params(trainer.state)), got):
        np.testing.assert_array_equal(a, b)
    assert_same_run(run_dir, stopped)


def test_a_stale_checkpoint_is_not_resumed_by_a_synchronous_run(stale_run, tmp_path):
    _, _, run_dir = stale_run
    copy_dir = tmp_path / "copy"
    shutil.copytree(run_dir, copy_dir)
    shutil.rmtree(copy_dir / "checkpoints" / str(STEPS))
    config = (copy_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="rollout.staleness > 0"):
        Trainer(pipeline_config(), copy_dir, log=lambda line: None).run()
    assert (copy_dir / "config.yaml").read_text() == config  # refused before anything was written
