"""`grpo-jax bench memory --topology`: a tiny config's programs compiled by XLA:TPU (libtpu's
compiler, no TPU attached) for a v5e slice, per chip; a workload that cannot fit is a verdict with
XLA:TPU's own figures, not a traceback; the option's mistakes are one line, and without libtpu it
says what to install. The compiling tests skip only where libtpu is not installed."""

from __future__ import annotations

import json
import sys

import pytest
from runs import CONFIG, write_config

from grpo_jax import cli
from grpo_jax.tools.bench.memory import CHIPS, GIB, refusal_figures

PROGRAMS = ("sampler", "eval_sampler", "reference", "train_step")  # CONFIG has grpo.beta > 0


def _libtpu():
    pytest.importorskip("libtpu", reason="XLA:TPU comes with libtpu: pip install 'grpo-jax[tpu-compile]'")


def _config(tmp_path, **sections):
    config = {**CONFIG, "mesh": {"data": 1, "fsdp": -1, "tensor": 1}, "eval": {"num_prompts": 8, "k": 2}, **sections}
    return write_config(tmp_path, config)


def _bench(tmp_path, config, *options):
    out = tmp_path / "memory.json"
    assert cli.main(["bench", "memory", "--config", config, "--output", str(out), *options]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_tiny_config_compiled_by_xla_tpu_for_a_v5e_slice(tmp_path, capsys):
    _libtpu()
    # v5e:2x4 has 8 chips, conftest's 8 host devices stand in for them: measured in this process.
    got = _bench(tmp_path, _config(tmp_path), "--topology", "v5e:2x4")
    assert "fits on v5e (16 GiB)" in capsys.readouterr().err
    assert got["backend"] == "tpu (compiled for v5e:2x4, XLA:TPU)"
    assert (got["topology"], got["devices"], got["mesh"], got["chip"], got["hbm_bytes"]) == (
        "v5e:2x4", 8, {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}, "v5e", CHIPS["v5e"])
    assert tuple(got["programs"]) == PROGRAMS and got["verdict"] == "fits"
    for name, p in got["programs"].items():
        assert p["compiled"] and p["temp_bytes"] > 0 and p["flops"] > 0 and p["bytes_accessed"] > 0, (name, p)
    train, resident = got["programs"]["train_step"], got["resident_bytes"]
    # The state is donated on TPU too, and its arguments hold at least the state's and the batch's
    # bytes per chip (TPU pads arrays to its tiles, so not exactly).
    assert train["alias_bytes"] >= resident["params"] + resident["optimizer"]
    assert train["argument_bytes"] >= resident["params"] + resident["optimizer"] + resident["batch_ids"]
    # The update runs the forward pass and its gradient: more FLOPs than the reference's forward.
    assert train["flops"] > 2 * got["programs"]["reference"]["flops"]


@pytest.mark.slow
def test_a_workload_that_cannot_fit_is_a_verdict_with_xla_tpus_figures(tmp_path):
    """A 2-layer model whose MLP is 4M wide, replicated (mesh.data only): 6 GiB of float32
    parameters per chip, so the update (with Adam's two moments) cannot fit a v5e's HBM and XLA:TPU
    refuses to compile it; the sampler still compiles (the evaluation's and the reference's are
    not asked for). v5e:2x4's 8 chips are conftest's 8 host devices: measured in this process."""
    _libtpu()
    config = {**CONFIG, "model": {**CONFIG["model"], "architecture": {**CONFIG["model"]["architecture"],
                                                                      "intermediate_size": 1 << 22}}}
    path = write_config(tmp_path, {**config, "mesh": {"data": -1}, "eval": {"num_prompts": 8, "k": 2}})
    got = _bench(tmp_path, path, "--topology", "v5e:2x4", "--set", "grpo.beta=0", "--set", "data.prompts_per_step=8",
                 "--programs", "sampler,train_step")
    assert got["backend"] == "tpu (compiled for v5e:2x4, XLA:TPU)" and got["devices"] == 8
    train = got["programs"]["train_step"]
    assert train["compiled"] is False and train["error"].startswith("RESOURCE_EXHAUSTED")
    # v5e: 16 GiB, of which the runtime keeps 0.25; the update needs the parameters, their gradient
    # and two moments at least (4 x 6 GiB).
    assert train["hbm_available_bytes"] == 15.75 * GIB and train["required_bytes"] > 4 * 6 * GIB
    assert got["verdict"] == "does not fit" and got["peak_program"] == "train_step"
    assert got["verdict_line"].startswith(f"does not fit: train_step needs {train['required_bytes'] / GIB:.2f} GiB "
                                          "of HLO temporaries, HBM 15.75 GiB")
    sampler = got["programs"]["sampler"]
    assert sampler["compiled"] and sampler["argument_bytes"] >= 6 * GIB and sampler["flops"] > 0


def test_the_options_mistakes_are_one_line(tmp_path, capsys):
    config = _config(tmp_path, mesh={"data": 1, "fsdp": 4, "tensor": 1})
    mistakes = {("--topology", "v4:2x2x1"): "the chip before ':' must be one of",
                ("--topology", "v5e:2x4", "--chip", "v6e"): "is a v5e slice; leave --chip out",
                ("--topology", "v5e:2x4", "--devices", "8"): "leave --devices out"}
    if _has_libtpu():
        mistakes[("--topology", "v5e:2x4")] = ("mesh.data x mesh.fsdp x mesh.expert x mesh.tensor = 1 x 4 x 1 x 1 uses "
                                               "4 devices, the topology has 8 chips")
        mistakes[("--topology", "v5e:1x1")] = "libtpu refused --topology 'v5e:1x1'"
    for options, message in mistakes.items():
        assert cli.main(["bench", "memory", "--config", config, *options]) == 2, options
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("grpo-jax bench memory: error: ") and message in err[-1], (options, err)


def test_without_libtpu_the_option_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # importlib.util.find_spec("libtpu") is None
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    assert cli.main(["bench", "memory", "--config", _config(tmp_path), "--topology", "v5e:2x4"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'grpo-jax[tpu-compile]'" in err and "Without --topology" in err and err.count("\n") == 1


def test_xla_tpus_refusal_is_read_into_figures():
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(42.58G) exceeds available HBM (15.75G).")
    got = refusal_figures(message, held=GIB)
    assert (got["required_for"], got["required_bytes"], got["hbm_available_bytes"]) == (
        "HLO temporaries", round(42.58 * GIB), round(15.75 * GIB))
    assert got["peak_bytes"] == GIB + got["required_bytes"] and got["error"] == message
    used = refusal_figures("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                           "hbm. Used 20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G.", held=0)
    assert (used["required_bytes"], used["hbm_available_bytes"]) == (round(20.5 * GIB), round(15.75 * GIB))


def _has_libtpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


@pytest.mark.slow
def test_the_planner_returns_settings_that_compile_and_fit(tmp_path, capsys):
    """`grpo-jax plan` on a tiny config for a v5e-8 (conftest's 8 host devices stand in for its
    chips): the settings it prints were compiled by XLA:TPU and every program of them fits 80% of
    the chip; the candidates were tried fastest estimate first; the `--set` lines and the YAML
    snippet are the same settings and load as a config; a compile budget too small to find a plan
    says so (exit 1)."""
    import yaml

    from grpo_jax.config import load_config

    _libtpu()
    config = _config(tmp_path)
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", config, "--topology", "v5e:2x4", "--output", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["fits"] and got["chip"] == "v5e" and got["chips"] == 8 and got["margin"] == 0.2
    budget = 0.8 * CHIPS["v5e"]
    picked = [next(c for c in got[k] if c["fits"]) for k in ("sampler_candidates", "update_candidates")]
    for cand in picked:
        assert cand["programs"] and all(p["compiled"] and 0 < p["peak_bytes"] <= budget
                                        for p in cand["programs"].values()), cand
    assert set(picked[0]["programs"]) == {"sampler", "eval_sampler"}
    assert set(picked[1]["programs"]) == {"train_step", "reference"}  # CONFIG has grpo.beta > 0
    assert got["sets"] == picked[0]["sets"] + picked[1]["sets"]
    assert got["estimated_step_s"] == pytest.approx(picked[0]["sampler_s"] + picked[1]["update_s"]
                                                    + picked[1]["reference_s"])
    times = [c["update_s"] for c in got["update_candidates"]]
    assert times == sorted(times)
    snippet = yaml.safe_load(got["snippet"])
    flat = {f"{section}.{k}": v for section, keys in snippet.items() for k, v in keys.items()}
    assert {s.split("=")[0] for s in got["sets"]} == set(flat)
    loaded = load_config(config, got["sets"])
    assert loaded.train.micro_batches == flat["train.micro_batches"] and loaded.model.remat == flat["model.remat"]
    assert "(roofline estimate)" in capsys.readouterr().err
    # One compile cannot cover the sampler and the update: no plan, said in one line, exit 1.
    assert cli.main(["plan", "--config", config, "--topology", "v5e:2x4", "--max-compiles", "1",
                     "--output", str(out)]) == 1
    assert json.loads(out.read_text())["fits"] is False
    assert "plan: no candidate compiled for the train step" in capsys.readouterr().err
