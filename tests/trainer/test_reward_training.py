"""`grpo-jax train-rm` (Bradley-Terry on preference pairs), the `reward_model` reward in a GRPO run,
the LLM judge's parser, and the reward-model plumbing (normalisation, config errors)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from runs import CONFIG, write_config

from grpo_jax import cli
from grpo_jax.config import ConfigError, load_config, load_rm_config
from grpo_jax.data import char_tokenizer
from grpo_jax.observe.writers import read_metrics
from grpo_jax.rewards import LLMJudgeReward, parse_score
from grpo_jax.trainer.reward_pairs import encode_pairs, read_rows
from grpo_jax.rewards.reward_model import RewardModelReward, RunningMoments

TINY = {"family": "qwen3", "hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 16, "qk_norm": True}


def rm_config(tmp, **train):
    return {"model": {"tokenizer": "char", "architecture": TINY},
            "data": {"name": "arithmetic_preferences", "data_dir": str(tmp / "tfds"), "max_length": 32,
                     "builder_kwargs": {"num_train": 1500, "num_test": 200}},
            "train": {"steps": 120, "batch_size": 32, "learning_rate": 0.002, "warmup_steps": 10,
                      "eval_every": 60, "progress": False, **train},
            "mesh": {"data": 1, "fsdp": 1, "tensor": 1}}


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    out = tmp / "rm"
    assert cli.main(["train-rm", "--config", write_config(tmp, rm_config(tmp)), "--output", str(out)]) == 0
    return tmp, out


def test_bradley_terry_training_raises_held_out_pair_accuracy(trained_rm):
    _, out = trained_rm
    evals = [r for r in read_metrics(out) if "rm/pair_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 60, 120]
    start, end = evals[0]["rm/pair_accuracy"], evals[-1]["rm/pair_accuracy"]
    # Measured 0.47 -> 0.74 (200 held-out pairs): every verbose rejection is ranked right; wrong
    # results only at chance: a 2-layer model does not learn to add in 120 steps.
    assert start < 0.6 and end > 0.68, (start, end)
    assert evals[-1]["rm/pair_accuracy/verbose"] > 0.95
    train_rows = [r for r in read_metrics(out) if "rm/loss" in r]
    assert not any("rm/lm_loss" in r for r in train_rows)  # lm_coef 0: no language-model term computed
    assert np.mean([r["rm/loss"] for r in train_rows[-20:]]) < np.mean([r["rm/loss"] for r in train_rows[:10]])


def test_the_saved_reward_model_loads_in_transformers_with_equal_scores(trained_rm):
    from grpo_jax.models.hf import load_tokenizer
    from grpo_jax.models.reward_model import load_reward_model

    _, out = trained_rm
    ours = load_reward_model(out / "hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out / "hf").float().eval()
    tok = load_tokenizer(out / "hf")
    enc = tok(["12+34=46", "12+34=46, I think", "5+5=9"], padding=True, return_tensors="np")
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(enc["input_ids"]), attention_mask=torch.as_tensor(enc["attention_mask"])
                  ).logits.numpy()
    got = np.asarray(ours(enc["input_ids"], enc["attention_mask"]))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert got[0, 0] > got[1, 0]  # concise over verbose


def test_a_grpo_run_on_the_trained_reward_model_raises_its_score(trained_rm):
    """A policy without warm start writes 6 random characters; the reward model prefers plain
    answers, and 20 GRPO steps on its score alone move the policy toward them. The
    math verifier is logged beside it on held-out prompts: the score rises whether or not the sums
    are right, which is what reward-model hacking looks like. How far the score climbs depends on
    what the tiny reward model happened to learn about random strings: 1.8 -> 3.4 and 3.4 -> 3.6 in
    two trainings of it."""
    tmp, rm = trained_rm
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp / "tfds")},
              "rewards": [{"name": "reward_model", "kwargs": {"path": str(rm / "hf"), "batch_size": 64}}],
              "sampling": {**CONFIG["sampling"], "max_new_tokens": 6},
              "eval": {"every": 0, "num_prompts": 20, "k": 4, "reward": "reward_model",
                       "verifier": "math_accuracy"},
              "sft": {**CONFIG["sft"], "steps": 0}, "checkpoint": {"every": 40},
              "train": {**CONFIG["train"], "steps": 20, "learning_rate": 0.003}}
    out = tmp / "grpo"
    assert cli.main(["train", "--config", write_config(tmp, config, "grpo.yaml"), "--output", str(out)]) == 0
    rows = [r for r in read_metrics(out) if "reward/reward_model/mean" in r]
    first, last = (np.mean([r["reward/reward_model/mean"] for r in part]) for part in (rows[:5], rows[-5:]))
    # Step-to-step noise of the batch mean is about 0.03 here.
    assert last > first + 0.1, (first, last)
    evals = [r for r in read_metrics(out) if "eval/reward_mean" in r]
    assert evals[-1]["eval/reward_mean"] > evals[0]["eval/reward_mean"]
    assert all("eval/verifier_accuracy" in r and "health/verifier_disagreement" in r for r in evals)


def test_reward_model_scores_are_the_same_sharded_on_a_mesh_and_normalise_as_documented(trained_rm):
    from grpo_jax.config import MeshConfig
    from grpo_jax.runtime.sharding import make_mesh

    _, rm = trained_rm
    prompts = [f"{a}+{b}=" for a in range(3, 9) for b in (1, 7)]
    completions = [str(int(p[0]) + int(p[2])) if i % 3 else "maybe 7" for i, p in enumerate(prompts)]
    plain = RewardModelReward(path=str(rm / "hf"), batch_size=8)
    sharded = RewardModelReward(path=str(rm / "hf"), batch_size=8, normalize=True)
    # Loaded into host memory (no chip holds it whole); `place` cuts each device's slices there.
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(nnx.state(sharded.model, nnx.Param)))
    sharded.place(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    assert len(sharded.model.score[...].sharding.device_set) == 8
    embed = sharded.model.backbone.embed[...]
    assert {s.data.size for s in embed.addressable_shards} == {embed.size // 4}  # fsdp x tensor
    raw = np.asarray(plain(prompts, completions))
    np.testing.assert_allclose(sharded.raw_scores([p + c for p, c in zip(prompts, completions)]), raw, atol=1e-4)
    # Normalised by the statistics of everything scored so far (this batch included) ...
    np.testing.assert_allclose(sharded(prompts, completions), (raw - raw.mean()) / raw.std(), atol=1e-3)
    # ... which held-out scoring (frozen) uses without adding to them.
    frozen = sharded.without_updates()(prompts[:3], completions[:3])
    assert sharded.moments.count == len(prompts)
    np.testing.assert_allclose(frozen, (raw[:3] - raw.mean()) / raw.std(), atol=1e-3)


def test_running_normalisation_matches_numpy_and_survives_a_state_round_trip():
    rng = np.random.default_rng(0)
    parts = [rng.normal(3.0, 2.0, n) for n in (5, 1, 17, 8)]
    m = RunningMoments()
    for p in parts:
        m.update(p)
    everything = np.concatenate(parts)
    assert m.count == everything.size
    np.testing.assert_allclose([m.mean, m.std], [everything.mean(), everything.std()], rtol=1e-12)
    scorer = RewardModelReward.__new__(RewardModelReward)
    scorer.moments = m
    copy = RewardModelReward.__new__(RewardModelReward)
    copy.moments = RunningMoments()
    copy.load_state_dict(json.loads(json.dumps(scorer.state_dict())))
    assert (copy.moments.count, copy.moments.mean, copy.moments.m2) == (m.count, m.mean, m.m2)


def test_reward_model_config_errors_name_the_problem(tmp_path, trained_rm):
    def load(kwargs):
        config = {**CONFIG, "rewards": [{"name": "reward_model", "kwargs": kwargs}]}
        from grpo_jax.rewards import build_rewards

        return build_rewards(load_config(write_config(tmp_path, config)))

    with pytest.raises(ConfigError, match="needs path"):
        load({})
    with pytest.raises(ConfigError, match="'batchsize' is not an option.*did you mean 'batch_size'"):
        load({"path": "x", "batchsize": 4})
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        load({"path": str(tmp_path / "nowhere")})
    _, rm = trained_rm
    with pytest.raises(ConfigError, match="label=3"):
        load({"path": str(rm / "hf"), "label": 3})
    bad = rm_config(tmp_path)
    bad["train"]["stepz"] = 3
    assert cli.main(["train-rm", "--config", write_config(tmp_path, bad, "bad.yaml")]) == 2


def test_judge_scores_parse_and_malformed_verdicts_are_none():
    assert parse_score("Score: 7") == 0.7
    assert parse_score("I'd say score = 3.5, no wait. SCORE: 8") == 0.8  # the last score counts
    assert parse_score("score: 10", max_score=10) == 1.0
    for bad in ("", "seven out of ten", "Score: eleven", "Score: 11", "Score: -2", "rating 4"):
        assert parse_score(bad) is None, bad
    assert parse_score("rating 4", pattern=r"rating (\d+)", max_score=5) == 0.8


def test_the_llm_judge_runs_through_the_sampler_and_counts_unparsable_verdicts(tmp_path):
    """A random tiny judge writes noise: every verdict is unparsable, so every sample is None and
    counted; the judge prompt carries the question, the answer and the rubric."""
    from flax import nnx

    from grpo_jax.data import char_tokenizer
    from grpo_jax.models import Transformer, save_pretrained
    from grpo_jax.models.presets import tiny
    from grpo_jax.rewards import RewardSpec, combine_rewards

    tok = char_tokenizer(add_bos=True)
    save_pretrained(Transformer(tiny("llama"), rngs=nnx.Rngs(0)), tmp_path / "judge", tokenizer=tok)
    from grpo_jax.engine.sampling import greedy_completions

    with pytest.raises(ValueError, match="no generation function"):  # rewards/ never reaches for the sampler
        LLMJudgeReward(path=str(tmp_path / "judge"))
    judge = LLMJudgeReward(path=str(tmp_path / "judge"), max_new_tokens=6, batch_size=4, rubric="R!",
                           generate=greedy_completions)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(nnx.state(judge.model, nnx.Param)))  # until placed
    prompt = tok.decode(judge.judge_prompt("2+2=", "4"), skip_special_tokens=True)
    assert "Question: 2+2=" in prompt and "Answer: 4" in prompt and "R!" in prompt
    result = combine_rewards([RewardSpec("llm_judge", judge)], ["2+2="] * 5, ["4", "5", "4", "x", "4"])
    assert len(judge.last_verdicts) == 5 and all(isinstance(v, str) for v in judge.last_verdicts)
    assert np.isnan(result.per_fn["llm_judge"]).all()
    assert result.metrics()["reward/llm_judge/unjudged"] == 5 and judge.unparsed == 5
    assert not result.failures  # None is not a failure: the judge ran and said nothing usable


def test_jsonl_pairs_are_encoded_as_the_reward_scores_them_and_bad_rows_skipped_with_a_count(tmp_path, capsys):
    good = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1), "m": 0.5}
            for a in range(6) for b in range(5)]
    lines = [json.dumps(r) for r in good[:24]] + ["{not json", json.dumps({"prompt": "1+1=", "chosen": "2"}),
                                                   json.dumps({"prompt": "1+1=", "chosen": 2, "rejected": "3"})]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in good[24:]) + "\n")
    config = rm_config(tmp_path)
    config["data"] = {"name": None, "train_file": str(tmp_path / "train.jsonl"), "eval_file": str(tmp_path / "test.jsonl"),
                      "template": "{prompt}", "margin_field": "m", "max_length": 8}
    rm = load_rm_config(write_config(tmp_path, config), ["train.margin=0.25"])
    tok = char_tokenizer(add_bos=True)
    pairs, stats = encode_pairs(read_rows(rm, "train"), rm, tok)
    assert (stats["pairs"], stats["skipped"]) == (24, 3) and "not JSON" in stats["first_skip"]
    assert stats["truncated"] == 0 and pairs.ids.shape == (24, 2, 8)
    np.testing.assert_allclose(pairs.margin, 0.75)  # the row's margin plus train.margin
    # The chosen text is the prompt followed by the answer, right-padded, exactly as the reward scores it.
    first = tok.decode([t for t in pairs.ids[0, 0] if t], skip_special_tokens=True)
    assert first == "0+0=0" and pairs.mask[0, 0].sum() == len("0+0=0") + 1  # + <bos>
    # The language-model term's answer starts after <bos> and the prompt.
    assert [tok.decode(pairs.ids[i, 0, pairs.answer_start[i]:], skip_special_tokens=True)
            for i in range(3)] == [r["chosen"] for r in good[:3]]
    held, held_stats = encode_pairs(read_rows(rm, "eval"), rm, tok, limit=4)
    assert held_stats["pairs"] == 4 and held.ids.shape[0] == 4
    config["data"]["eval_file"] = None
    assert cli.main(["train-rm", "--config", write_config(tmp_path, config, "bad.yaml")]) == 2
    assert "both data.train_file and data.eval_file" in capsys.readouterr().err


def test_the_answer_language_model_term_is_the_chosen_answers_cross_entropy(tmp_path):
    """With a chat template the answer starts inside the assistant turn (its closing tokens count
    too), a cut row's start moves with it, and `answer_nll` equals a NumPy cross-entropy over
    exactly those tokens."""
    from flax import nnx

    from grpo_jax.models.presets import tiny
    from grpo_jax.models.reward_model import RewardModel
    from grpo_jax.learner.bradley_terry import answer_nll

    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.role == 'assistant' %}<eos>"
                "{% endif %}{% endfor %}")
    tok = char_tokenizer(add_bos=True, chat_template=template)
    rows = [{"question": "12+30=", "chosen": "42", "rejected": "41"},
            {"question": "99+99=", "chosen": "198", "rejected": "it is 198!!"}]
    config = load_rm_config(write_config(tmp_path, {**rm_config(tmp_path), "data": {
        "name": None, "train_file": "t", "eval_file": "e", "max_length": 26}}))
    pairs, stats = encode_pairs(rows, config, tok)
    assert stats["truncated"] == 1  # the second pair (27 and 35 tokens) keeps its last 26
    assert [tok.decode(pairs.ids[i, 0, pairs.answer_start[i]:]) for i in range(2)] == ["42<eos>", "198<eos>"]
    assert tok.decode(pairs.ids[0, 0, :pairs.answer_start[0]]) == "[user]12+30=[assistant]"
    assert tok.decode(pairs.ids[1, 0, :pairs.answer_start[1]]) == "user]99+99=[assistant]"

    model = RewardModel(tiny("qwen3"), pad_token_id=0, rngs=nnx.Rngs(0))
    ids, mask = pairs.ids[:, 0], pairs.mask[:, 0]
    _, h = model.scores_and_states(ids, mask)
    got = float(answer_nll(model, h, ids, mask, pairs.answer_start))
    logits = np.asarray(model.backbone.logits(h), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    nll = [-logp[i, t - 1, ids[i, t]] for i in range(2) for t in range(pairs.answer_start[i], ids.shape[1])
           if mask[i, t]]
    assert len(nll) == 7
    np.testing.assert_allclose(got, np.mean(nll), rtol=1e-5)


def test_the_model_section_builds_the_reward_model_as_it_builds_a_policy(tmp_path):
    from grpo_jax.models.build import build_reward_model

    config = rm_config(tmp_path)
    config["model"] = {**config["model"], "remat": "block", "scan_layers": False}
    model = build_reward_model(load_rm_config(write_config(tmp_path, config)), char_tokenizer(add_bos=True))
    assert (model.backbone.remat, model.backbone.scan_layers) == ("block", False)  # accepted, so honoured


def test_train_rm_on_a_2x2x2_mesh_equals_one_device(tmp_path):
    runs = {}
    for name, mesh in (("one", {"data": 1, "fsdp": 1, "tensor": 1}), ("eight", {"data": 2, "fsdp": 2, "tensor": 2})):
        config = {**rm_config(tmp_path, steps=3, eval_every=0, batch_size=8, lm_coef=0.5), "mesh": mesh}
        # 6 training pairs for batches of 8: every batch is still 8 pairs (the order wraps around).
        config["data"]["builder_kwargs"] = {"num_train": 6, "num_test": 16}
        out = tmp_path / name
        assert cli.main(["train-rm", "--config", write_config(tmp_path, config, f"{name}.yaml"),
                         "--output", str(out)]) == 0
        runs[name] = read_metrics(out)
    assert sum("rm/lm_loss" in r for r in runs["one"]) == 3
    for a, b in zip(runs["one"], runs["eight"], strict=True):
        for key in ("rm/loss", "rm/lm_loss", "rm/pair_accuracy", "rm/eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_train_rm_runs_in_the_trainers_loop_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path, capsys):
    """The reward model trains in the RL trainer's loop with its checkpoints: a run stopped after
    step 2 and resumed (train.resume) logs the steps and ends with the parameters of one that ran
    through; a rerun into a directory with checkpoints is refused without train.resume."""
    import shutil

    from safetensors.numpy import load_file

    config = rm_config(tmp_path, steps=4, eval_every=2, batch_size=8)
    # 6 pairs for batches of 8: the pair order wraps around, so the stream's saved position
    # (orders drawn so far) has to be replayed exactly on resume.
    config["data"]["builder_kwargs"] = {"num_train": 6, "num_test": 16}
    config["checkpoint"] = {"every": 2}
    path, whole = write_config(tmp_path, config), tmp_path / "whole"
    assert cli.main(["train-rm", "--config", path, "--output", str(whole)]) == 0
    assert sorted(int(p.name) for p in (whole / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    assert cli.main(["train-rm", "--config", path, "--output", str(whole)]) == 2
    assert "already holds checkpoints (newest: step 4)" in capsys.readouterr().err

    stopped = tmp_path / "stopped"  # as if stopped after step 2: its newest checkpoint, its logs up to it
    shutil.copytree(whole, stopped)
    shutil.rmtree(stopped / "checkpoints" / "4")
    shutil.rmtree(stopped / "hf")
    lines = (stopped / "metrics.jsonl").read_text().splitlines(keepends=True)
    (stopped / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= 2))
    assert cli.main(["train-rm", "--config", path, "--output", str(stopped), "--set", "train.resume=true"]) == 0
    ref, got = read_metrics(whole), read_metrics(stopped)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [0, 1, 2, 3, 4]
    for r, g in zip(ref, got):
        assert {k: v for k, v in g.items() if not k.startswith("perf/")} == pytest.approx(
            {k: v for k, v in r.items() if not k.startswith("perf/")}, nan_ok=True), r["step"]
    a, b = load_file(str(whole / "hf" / "model.safetensors")), load_file(str(stopped / "hf" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
