"""The training loop end to end: reward rises, files land, checkpoints export and evaluate; bad input
fails before anything is compiled."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from grpo_jax import cli
from grpo_jax.observe.writers import read_metrics
from runs import CONFIG, assert_same_run, snapshot, stopped_copy, write_config

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp / "tfds")}}
    path = write_config(tmp, config)
    out = tmp / "run"
    assert cli.main(["train", "--config", path, "--output", str(out)]) == 0
    return path, out


def test_mean_reward_rises(run):
    _, out = run
    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 41))
    early, late = [r["reward/mean"] for r in rows[:10]], [r["reward/mean"] for r in rows[-10:]]
    first, last = np.mean(early), np.mean(late)
    # A bound from the run's own noise, not a margin fitted on one CPU (float sums differ between
    # machines: this seed measured 0.23 -> 0.40 on one and 0.283 -> 0.347 on another): the rise must
    # exceed three standard errors of the difference of the two windows' means, each window's from
    # the spread of its 10 steps' mean rewards (256 samples a step).
    se = np.sqrt(np.var(early, ddof=1) / len(early) + np.var(late, ddof=1) / len(late))
    assert last - first > 3 * se, (first, last, se)


def test_run_directory_has_metrics_samples_tensorboard_plot_and_checkpoints(run):
    _, out = run
    rows = read_metrics(out)
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]  # the evaluation before training
    step = next(r for r in rows if r["step"] == 20)
    for key in ("reward/mean", "reward/std", "reward/math_accuracy/mean", "groups/frac_zero_std",
                "advantage/mean", "advantage/std", "advantage/abs_max", "policy/clip_frac_low",
                "policy/clip_frac_high", "policy/ratio_max", "policy/entropy", "completion/len_mean",
                "completion/len_max", "completion/truncated_frac", "train/loss", "train/grad_norm",
                "train/skipped_steps", "eval/accuracy", "eval/pass@k", "perf/step_s",
                "perf/sample_tokens_per_s", "perf/train_tokens_per_s"):
        assert key in step, key
    assert 0.0 <= step["eval/accuracy"] <= step["eval/pass@k"] <= 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {10, 20, 30, 40}
    assert all("completion" in s and "reward" in s for s in samples)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["plot", str(out), "--out", str(out / "again.png")]) == 0
    assert (out / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]


def test_eval_of_the_final_checkpoint_reproduces_the_trainers_evaluation(run, capsys):
    path, out = run
    capsys.readouterr()
    assert cli.main(["eval", "--config", path, "--checkpoint", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = [r for r in read_metrics(out) if "eval/accuracy" in r][-1]
    assert result["step"] == 40 == final["step"]
    assert result["eval/accuracy"] == pytest.approx(final["eval/accuracy"])
    assert result["eval/pass@k"] == pytest.approx(final["eval/pass@k"])


def test_export_writes_a_model_transformers_loads_with_the_same_logits(run, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_jax.trainer.checkpoint import load_policy

    _, out = run
    hf_dir = tmp_path / "hf"
    assert cli.main(["export", "--checkpoint", str(out / "checkpoints" / "20"), "--out", str(hf_dir)]) == 0
    ours, tokenizer, files = load_policy(out / "checkpoints" / "20")
    assert files.step == 20
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = hf_tok("3+4=", add_special_tokens=False)["input_ids"]
    assert ids == tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jax.numpy.asarray([ids]))), theirs, atol=1e-4)
    # The exported step is the checkpoint's, not the model the run started from.
    last, _, _ = load_policy(out)
    assert any(float(np.abs(np.asarray(a) - np.asarray(b)).max()) > 0
               for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, ours)),
                               jax.tree.leaves(jax.tree.map(np.asarray, last))))


@pytest.fixture
def compiles():
    """Names of XLA compilations that happen while the test runs."""
    events = []
    active = [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: events.append(name) if active[0] and name.endswith("backend_compile_duration") else None)
    yield events
    active[0] = False


@pytest.mark.parametrize("change,message", [
    ({"train": {"stepz": 3}}, "unknown key 'stepz' in train (did you mean 'steps'?)"),
    ({"model": {"path": "/nonexistent/model"}}, "model path '/nonexistent/model' is not a directory"),
    ({"data": {"name": "gsm8k", "manual_dir": "MANUAL"}}, "train.jsonl"),
    ({"rewards": [{"name": "math_acuracy"}]}, "did you mean 'math_accuracy'"),
    ({"data": {"name": "arithmetc"}}, "arithmetic"),
])
def test_bad_input_fails_before_any_compile_with_a_message(tmp_path, capsys, compiles, change, message):
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")}}
    for section, values in change.items():
        if isinstance(values, dict) and section in config:
            merged = {**config[section], **values}
            if section == "model" and "path" in values:
                merged.pop("architecture")
            if section == "data" and values.get("name") == "gsm8k":
                merged.pop("builder_config"), merged.pop("builder_kwargs")
                (tmp_path / "manual").mkdir()
                merged["manual_dir"] = str(tmp_path / "manual")
            config[section] = merged
        else:
            config[section] = values
    path = write_config(tmp_path, config)
    rc = cli.main(["train", "--config", path, "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err, err
    assert compiles == [], compiles


def test_dynamic_sampling_drops_uniform_groups_and_fills_without_gradient(tmp_path):
    from grpo_jax.config import config_from_dict
    from grpo_jax.trainer.loop import train

    # Three-character completions never have the reasoning the format reward asks for: every group
    # is uniform (all 0), every round is dropped, the batch is all filler, and the update carries no
    # gradient. In pmap mode (8 local devices, one prompt each), so the trainer's pmap path runs
    # end to end too (its update equals the jit mode's in tests/learner/test_parallel.py). The static
    # engine resamples in rounds (the others over-sample in one pass: the test below).
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds"), "prompts_per_step": 8},
              "sampling": {**CONFIG.get("sampling", {}), "engine": "static"},
              "rewards": [{"name": "format"}],
              "sft": {"steps": 0}, "parallelism": "pmap",
              "train": {**CONFIG["train"], "steps": 2, "dynamic_sampling": True, "max_resample_rounds": 2,
                        "samples_every": 0},
              "eval": {"num_prompts": 8, "k": 8}, "checkpoint": {}}
    seen = []
    train(config_from_dict(config), tmp_path / "run", hooks=[lambda step, m: seen.append(m)], log=lambda s: None)
    assert len(seen) == 2
    for m in seen:
        assert m["reward/mean"] == 0.0 and m["groups/frac_zero_std"] == 1.0
        assert m["dynamic/rounds"] == 3 and m["dynamic/dropped_groups"] == 24 and m["dynamic/filled_groups"] == 8
        assert m["train/grad_norm"] == 0.0 and m["train/loss"] == 0.0


@pytest.mark.parametrize("engine", ["continuous", "paged"])
def test_the_paged_engine_over_samples_in_one_pass(tmp_path, engine):
    """Dynamic sampling with the paged engine (`continuous`: its reservation per slot): one pass over 1 + max_resample_rounds
    times the step's prompts as candidates. Every group is uniform here (as above), so the engine
    runs every candidate to the end and the batch is all filler, without gradient."""
    from grpo_jax.config import config_from_dict
    from grpo_jax.trainer.loop import train

    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds"), "prompts_per_step": 8},
              "rewards": [{"name": "format"}], "sft": {"steps": 0},
              "sampling": {**CONFIG["sampling"], "engine": engine, "slots": 16, "segment_steps": 2},
              "train": {**CONFIG["train"], "steps": 1, "dynamic_sampling": True, "max_resample_rounds": 2,
                        "samples_every": 0},
              "eval": {"num_prompts": 8, "k": 8}, "checkpoint": {}}
    seen = []
    train(config_from_dict(config), tmp_path / "run", hooks=[lambda step, m: seen.append(m)], log=lambda s: None)
    (m,) = seen
    assert m["dynamic/rounds"] == 1 and m["dynamic/segments"] >= 2
    assert m["dynamic/admitted_groups"] == m["dynamic/finished_groups"] == m["dynamic/dropped_groups"] == 24
    assert m["dynamic/kept_groups"] == 0 and m["dynamic/filled_groups"] == 8 and m["dynamic/in_flight_dropped"] == 0
    assert m["train/grad_norm"] == 0.0 and m["perf/sample_tokens"] > 0
    assert m["engine/preemptions"] == 0  # kv_cache_bytes 0: one reservation per slot, nothing runs short


def test_a_resumed_run_continues_exactly_where_the_uninterrupted_one_went(run, tmp_path, capsys):
    """Preempted after step 33 (its logs written), last checkpoint at step 20: running the same
    command again resumes from step 20, drops the logs of steps 21-33 and ends where the
    uninterrupted run ended, metrics and parameters alike."""
    path, out = run
    copy = stopped_copy(out, tmp_path / "preempted", logged_through=33)
    # A refused start leaves the run directory byte-identical: resuming off, another model, another
    # data layout (each refused before anything is written).
    before = snapshot(copy)
    assert cli.main(["train", "--config", path, "--output", str(copy), "--set", "train.resume=false"]) == 2
    assert "already holds checkpoints (newest: step 20)" in capsys.readouterr().err
    other_model = {**CONFIG, "model": {**CONFIG["model"], "architecture": {**CONFIG["model"]["architecture"],
                                                                           "hidden_size": 32}}}
    other_model["data"] = yaml.safe_load(open(path))["data"]
    assert cli.main(["train", "--config", write_config(tmp_path, other_model, "other.yaml"),
                     "--output", str(copy)]) == 2
    assert "holds a run of another model (hidden_size 64 -> 32)" in capsys.readouterr().err
    assert cli.main(["train", "--config", path, "--output", str(copy), "--set", "train.seed=1"]) == 2
    assert "cannot resume step 20 with this config: sampler state was saved by a sampler with other settings" \
        in capsys.readouterr().err
    assert snapshot(copy) == before
    # A live run holding the directory (a process on this host, its lease fresh) refuses the start.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    host = socket.gethostname()
    try:
        (copy / "run.lock").write_text(json.dumps({"pid": holder.pid, "host": host, "token": "theirs",
                                                   "renewed": time.time(), "started": time.time()}))
        assert cli.main(["train", "--config", path, "--output", str(copy)]) == 2
        err = capsys.readouterr().err
        assert f"is in use by a live run (process {holder.pid} on host {host}, started " in err, err
        assert err.count("\n") == 1 and snapshot(copy) == before
    finally:
        holder.kill()
        holder.wait()
    # Its process gone, the lock is stale: the same command takes it over and resumes.
    assert cli.main(["train", "--config", path, "--output", str(copy)]) == 0
    assert f"taking over the lock of a run that is gone (process {holder.pid} on host {host}" \
        in capsys.readouterr().err
    assert not (copy / "run.lock").exists()  # given back at the end
    assert_same_run(out, copy)  # steps 21-33 logged once, not twice
    assert (copy / "config.yaml").read_bytes() == before["config.yaml"]


def test_a_user_reward_that_raises_is_logged_and_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    # User code by module:function (importable from the working directory) and by file path.
    (tmp_path / "my_rewards_mod.py").write_text(
        "def broken(prompts, completions, **fields):\n"
        "    raise RuntimeError('the checker service is down')\n")
    (tmp_path / "good.py").write_text(
        "import time\n"
        "def digits(prompts, completions, *, bonus=0.0, **fields):\n"
        "    time.sleep(2.0)  # slower than the rest of the step: reported once\n"
        "    return [bonus + sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n")
    monkeypatch.chdir(tmp_path)
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")},
              "rewards": [{"name": "good.py:digits", "kwargs": {"bonus": 0.5}}, {"name": "my_rewards_mod:broken"}],
              "sft": {"steps": 0}, "eval": {"every": 0, "num_prompts": 4, "k": 2, "reward": "good.py:digits"},
              "train": {**CONFIG["train"], "steps": 5, "max_reward_failure_steps": 2}, "checkpoint": {"every": 0}}
    from grpo_jax.config import config_from_dict
    from grpo_jax.trainer.loop import Trainer

    lines = []
    trainer = Trainer(config_from_dict(config), tmp_path / "run", log=lines.append)
    with pytest.raises(RuntimeError, match="'my_rewards_mod:broken' raised on every sample for 2 steps in a row"
                                           ".*RuntimeError: the checker service is down"):
        trainer.run()
    slow = [line for line in lines if "rewards took" in line]
    assert len(slow) == 1 and "rewards took" in slow[0] and "(perf/reward_s)" in slow[0], lines
    failing = [line for line in lines if line.startswith("step ") and "raised on" in line]
    assert len(failing) == 2, lines  # steps 1 and 2, each once
    # The run stops after step 2 with its checkpoint saved, in one line.
    assert lines[-1].startswith("reward function 'my_rewards_mod:broken' raised on every sample for 2 steps") \
        and lines[-1].endswith(f"the run stopped after step 2 of 5, its checkpoint is in {tmp_path / 'run'} (fix the "
                               "cause and run the same command again to resume from it)"), lines[-1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
    assert failing[0].startswith("step 1: reward 'my_rewards_mod:broken' raised on 256 of 256 samples")
    assert failing[0].endswith("RuntimeError: the checker service is down")
    rows = read_metrics(tmp_path / "run")
    assert [r["reward/my_rewards_mod:broken/failures"] for r in rows if "reward/mean" in r] == [256.0, 256.0]
    assert all(r["reward/good.py:digits/mean"] >= 0.5 for r in rows if "reward/mean" in r)  # the bonus kwarg


def test_eval_never_repeats_a_prompt(tmp_path):
    from grpo_jax.config import config_from_dict
    from grpo_jax.trainer.prepare import prepare

    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")},
              "eval": {**CONFIG["eval"], "num_prompts": 50}}  # the test split has 20 rows
    prepared = prepare(config_from_dict(config))
    indices = [ex.index for ex in prepared.eval.examples]
    assert indices == list(range(20))
    assert [n for n in prepared.notes if n.startswith("eval: 20 prompts, not eval.num_prompts=50")]
    config["eval"]["num_prompts"] = 5
    prepared = prepare(config_from_dict(config))
    assert [ex.index for ex in prepared.eval.examples] == list(range(5)) and prepared.notes == ()


def _damage(step_dir, how):
    import shutil

    if how == "truncated data file":
        for f in (step_dir / "params").rglob("d/*"):
            with open(f, "r+b") as fh:
                fh.truncate(8)
    elif how == "garbage _METADATA":
        (step_dir / "params" / "_METADATA").write_text("garbage{")
    elif how == "missing item":
        shutil.rmtree(step_dir / "params")
    elif how == "empty step directory":
        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.mark.parametrize("how", ["truncated data file", "garbage _METADATA", "missing item", "empty step directory"])
def test_export_skips_a_damaged_newest_checkpoint_with_a_warning(run, tmp_path, capsys, how):
    import shutil

    _, out = run
    copy = tmp_path / "damaged"
    shutil.copytree(out, copy)
    _damage(copy / "checkpoints" / "40", how)
    assert cli.main(["export", "--checkpoint", str(copy), "--out", str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 20
    assert f"checkpoint {copy / 'checkpoints' / '40'} is damaged or incomplete" in captured.err
    # A step named on purpose is not swapped for another: its damage is the error.
    assert cli.main(["export", "--checkpoint", str(copy / "checkpoints" / "40"), "--out", str(tmp_path / "x")]) == 2
    assert "no restorable checkpoint" in capsys.readouterr().err


def test_train_and_eval_fall_back_from_a_damaged_newest_checkpoint(run, tmp_path, capsys):
    import shutil

    path, out = run
    copy = tmp_path / "damaged"
    shutil.copytree(out, copy)
    _damage(copy / "checkpoints" / "40", "truncated data file")
    assert cli.main(["eval", "--config", path, "--checkpoint", str(copy)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 20
    assert "is damaged or incomplete" in captured.err
    # train resumes from step 20, sets step 40 aside, and ends where the undamaged run ended.
    assert cli.main(["train", "--config", path, "--output", str(copy)]) == 0
    err = capsys.readouterr().err
    assert "checkpoint of step 40" in err and "is damaged or incomplete" in err
    assert "resumed from the checkpoint of step 20" in err
    assert [p.name.split(".")[0] for p in (copy / "checkpoints_damaged").iterdir()] == ["40"]
    assert sorted(int(p.name) for p in (copy / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]
    ref, got = read_metrics(out), read_metrics(copy)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for key in ("train/loss", "reward/mean"):
        assert got[-1][key] == pytest.approx(ref[-1][key], abs=1e-6)


def test_a_run_on_the_paged_engine_logs_its_pages(tmp_path):
    """sampling.engine: paged in a run: a pool of one max-length sequence's pages for 16 slots (the
    prompt region aside) preempts, and the step logs it with the pool's use."""
    from grpo_jax.config import config_from_dict
    from grpo_jax.engine.pages import page_bytes, pages_needed
    from grpo_jax.trainer.loop import train

    arch = CONFIG["model"]["architecture"]
    pages = 1 + 8 * pages_needed(8, 3, 2)[0] + pages_needed(8, 3, 2)[1]
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds"), "prompts_per_step": 8},
              "sft": {"steps": 0},
              "sampling": {**CONFIG["sampling"], "engine": "paged", "slots": 16, "page_size": 2,
                           "kv_cache_bytes": pages * page_bytes(arch["num_layers"], arch["num_kv_heads"],
                                                                arch["head_dim"], 2, 4)},
              "train": {**CONFIG["train"], "steps": 1, "samples_every": 0},
              "eval": {"num_prompts": 8, "k": 8}, "checkpoint": {}}
    seen = []
    train(config_from_dict(config), tmp_path / "run", hooks=[lambda step, m: seen.append(m)], log=lambda s: None)
    (m,) = seen
    assert m["engine/preemptions"] > 0 and 0 < m["engine/pages_used_frac"] <= 1
    assert m["completion/len_mean"] > 0 and np.isfinite(m["train/loss"])
