"""Run outputs: metrics.jsonl / samples.jsonl round trips, TensorBoard events read back with
TensorBoard's own loader, resume truncation, the progress bar and the plot."""

import io
import json
import math
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from grpo_jax.observe.plots import plot_run
from grpo_jax.observe.progress import ProgressBar
from grpo_jax.observe.writers import MetricsWriter, read_metrics


def _tensorboard(run_dir):
    acc = event_accumulator.EventAccumulator(
        str(run_dir / "tensorboard"),
        size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def _scalars(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


def _reject_nan_constants(name):
    raise AssertionError(f"{name} in metrics.jsonl is not plain JSON")


def test_jsonl_round_trip_with_non_finite_and_array_scalars(tmp_path):
    metrics = {
        "reward/mean": 0.25,
        "reward/std": float("nan"),
        "kl/k3": float("inf"),
        "kl/k1": -float("inf"),
        "policy/entropy": np.float32(1.5),
        "completion/len_max": np.int64(17),
        "train/loss": jnp.float32(-0.125),
        "train/skipped_steps": jnp.array(2, jnp.int32),
        "train/grad_norm": jnp.array(3.0, jnp.bfloat16),
        "advantage/abs_max": np.array(0.75, ml_dtypes.bfloat16),
        "groups/frac_zero_std": True,
    }
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(np.int64(3), metrics)
        writer.write(4, {"reward/mean": jnp.float32(float("nan"))})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    raw = [json.loads(line, parse_constant=_reject_nan_constants) for line in lines]
    assert raw[0]["reward/std"] is None and raw[0]["kl/k3"] is None and raw[0]["kl/k1"] is None
    assert raw[1] == {"step": 4, "reward/mean": None}
    assert list(raw[0]) == ["step", *metrics]  # step first, then the caller's order

    rec, rec4 = read_metrics(tmp_path)
    assert rec["step"] == 3 and type(rec["step"]) is int
    assert rec["reward/mean"] == 0.25
    assert math.isnan(rec["reward/std"]) and math.isnan(rec["kl/k3"]) and math.isnan(rec["kl/k1"])
    assert rec["policy/entropy"] == 1.5
    assert rec["completion/len_max"] == 17 and type(rec["completion/len_max"]) is int
    assert rec["train/loss"] == -0.125
    assert rec["train/skipped_steps"] == 2 and type(rec["train/skipped_steps"]) is int
    assert rec["train/grad_norm"] == 3.0 and rec["advantage/abs_max"] == 0.75
    assert rec["groups/frac_zero_std"] == 1
    assert rec4["step"] == 4 and math.isnan(rec4["reward/mean"])


def test_lines_are_readable_while_the_writer_is_open(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(0, {"reward/mean": 0.5})
    writer.write(1, {"reward/mean": 0.75})
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.5, 0.75]
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(2, {"reward/mean": 1.0})


def test_bad_metric_values_fail_naming_the_metric(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="'reward/mean' has shape \\(2,\\)"):
            writer.write(0, {"reward/mean": np.zeros(2)})
        with pytest.raises(TypeError, match="'kl/k1' must be a real number"):
            writer.write(0, {"kl/k1": "0.5"})
        with pytest.raises(ValueError, match="`step` argument"):
            writer.write(0, {"step": 1})
        with pytest.raises(TypeError, match="step must be an integer"):
            writer.write(1.5, {})
    assert read_metrics(tmp_path) == []  # nothing half-written by the failed calls


def test_tensorboard_scalars_at_their_steps(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(3):
            writer.write(step, {"reward/mean": 0.5 * step, "kl/k3": float("nan") if step == 1 else 0.01})
        writer.write(2, {"eval/pass@k": 0.875, "eval/accuracy": jnp.float32(0.625)})
    acc = _tensorboard(tmp_path)
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "kl/k3", "eval/pass@k", "eval/accuracy"}
    assert _scalars(acc, "reward/mean") == {0: 0.0, 1: 0.5, 2: 1.0}
    kl = _scalars(acc, "kl/k3")
    assert sorted(kl) == [0, 1, 2] and math.isnan(kl[1]) and kl[2] == pytest.approx(0.01)
    assert _scalars(acc, "eval/pass@k") == {2: 0.875}
    assert _scalars(acc, "eval/accuracy") == {2: 0.625}


def test_samples_jsonl_and_tensorboard_text(tmp_path):
    rows = [
        {"prompt": "What is 2+3?", "completion": "It is\n\\boxed{5}", "reward": np.float32(1.0),
         "reward/math": 1.0},
        {"prompt": "What is 2+3?", "completion": "six", "reward": float("nan"), "lengths": np.array([3, 4])},
    ]
    with MetricsWriter(tmp_path) as writer:
        writer.write_samples(7, rows)
        writer.write_samples(8, [])
        with pytest.raises(ValueError, match="`step` argument"):
            writer.write_samples(9, [{"step": 9, "completion": "x"}])
    lines = [json.loads(line, parse_constant=_reject_nan_constants)
             for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 7, "prompt": "What is 2+3?", "completion": "It is\n\\boxed{5}", "reward": 1.0, "reward/math": 1.0},
        {"step": 7, "prompt": "What is 2+3?", "completion": "six", "reward": None, "lengths": [3, 4]},
    ]
    events = _tensorboard(tmp_path).Tensors("samples")
    assert [e.step for e in events] == [7]
    cells = [s.decode() for s in events[0].tensor_proto.string_val]
    assert len(cells) == 2
    assert "\\boxed{5}" in cells[0] and "**reward**: 1" in cells[0]
    assert "six" in cells[1] and "**reward**: nan" in cells[1]


def test_resume_truncates_metrics_samples_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(6):
            writer.write(step, {"reward/mean": float(step)})
            writer.write_samples(step, [{"completion": f"old {step}"}])
    with MetricsWriter(tmp_path) as writer:  # resumed from a checkpoint taken after step 2
        assert writer.truncate_after(2) == 3
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
        for step in (3, 4):
            writer.write(step, {"reward/mean": 10.0 + step})
            writer.write_samples(step, [{"completion": f"new {step}"}])
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in samples] == ["old 0", "old 1", "old 2", "new 3", "new 4"]
    acc = _tensorboard(tmp_path)
    assert _scalars(acc, "reward/mean") == {0: 0.0, 1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0}
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # one event file per writer


