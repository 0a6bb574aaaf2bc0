"""`grpo-jax bench grpo-step`: whole steps through the trainer, a JSON with the pinned fields, and
model FLOPs equal to a count made by hand for the tiny model. (Speed itself is measured in
benchmarks/, never asserted here.)"""

from __future__ import annotations

import json

import pytest
import yaml
from runs import CONFIG, write_config

from grpo_jax import cli
from grpo_jax.data import char_tokenizer
from grpo_jax.tools.flops import step_flops
from grpo_jax.models.build import architecture

FIELDS = ("step_s_median", "sample_s_median", "ref_s_median", "train_s_median", "tokens_per_s", "flops_per_step",
          "peak_matmul_flops_per_s", "mfu")


def test_grpo_step_benchmark_writes_its_json_with_a_hand_counted_flops(tmp_path):
    path = write_config(tmp_path, {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")}})
    out = tmp_path / "bench.json"
    # min_new_tokens = max_new_tokens: every completion is 3 tokens, so the count below is exact.
    assert cli.main(["bench", "grpo-step", "--config", str(path), "--steps", "1", "--warmup", "0",
                     "--set", "sampling.min_new_tokens=3", "--set", "model.scan_layers=false",
                     "--set", "train.micro_batches=2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in FIELDS:
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["steps_timed"] == 1 and 0 < result["mfu"] < 1
    assert result["workload"] == {"prompts_per_step": 32, "group_size": 8, "prompt_len": 8, "completion_len": 3,
                                  "vocab_size": len(char_tokenizer(add_bos=True)), "hidden_size": 64,
                                  "num_layers": 2, "micro_batch_rows": 128, "scan_layers": False}
    assert result["tokens_per_s"] * result["step_s_median"] == pytest.approx(32 * 8 * 3)

    # By hand: qwen3, hidden 64, mlp 192, 2 layers, 4 heads of 16, 2 kv heads; 32 prompts of 8
    # (bucket) x G = 8 rows, 3 completion tokens; beta > 0, so a reference pass.
    V, L = result["workload"]["vocab_size"], 2
    per_token_layer = 2 * 64 * 16 * (4 + 2 * 2) + 2 * 4 * 16 * 64 + 3 * 2 * 64 * 192  # qkv, o, gate/up/down
    attend = 4 * 4 * 16  # per key attended, per layer (scores + weighted sum)
    logit = 2 * 64 * V
    prefill = 32 * (8 * L * per_token_layer + L * attend * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) + logit)
    decode = 256 * (L * per_token_layer + L * attend * 9 + logit) + 256 * (L * per_token_layer + L * attend * 10
                                                                            + logit)
    # train.shared_prompt (the default): the 32 prompts once, then the 256 completions after them.
    prompts_once = prefill - 32 * logit  # the lm head runs at the 3 positions per row predicting completions
    one_pass = prompts_once + 256 * (3 * L * per_token_layer + L * attend * (9 + 10 + 11) + 3 * logit)
    assert result["flops"] == {"sample": prefill + decode, "reference": one_pass, "update": 3 * one_pass}
    assert result["flops_per_step"] == prefill + decode + 4 * one_pass
    # Each row with its own prompt copy: 256 rows of 11 tokens, logits at the 3 completion positions.
    plain = 256 * (11 * L * per_token_layer + L * attend * sum(range(1, 12)) + 3 * logit)
    model_config = architecture(CONFIG["model"]["architecture"], char_tokenizer(add_bos=True))
    counted = step_flops(model_config, prompts=32, group_size=8, prompt_len=8, completion_len=3,
                         shared_prompt=False)
    assert (counted.reference, counted.update, counted.sample) == (plain, 3 * plain, prefill + decode)


def test_grpo_step_refuses_options_it_would_ignore(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    # Each benchmark's own parser refuses the options of the others, in one line.
    assert cli.main(["bench", "grpo-step", "--config", str(path), "--preset", "small"]) == 2
    assert capsys.readouterr().err == "grpo-jax bench grpo-step: error: unrecognized arguments: --preset small\n"
    assert cli.main(["bench", "sampler", "--steps", "3"]) == 2
    assert capsys.readouterr().err == "grpo-jax bench sampler: error: unrecognized arguments: --steps 3\n"
    assert cli.main(["bench", "grpo-step", "--config", str(path), "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-jax bench grpo-step: error: ") and "--steps >= 1" in err and err.count("\n") == 1


def test_scaling_writes_its_curves_as_json_and_png(tmp_path):
    path = write_config(tmp_path, {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")}})
    out = tmp_path / "scaling.json"
    assert cli.main(["bench", "scaling", "--config", str(path), "--group-sizes", "2", "--completion-lens", "2",
                     "--steps", "1", "--warmup", "0", "--set", "train.micro_batches=4", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["base"] == {"group_size": 8, "completion_len": 3, "prompts_per_step": 32, "micro_batch_rows": 64}
    assert [(p["axis"], p["value"]) for p in result["points"]] == [("group_size", 2), ("completion_len", 2)]
    for p in result["points"]:
        for key in ("step_s_median", "sample_s_median", "ref_s_median", "train_s_median", "flops_per_step"):
            assert p[key] > 0, (p["axis"], p["value"], key)
        # The config's 64-row micro-batches, kept at every point.
        assert p["prompts_per_step"] * p["group_size"] // p["micro_batches"] == 64
    g2, t2 = result["points"]
    assert (g2["group_size"], t2["group_size"], t2["completion_len"]) == (2, 8, 2)
    assert g2["flops_per_step"] < t2["flops_per_step"]  # 32 x 2 rows of 3 tokens against 32 x 8 rows of 2
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scaling_micro_batches_are_whole_groups_near_the_target():
    from grpo_jax.tools.bench import scaling_micro_batches

    for rows_per_group in (2, 3, 8, 32):
        for groups in (1, 2, 3, 8, 16):
            rows = rows_per_group * groups
            for target in (1, 8, 16, 64):
                mb = scaling_micro_batches(rows, rows_per_group, target)
                assert rows % mb == 0 and (rows // mb) % rows_per_group == 0, (rows, rows_per_group, target, mb)
                # Never smaller than one group or than the target allows.
                assert rows // mb >= min(rows, max(rows_per_group, target - target % rows_per_group))


def test_bench_refuses_sweeps_for_other_benchmarks(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    assert cli.main(["bench", "grpo-step", "--config", str(path), "--group-sizes", "2,4"]) == 2
    assert capsys.readouterr().err == "grpo-jax bench grpo-step: error: unrecognized arguments: --group-sizes 2,4\n"
    assert cli.main(["bench", "grpo-step", "--config", str(path), "--prompts", "3"]) == 2
    assert capsys.readouterr().err == "grpo-jax bench grpo-step: error: unrecognized arguments: --prompts 3\n"
    assert cli.main(["bench", "scaling"]) == 2
    assert capsys.readouterr().err == "grpo-jax bench scaling: error: the following arguments are required: --config\n"
    assert cli.main(["bench", "scaling", "--config", str(path), "--group-sizes", "2,0"]) == 2
    assert "grpo-jax bench scaling: error: argument --group-sizes: must be at least 1, got '2,0'" \
        in capsys.readouterr().err


def test_each_benchmark_takes_its_defaults_from_its_function():
    """The CLI restates no default: each benchmark's parser has its function's keyword defaults."""
    import inspect

    from grpo_jax.tools import bench

    parser = cli.build_parser()
    for argv, fn in ((["bench", "sampler"], bench.sampler), (["bench", "forward"], bench.forward),
                     (["bench", "grpo-step", "--config", "c.yaml"], bench.grpo_step),
                     (["bench", "scaling", "--config", "c.yaml"], bench.scaling)):
        args = vars(parser.parse_args(argv))
        for name, p in inspect.signature(fn).parameters.items():
            if name in args and p.default is not p.empty:
                assert args[name] == (list(p.default) if name == "overrides" else p.default), (argv, name)
    assert vars(parser.parse_args(["bench", "sampler"]))["preset"] == "small"
    assert vars(parser.parse_args(["bench", "forward"]))["preset"] == "tiny"
    args = parser.parse_args(["bench", "scaling", "--config", "c.yaml", "--group-sizes", "2,4", "--set", "a=1"])
    assert (args.group_size, args.completion_len, args.prompts_per_step, args.overrides) == ([2, 4], None, None, ["a=1"])


def test_presets_extend_the_model_presets():
    """bench's model shapes are `grpo_jax.models.presets.tiny` of a family, reshaped; the reference
    model transformers builds from them has the same shape."""
    from grpo_jax.models.presets import tiny
    from grpo_jax.tools.bench.parity import PRESETS, preset_config

    small = preset_config("small")
    assert small == tiny("qwen3", **PRESETS["small"][1])
    assert (small.hidden_size, small.num_layers, small.vocab_size) == (512, 8, 8192)
    llama = preset_config("llama3.2-1b")
    assert llama.family == "llama" and llama.rope_of("full_attention").factor == 32.0
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset_config("huge")
