"""The console entry points: --version, --help, one-line user errors and the smoke run of the model stack."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

import grpo_jax


def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "grpo_jax", *args], capture_output=True, text=True, **kw)


def test_version_and_help():
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"grpo-jax {grpo_jax.__version__}"
    out = _run("--help")
    assert out.returncode == 0 and "smoke" in out.stdout


def test_smoke_run_saves_reloads_and_decodes(tmp_path, capsys):
    # In this process (the command is cli.main's; test_version_and_help runs `python -m grpo_jax`).
    from grpo_jax import cli

    assert cli.main(["smoke", "--family", "gemma3_text", "--output", str(tmp_path / "m"), "--new-tokens", "12"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["cache_vs_full_max_abs_diff"] <= 1e-4
    assert len(summary["generated"]) == 4 and all(len(r) == 12 for r in summary["generated"])
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / "model.safetensors").exists()


def test_smoke_offers_every_supported_family():
    from grpo_jax.cli import build_parser
    from grpo_jax.models import SUPPORTED_FAMILIES

    commands = next(a for a in build_parser()._actions if a.choices and "smoke" in a.choices)
    family = next(a for a in commands.choices["smoke"]._actions if a.dest == "family")
    assert sorted(family.choices) == sorted(SUPPORTED_FAMILIES)


def test_smoke_rejects_bad_arguments(tmp_path):
    out = _run("smoke", "--family", "mistral")
    assert out.returncode != 0 and "invalid choice" in out.stderr
    out = _run("smoke", "--new-tokens", "1", "--output", str(tmp_path / "m"))
    assert out.returncode != 0 and "at least 2" in out.stderr


def test_bench_sampler_writes_json(tmp_path):
    """The benchmark runs end to end and reports both sides (figures themselves live in RESULTS.md)."""
    from grpo_jax import cli

    out_file = tmp_path / "b.json"
    assert cli.main(["bench", "sampler", "--preset", "tiny", "--prompts", "1", "--group-size", "2",
                     "--prompt-len", "8", "--new-tokens", "4", "--iters", "1", "--output", str(out_file)]) == 0
    result = json.loads(out_file.read_text())
    assert result["rows"] == 2 and result["new_tokens"] == 4
    for key in ("grpo_jax_tokens_per_s", "transformers_tokens_per_s", "prefill_s_G1", "prefill_s_G2_shared"):
        assert result[key] > 0, key


def test_every_user_error_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    """argparse's refusals, a ConfigError, a missing path and a refused export all read
    `grpo-jax <command>: error: <message>` on one line, with exit status 2."""
    from flax import nnx

    from grpo_jax import cli
    from grpo_jax.models import Transformer
    from grpo_jax.models.presets import tiny
    from grpo_jax.trainer import checkpoint

    def refused(argv, message):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"grpo-jax {argv[0]}: error: ") and message in err and err.count("\n") == 1, err

    refused(["smoke", "--new-tokens", "1"], "argument --new-tokens: must be at least 2, got '1'")
    refused(["train"], "the following arguments are required: --config")
    refused(["train", "--config", str(tmp_path / "nope.yaml")], "does not exist")  # a ConfigError
    refused(["plot", str(tmp_path / "nope")], "no metrics.jsonl")  # a FileNotFoundError
    refused(["fetch-model"], "name a model: ")
    refused(["plot", str(tmp_path), "--bogus"], "unrecognized arguments: --bogus")
    model = Transformer(tiny("qwen3"), rngs=nnx.Rngs(0))
    monkeypatch.setattr(checkpoint, "load_policy", lambda path: (model, None, SimpleNamespace(run_dir=tmp_path)))
    refused(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x"), "--format", "peft"],
            f"{tmp_path} is not a LoRA run (lora.rank: 0); --format peft exports adapters, use --format hf")
    assert not (tmp_path / "x").exists()


def test_smoke_is_a_function_the_cli_calls(tmp_path):
    import pytest

    from grpo_jax.tools.smoke import MIN_NEW_TOKENS, smoke

    with pytest.raises(ValueError, match=f"at least {MIN_NEW_TOKENS}"):
        smoke(output=tmp_path / "m", new_tokens=1)



# `grpo-jax eval` of a run of one step, whose config has an eval.verifier that disagrees with its
# reward (math_accuracy): every sample is right by it.
ALWAYS = ("def always(prompts, completions, *, value=1.0, **fields):\n    return [value] * len(completions)\n"
          "def longer(prompts, completions, **fields):\n    return [len(c) / 3 for c in completions]\n")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from grpo_jax import cli
    from runs import CONFIG, write_config

    tmp = tmp_path_factory.mktemp("eval")
    (tmp / "always.py").write_text(ALWAYS)
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp / "tfds"), "prompts_per_step": 4},
              "sampling": {**CONFIG["sampling"], "group_size": 2}, "sft": {"steps": 0},
              "train": {**CONFIG["train"], "steps": 1, "samples_every": 0, "warmup_steps": 0}, "checkpoint": {"every": 1},
              # `longer` varies within groups: the one update moves the policy (evaluation judges by math_accuracy)
              "rewards": [*CONFIG["rewards"], {"name": f"{tmp / 'always.py'}:longer"}],
              "eval": {"every": 0, "num_prompts": 4, "k": 2, "verifier": f"{tmp / 'always.py'}:always",
                       "verifier_kwargs": {"value": 1.0}, "retention": True, "retention_top_k": 8,
                       "retention_max_tokens": 32}}
    out = tmp / "run"
    assert cli.main(["train", "--config", write_config(tmp, config), "--output", str(out)]) == 0
    return out


def _eval(capsys, *argv) -> dict:
    from grpo_jax import cli

    capsys.readouterr()
    assert cli.main(["eval", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_reports_the_verifiers_accuracy_as_the_trainer_does(tiny_run, capsys):
    from grpo_jax.observe.writers import read_metrics

    result = _eval(capsys, str(tiny_run))
    final = [r for r in read_metrics(tiny_run) if "eval/accuracy" in r][-1]
    assert result["step"] == 1 == final["step"]
    for key in ("eval/accuracy", "eval/pass@k", "eval/verifier_accuracy", "health/verifier_disagreement"):
        assert result[key] == pytest.approx(final[key], nan_ok=True), key
    assert result["eval/verifier_accuracy"] == 1.0 and result["eval/accuracy"] < 1.0
    assert result["health/verifier_disagreement"] == pytest.approx(1.0 - result["eval/accuracy"])
    # eval.verifier_kwargs too: the same samples, every one wrong by the verifier.
    zero = _eval(capsys, str(tiny_run), "--set", "eval.verifier_kwargs={value: 0.0}")
    assert zero["eval/verifier_accuracy"] == 0.0 and zero["eval/accuracy"] == result["eval/accuracy"]


def test_eval_measures_retention_against_the_runs_first_policy_as_the_trainer_does(tiny_run, capsys):
    from grpo_jax.observe.writers import read_metrics
    from grpo_jax.rollout.retention import REFERENCE_FILE

    first, final = [r for r in read_metrics(tiny_run) if "eval/accuracy" in r]
    assert first["retention/kl"] == 0.0 < final["retention/kl"]  # pi_0 against itself; one update moved it
    assert final["retention/general_nll"] != first["retention/general_nll"] and first["retention/tokens"] > 500
    result = _eval(capsys, str(tiny_run))
    for key in ("retention/kl", "retention/general_nll", "retention/tokens"):
        assert result[key] == pytest.approx(final[key], rel=1e-6), key
    (tiny_run / REFERENCE_FILE).rename(tiny_run / "kept.npz")
    try:
        from grpo_jax import cli

        assert cli.main(["eval", str(tiny_run)]) == 0
    finally:
        (tiny_run / "kept.npz").rename(tiny_run / REFERENCE_FILE)
    out = capsys.readouterr()
    alone = json.loads(out.out.strip().splitlines()[-1])
    assert "retention/kl" not in alone and alone["retention/general_nll"] == result["retention/general_nll"]
    assert f"retention/kl is not measured: {tiny_run / REFERENCE_FILE} is missing" in out.err


def test_eval_of_a_run_dir_reads_its_own_config(tiny_run, capsys):
    from grpo_jax import cli

    own = _eval(capsys, str(tiny_run))
    named = _eval(capsys, "--config", str(tiny_run / "config.yaml"), "--checkpoint", str(tiny_run))
    assert own["config"] == str(tiny_run / "config.yaml")
    assert json.dumps(named) == json.dumps(own)  # the same numbers, to the last digit
    assert cli.main(["eval"]) == 2 and "name the run once" in capsys.readouterr().err
