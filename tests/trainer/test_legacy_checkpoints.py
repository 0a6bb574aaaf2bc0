"""Checkpoints written before the run's state was typed (meta version 0: `data`, `pairs`, ... as
plain keys) still restore and resume. `legacy_checkpoints/` holds a GRPO run and a reward-model run
that code (d541605) wrote: a 1-layer, 16-wide model, 2 steps, their step-2 checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax import load_config, train
from grpo_jax.config import load_rm_config
from grpo_jax.observe.writers import read_metrics
from grpo_jax.trainer.checkpoint import Checkpointer, find_run, load_policy, read_meta
from grpo_jax.trainer.reward_run import train_reward_model
from grpo_jax.trainer.run_state import CheckpointMeta

LEGACY = Path(__file__).resolve().parent / "legacy_checkpoints"


def _newest_meta(run: Path) -> CheckpointMeta:
    with Checkpointer(run / "checkpoints") as checkpointer:
        return checkpointer.restore_meta(checkpointer.all_steps()[0])


def _abs_sums(tree) -> list[float]:
    return sorted(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(tree))


def test_an_untyped_grpo_checkpoint_restores_and_resumes(tmp_path):
    run = shutil.copytree(LEGACY / "grpo_run", tmp_path / "run")
    meta = read_meta(find_run(run))
    assert (meta.version, meta.step, meta.seed, set(meta.components)) == (CheckpointMeta.VERSION, 2, 0, {"data"})
    (data,) = meta.components["data"]  # one process's prompt stream: 2 steps of 4 prompts read
    assert data["rows_read"] == 8 and data["sampler"]["position"] == 8
    # The policy as eval/export read it: the saved arrays (orbax's own reading, without our targets).
    model, _, files = load_policy(run)
    saved = ocp.PyTreeCheckpointer().restore(run / "checkpoints" / "2" / "params")
    assert files.step == 2 and np.allclose(_abs_sums(saved), _abs_sums(jax.tree.map(np.asarray, model)), rtol=1e-6)

    lines = []
    result = train(load_config(run / "config.yaml", ["train.steps=3", "train.resume=true",
                                                     f"data.data_dir={tmp_path / 'tfds'}"]), run, log=lines.append)
    assert f"resumed from the checkpoint of step 2 in {run}" in lines, lines
    assert result.stopped is None and result.step == 3 and len(result.reward) == 1
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    new = read_meta(find_run(run))  # written in this code's format: the stream went on from where it was
    assert new.step == 3 and new.components["data"][0]["rows_read"] == 12 and "rewards" in new.components


def test_an_untyped_reward_model_checkpoint_resumes_its_pair_stream(tmp_path):
    run = shutil.copytree(LEGACY / "rm_run", tmp_path / "rm")
    assert _newest_meta(run).components == {"pairs": ({"orders": 1, "cursor": 8},)}
    config = load_rm_config(run / "config.yaml", ["train.steps=3", "train.resume=true",
                                                  f"data.data_dir={tmp_path / 'tfds'}"])
    result = train_reward_model(config, run, log=lambda line: None)
    assert result.stopped is None and result.step == 3 and 0 <= result.eval_end["rm/pair_accuracy"] <= 1
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    assert _newest_meta(run).components == {"pairs": ({"orders": 1, "cursor": 12},)}
    assert (run / "hf" / "config.json").exists()


def test_the_meta_round_trips_reads_version_0_and_refuses_a_newer_one():
    import pytest

    from grpo_jax.config import ConfigError

    meta = CheckpointMeta(step=4, seed=1, components={"data": ({"a": 1}, {"a": 2}), "rewards": ({}, {})},
                          base={"path": "base"})
    assert CheckpointMeta.from_json(meta.to_json()) == meta
    two_hosts = {"step": 4, "seed": 1, "data": {"a": 1}, "data_by_process": [{"a": 1}, {"a": 2}],
                 "rewards_by_process": [{}, {}], "base": {"path": "base"}}  # as version 0 wrote it
    assert CheckpointMeta.from_json(two_hosts) == meta
    with pytest.raises(ConfigError, match="metadata version 2; this grpo_jax reads up to 1"):
        CheckpointMeta.from_json({**meta.to_json(), "version": 2})