def test_a_line_cut_off_by_a_kill_is_dropped_and_corruption_is_reported(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(0, {"reward/mean": 0.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "reward/me')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
    with MetricsWriter(tmp_path, tensorboard=False) as writer:  # appending starts a clean line
        writer.write(1, {"reward/mean": 0.25})
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(0, 0.5), (1, 0.25)]

    text = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text("not json\n" + text)
    with pytest.raises(ValueError, match="line 1.*corrupt"):
        read_metrics(tmp_path)


def test_read_metrics_without_a_run_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in .*--output"):
        read_metrics(tmp_path / "no_such_run")


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24]), len(data)


def test_plot_run_writes_a_png_and_survives_missing_series(tmp_path):
    full, sparse = tmp_path / "full", tmp_path / "sparse"
    with MetricsWriter(full, tensorboard=False) as writer:
        for step in range(20):
            metrics = {"reward/mean": step / 20, "reward/std": 0.1, "kl/k3": 1e-3 * step,
                       "policy/entropy": 1.0 - step / 40, "completion/len_mean": 100 + step,
                       "perf/sample_tokens_per_s": 1234.0}
            if step % 5 == 4:
                metrics |= {"eval/accuracy": step / 25, "eval/pass@k": float("nan") if step == 4 else step / 20}
            writer.write(step, metrics)
    out = plot_run(full)
    assert out == full / "metrics.png"
    (w, h), full_bytes = _png_size(out)
    assert (w, h) == (1500, 800) and full_bytes > 20_000

    with MetricsWriter(sparse, tensorboard=False) as writer:  # only kl/k1, and an all-NaN reward
        writer.write(0, {"kl/k1": 0.5, "reward/mean": float("nan")})
        writer.write(1, {"kl/k1": 0.25})
    out = plot_run(sparse, tmp_path / "plots" / "sparse.png")
    (w, h), sparse_bytes = _png_size(out)
    assert (w, h) == (1500, 800) and 0 < sparse_bytes < full_bytes
    assert not list((tmp_path / "plots").glob("*.tmp"))


