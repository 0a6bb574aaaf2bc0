"""The trainer tests' shared run: a tiny config that learns 1-digit addition in ~1 minute, and
helpers to compare run directories (used by tests/trainer, tests/models, tests/tools, ...)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import yaml

from grpo_jax.observe.writers import read_metrics

# 1-digit addition, a tiny model, a short warm start: enough signal for a visible rise in ~1 minute.
CONFIG = {
    "model": {"tokenizer": "char",
              "architecture": {"family": "qwen3", "hidden_size": 64, "intermediate_size": 192, "num_layers": 2,
                               "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "qk_norm": True}},
    "data": {"name": "arithmetic", "builder_config": "tiny",
             "builder_kwargs": {"ops": ["+"], "formats": ["{a}{op}{b}="], "num_train": 80, "num_test": 20},
             "max_prompt_tokens": 8, "prompts_per_step": 32},
    "rewards": [{"name": "math_accuracy"}],
    "sampling": {"group_size": 8, "max_new_tokens": 3, "temperature": 1.0, "prompt_buckets": [8]},
    "grpo": {"epsilon_high": 0.28, "beta": 0.01},  # beta: a resumed run restores its KL reference too
    "sft": {"steps": 60, "learning_rate": 0.003, "batch_size": 32},
    "train": {"steps": 40, "seed": 0, "learning_rate": 0.001, "warmup_steps": 5, "samples_every": 10,
              "progress": False},
    "eval": {"every": 20, "num_prompts": 20, "k": 8},
    "checkpoint": {"every": 20},
    # One device: these runs test the loop, not the mesh (a config without a mesh section uses every
    # device; tests/trainer/test_multihost.py runs the loop on meshes and on two hosts).
    "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
}


def write_config(tmp_path, config, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def assert_same_run(reference, run) -> None:
    """Two run directories logged the same steps once each, with equal metrics (timings aside:
    perf/*, env/time_s, and on multi-turn runs env/parks and engine/*: an episode parks when its
    environment, in a worker process, has not answered by the next poll, which moves its pages;
    the trajectories are the same either way), and their final checkpoints hold equal parameters."""
    from grpo_jax.trainer.checkpoint import load_policy

    ref, got = read_metrics(reference), read_metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for r, g in zip(ref, got):
        timed = ("perf/", "env/time_s", "env/parks", "engine/") if "env/parks" in r else ("perf/",)
        for key, value in r.items():
            if not key.startswith(timed):  # timings
                assert g[key] == pytest.approx(value, abs=1e-6, nan_ok=True), (r["step"], key)
    a = jax.tree.leaves(jax.tree.map(np.asarray, load_policy(reference)[0]))
    b = jax.tree.leaves(jax.tree.map(np.asarray, load_policy(run)[0]))
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-6


def snapshot(run_dir) -> dict[str, bytes]:
    """Every file of a run directory but its logs: config.yaml, model/ and checkpoints/."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and (p.name == "config.yaml" or p.parts[len(run_dir.parts)] in ("model", "checkpoints"))}


def stopped_copy(out, copy, *, logged_through: int):
    """A copy of the finished run `out` as if stopped after step `logged_through`: its step-40
    checkpoint gone (step 20's is the newest) and only the logs up to that step."""
    import shutil

    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints" / "40")
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("".join(line + "\n" for line in lines
                                                if json.loads(line)["step"] <= logged_through))
    return copy
