"""The console entry points: --version, --help and the smoke run of the model stack."""

import json
import subprocess
import sys

import grpo_jax


def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "grpo_jax", *args], capture_output=True, text=True, **kw)


def test_version_and_help():
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"grpo-jax {grpo_jax.__version__}"
    out = _run("--help")
    assert out.returncode == 0 and "smoke" in out.stdout


def test_smoke_run_saves_reloads_and_decodes(tmp_path):
    out = _run("smoke", "--family", "gemma3_text", "--output", str(tmp_path / "m"), "--new-tokens", "12",
               timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["cache_vs_full_max_abs_diff"] <= 1e-4
    assert len(summary["generated"]) == 4 and all(len(r) == 12 for r in summary["generated"])
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / "model.safetensors").exists()


def test_smoke_rejects_bad_arguments(tmp_path):
    out = _run("smoke", "--family", "mistral")
    assert out.returncode != 0 and "invalid choice" in out.stderr
    out = _run("smoke", "--new-tokens", "1", "--output", str(tmp_path / "m"))
    assert out.returncode != 0 and "at least 2" in out.stderr


def test_bench_sampler_writes_json(tmp_path):
    """The benchmark runs end to end and reports both sides (figures themselves live in RESULTS.md)."""
    out_file = tmp_path / "b.json"
    out = _run("bench", "sampler", "--preset", "tiny", "--prompts", "1", "--group-size", "2",
               "--prompt-len", "8", "--new-tokens", "4", "--iters", "1", "--output", str(out_file), timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out_file.read_text())
    assert result["rows"] == 2 and result["new_tokens"] == 4
    for key in ("grpo_jax_tokens_per_s", "transformers_tokens_per_s", "prefill_s_G1", "prefill_s_G2_shared"):
        assert result[key] > 0, key
