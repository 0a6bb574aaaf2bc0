"""The trainer on a mesh and in pmap mode runs the same GRPO steps as on one device."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from grpo_jax.checkpoint import load_policy
from grpo_jax.config import ConfigError, apply_overrides, config_from_dict
from grpo_jax.trainer import train
from test_trainer import CONFIG

LR = 1e-3


def run(tmp_path, name, *overrides):
    cfg = copy.deepcopy(CONFIG)
    cfg["data"]["data_dir"] = str(tmp_path / "tfds")
    cfg["data"]["prompts_per_step"] = 8
    cfg["sft"] = {"steps": 0}
    # A large Adam epsilon: with the default 1e-8, Adam's first steps, lr * g / (|g| + eps), turn
    # float-rounding differences of near-zero gradients into lr-sized ones and hide what is compared.
    cfg["train"].update(steps=2, warmup_steps=0, learning_rate=LR, samples_every=0, adam_eps=1e-3)
    cfg["eval"] = {"num_prompts": 8, "k": 8}  # the train step's sampling shape: no extra compile
    cfg["grpo"]["beta"] = 0.01
    seen = []
    train(config_from_dict(apply_overrides(cfg, list(overrides))), tmp_path / name,
          hooks=[lambda step, m: seen.append(m)], log=lambda line: None)
    params = jax.tree.leaves(jax.tree.map(np.asarray, load_policy(tmp_path / name)[0]))
    return seen, params


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    return {name: run(tmp, name, *overrides) for name, overrides in {
        "one": (), "mesh": ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), "pmap": ("parallelism=pmap",)}.items()}


@pytest.mark.parametrize("mode", ["mesh", "pmap"])
def test_same_steps_as_one_device(runs, mode):
    ref_metrics, ref_params = runs["one"]
    metrics, params = runs[mode]
    assert len(metrics) == len(ref_metrics) == 2
    for m, r in zip(metrics, ref_metrics):
        for key in ("reward/mean", "completion/len_mean", "train/loss", "kl/k3", "policy/entropy"):
            assert m[key] == pytest.approx(r[key], abs=1e-5), key
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(params, ref_params)])
    assert diffs.max() <= 1e-5, (diffs.mean(), diffs.max())
    assert metrics[1]["kl/k3"] > 0  # the policy did move away from the reference


def test_a_batch_that_does_not_split_over_the_devices_fails_before_compiling(tmp_path):
    cfg = copy.deepcopy(CONFIG)
    cfg["data"]["prompts_per_step"] = 6
    with pytest.raises(ConfigError, match="multiple of the 8 ways"):
        train(config_from_dict(apply_overrides(cfg, ["parallelism=pmap"])), tmp_path / "x")
    with pytest.raises(ConfigError, match="not divisible by 3"):
        train(config_from_dict(apply_overrides(cfg, ["mesh.data=3", "mesh.fsdp=-1"])), tmp_path / "y")