def test_plot_run_errors_without_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no records"):
        plot_run(tmp_path)


def test_progress_bar_shows_step_reward_accuracy_and_survives_gaps():
    out = io.StringIO()
    with ProgressBar(10, initial=2, file=out, tty_only=False) as bar:
        assert bar.enabled
        bar.update(3, {"reward/mean": 0.625, "eval/accuracy": jnp.float32(0.5), "kl/k1": 0.002,
                       "perf/sample_tokens_per_s": 12345.0})
        text = out.getvalue()
        assert "3/10" in text and "reward 0.625" in text and "acc 0.5" in text
        assert "kl 0.002" in text and "tok/s 12.3k" in text
        bar.update(4, {"reward/mean": float("nan")})
        bar.update(5, {})
        bar.update(5, None)
    text = out.getvalue()
    assert "reward nan" in text and "5/10" in text
    assert text.rstrip().endswith("acc 0.5 | kl - | tok/s -]")  # last eval kept, missing shown as -


def test_progress_is_off_when_asked_and_plain_lines_every_n_steps_off_a_terminal(monkeypatch):
    for kwargs in ({"enabled": False, "tty_only": False}, {"enabled": False}, {"every": 0}):
        out = io.StringIO()
        bar = ProgressBar(10, file=out, **kwargs)
        assert not bar.enabled
        bar.update(1, {"reward/mean": 0.5})
        bar.close()
        assert out.getvalue() == ""
    clock = iter([100.0, 103.0, 105.0, 107.0, 109.0, 119.0])  # the bar's start, then steps 1-5
    monkeypatch.setattr("grpo_jax.observe.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()  # not a terminal: a line every 2 steps and at the last, no bar
    with ProgressBar(5, file=out, every=2, start={"eval/accuracy": 0.25}) as bar:
        for step in range(1, 6):
            bar.update(step, {"reward/mean": 0.1 * step, "kl/k3": 0.01, "perf/sample_tokens_per_s": 2000.0})
    assert out.getvalue().splitlines() == [
        "step 2/5 | reward 0.2 | acc 0.25 | kl 0.01 | tok/s 2000 | 2.50 s/step | ETA 0:00:08",
        "step 4/5 | reward 0.4 | acc 0.25 | kl 0.01 | tok/s 2000 | 2.25 s/step | ETA 0:00:02",
        "step 5/5 | reward 0.5 | acc 0.25 | kl 0.01 | tok/s 2000 | 3.80 s/step | ETA 0:00:00"]
    with pytest.raises(ValueError, match="initial"):
        ProgressBar(5, initial=6)


def test_progress_shows_the_fields_it_is_given():
    """train-rm's line: its own loss and accuracy, the held-out pair accuracy kept between evaluations."""
    out = io.StringIO()
    fields = (("loss", ("rm/loss",), False), ("held-out pairs", ("rm/pair_accuracy",), True))
    with ProgressBar(2, file=out, start={"rm/pair_accuracy": 0.5}, fields=fields) as bar:
        bar.update(1, {"rm/loss": 0.69, "reward/mean": 1.0})
        bar.update(2, {"rm/pair_accuracy": 0.75})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/2 | loss 0.69 | held-out pairs 0.5 | ") and "reward" not in lines[0]
    assert lines[1].startswith("step 2/2 | loss - | held-out pairs 0.75 | ")
