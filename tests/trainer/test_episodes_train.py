"""A GRPO run over multi-turn episodes (`environment:` in the config): a scripted environment
answers each first turn with a tool message, the update trains on every model token of every turn
and on no environment token, and the sampler-vs-trainer log-prob check stays at fp32 rounding,
the proof that no token moved between sampling and training. A resumed run equals the
uninterrupted one."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
from runs import CONFIG, assert_same_run, write_config

from grpo_jax import cli
from grpo_jax.config import ConfigError, load_config
from grpo_jax.data.tokenizer import char_tokenizer
from grpo_jax.observe.report import write_report
from grpo_jax.observe.writers import read_metrics
from grpo_jax.trainer.loop import train

TEMPLATE = ("{% for m in messages %}{{ '[' + m.role + ']' + m.content + eos_token + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}")
ENV = '''
from grpo_jax import EnvStep

class OneTool:
    """A tool answer after the first turn; the episode ends after the second, worth 0.5."""
    def __init__(self, answer="ok"):
        self.answer, self.turns = answer, 0
    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]
    def step(self, completion):
        self.turns += 1
        if self.turns == 1:
            return EnvStep([{"role": "tool", "content": self.answer}])
        return EnvStep([], reward=0.5, done=True)
'''


@pytest.fixture(scope="module")
def episode_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    tok = char_tokenizer(add_bos=True, chat_template=TEMPLATE)
    tok.save_pretrained(root / "tokenizer")
    (root / "one_tool.py").write_text(ENV)
    cfg = copy.deepcopy(CONFIG)
    cfg["model"]["tokenizer"] = str(root / "tokenizer")
    cfg["data"].update(prompts_per_step=4, max_prompt_tokens=32)
    # Turns end at a digit or <eos> (about 1 draw in 9 of the untrained model): most episodes reach
    # a second turn after the tool's answer.
    stops = [tok.convert_tokens_to_ids(c) for c in "0123456789"] + [tok.eos_token_id]
    # A page pool (its episodes are token for token those of a whole trajectory per slot: tests/episodes).
    cfg["sampling"].update(group_size=4, max_new_tokens=16, prompt_buckets=[32], engine="paged", page_size=8,
                           kv_cache_bytes=1 << 22, slots=8, stop_token_ids=stops)
    cfg["sft"] = {"steps": 0}
    cfg["train"].update(steps=4, samples_every=1)
    cfg["eval"] = {"every": 0, "num_prompts": 4, "k": 2}
    cfg["checkpoint"] = {"every": 2}
    cfg["mesh"] = {"data": 2, "fsdp": 1, "tensor": 1}  # the slots over two row shards, the batch over both
    cfg["environment"] = {"name": f"{root / 'one_tool.py'}:OneTool", "kwargs": {"answer": "42"}, "max_turns": 2,
                          "max_env_tokens": 40, "timeout_s": 10.0}
    return root, cfg


@pytest.fixture(scope="module")
def episode_run(episode_config, tmp_path_factory):
    root, cfg = episode_config
    run_dir = tmp_path_factory.mktemp("episode_run") / "run"
    path = write_config(run_dir.parent, cfg)
    train(load_config(path), run_dir=str(run_dir))
    return path, run_dir


def test_grpo_trains_on_every_model_turn_and_no_environment_token(episode_run):
    _, run_dir = episode_run
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 4
    for m in steps:
        assert m["env/errors"] == 0 and 1 <= m["env/turns_mean"] <= 2 and m["env/tool_calls_mean"] >= 0.5
        assert m["env/template_fallbacks"] == 0  # this template extends every conversation
        assert m["completion/env_tokens_mean"] > 0 and m["completion/model_tokens_mean"] > 0
        # The trainer's log-probs of the sampled tokens, recomputed over trajectories that hold the
        # environment's tokens between turns, equal the sampler's.
        assert m["health/sampler_train_logprob_diff"] < 1e-5
        assert np.isfinite(m["train/loss"]) and np.isfinite(m["kl/k3"])
        assert m["completion/len_max"] <= 16  # the model's tokens, not the trajectory's
        assert m["engine/preemptions"] == 0 and 0 < m["engine/pages_used_frac"] < 1  # pages for what exists
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    turns = [s["turns"] for s in samples]
    assert turns and any(len(t) == 2 and "[tool]42" in t[0]["env"] for t in turns)
    html = write_report(run_dir)[0].read_text()
    assert "Episodes: turns and tool calls" in html and "Episode tokens" in html


def test_a_resumed_multi_turn_run_equals_the_uninterrupted_one(episode_run, tmp_path):
    """Stopped after step 3 (its logs written), newest checkpoint at step 2: the rerun plays the
    episodes of steps 3 and 4 again and ends where the uninterrupted run ended."""
    path, run_dir = episode_run
    copy = tmp_path / "stopped"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "4")
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= 3))
    train(load_config(path), run_dir=str(copy))
    assert_same_run(run_dir, copy)


def test_an_environment_the_run_cannot_use_is_refused_before_sampling(episode_config, tmp_path):
    root, cfg = episode_config
    for change, message in [({"name": f"{root / 'one_tool.py'}:OneTol"}, "has no 'OneTol'"),
                            ({"kwargs": {"answr": 1}}, "do not fit OneTool"),
                            ({"max_turns": 0}, "max_turns must be > 0")]:
        bad = copy.deepcopy(cfg)
        bad["environment"].update(change)
        with pytest.raises((ConfigError, ValueError), match=message):
            train(load_config(write_config(tmp_path, bad)), run_dir=str(tmp_path / "bad"))
    static = copy.deepcopy(cfg)
    static["sampling"]["engine"] = "static"
    static["data"]["chat_template"] = "never"
    static["sampling"]["min_new_tokens"] = 2
    with pytest.raises(ConfigError, match="continuous or paged engine.*min_new_tokens.*chat_template: never"):
        load_config(write_config(tmp_path, static))


def test_the_warm_start_learns_from_worked_episodes_the_environment_answers(episode_config, tmp_path):
    """sft.turns: each worked episode is the trajectory a sampled one with these turns would hold
    (the whole conversation as the chat template renders it), the loss only on the model's turns; a
    turn the sampler would have cut earlier, or turns that leave the episode open, are refused."""
    from grpo_jax.runtime.sharding import place_model
    from grpo_jax.models.build import build_model
    from grpo_jax.trainer.prepare import prepare
    from grpo_jax.trainer.warm_start import warm_start, worked_batch

    _, cfg = episode_config
    cfg = copy.deepcopy(cfg)
    cfg["sft"] = {"steps": 3, "batch_size": 8, "learning_rate": 0.003, "turns": ["call {answer}!", "it is {answer}"]}
    cfg["sampling"]["stop_token_ids"] = [2]  # <eos> only (the fixture's digits would end these turns early)
    prepared = prepare(load_config(write_config(tmp_path, cfg)))
    tok = prepared.model.tokenizer
    examples = prepared.sft_stream.next_batch(8)
    counts = {"failed": 0, "first": None}
    prompts, ids, masks, width = worked_batch(prepared, examples, counts)
    assert counts["failed"] == 0 and width == 16 + 40  # the trajectory's capacity
    for ex, p, c, m in zip(examples, prompts, ids, masks):
        a, q = ex.fields["answer"], ex.fields["prompt_messages"][-1]["content"]
        conversation = [{"role": "user", "content": q}, {"role": "assistant", "content": f"call {a}!"},
                        {"role": "tool", "content": "42"}, {"role": "assistant", "content": f"it is {a}"}]
        # The template closes the last turn with a newline after <eos>, where the model stops.
        assert tok.decode(p + c) + "\n" == tok.apply_chat_template(conversation, tokenize=False)
        model_text = tok.decode([t for t, k in zip(c, m) if k])
        assert model_text == f"call {a}!<eos>it is {a}<eos>"  # the env's tokens have mask 0
    model = build_model(prepared.config.model, prepared.model.config, 0, prepared.mesh)
    place_model(model, prepared.mesh)
    losses = warm_start(prepared, model, log=lambda line: None)
    assert len(losses) == 3 and losses[-1] < losses[0]

    for turns, message in [(["call {answer}"], "was not over after the 1 turns"),
                           (["{nope}", "x"], "KeyError: 'nope'")]:
        bad = copy.deepcopy(cfg)
        bad["sft"]["turns"] = turns
        with pytest.raises(ConfigError, match=message):
            worked_batch(prepare(load_config(write_config(tmp_path, bad))), examples, dict(counts))
    bad = copy.deepcopy(cfg)
    bad["sampling"]["stop_token_ids"] = [tok.convert_tokens_to_ids("!"), tok.eos_token_id]
    with pytest.raises(ConfigError, match="would end before its end when sampled"):
        worked_batch(prepare(load_config(write_config(tmp_path, bad))), examples, dict(counts))


def test_sft_turns_need_an_environment_and_an_environment_warm_start_needs_turns(episode_config, tmp_path):
    _, cfg = episode_config
    no_turns = copy.deepcopy(cfg)
    no_turns["sft"] = {"steps": 2}
    with pytest.raises(ConfigError, match="needs sft.turns"):
        load_config(write_config(tmp_path, no_turns))
    no_env = copy.deepcopy(cfg)
    no_env.pop("environment")
    no_env["sampling"]["engine"] = "static"
    no_env["sft"] = {"steps": 2, "turns": ["{answer}"]}
    with pytest.raises(ConfigError, match="sft.turns are the model's turns of worked episodes"):
        load_config(write_config(tmp_path, no_env))


def test_a_step_whose_every_episode_failed_stops_the_run_with_its_checkpoint(episode_config, tmp_path, capsys):
    """An environment whose reset hangs: every episode times out (each at timeout_s, side by side),
    and the run saves the step and stops with the reason in one line (exit status 1)."""
    _, cfg = episode_config
    (tmp_path / "hangs.py").write_text(
        "import time\n"
        "class Hangs:\n"
        "    def reset(self, example):\n        time.sleep(3600)\n"
        "    def step(self, completion):\n        return None\n")
    bad = copy.deepcopy(cfg)
    bad["environment"].update(name=f"{tmp_path / 'hangs.py'}:Hangs", kwargs={}, timeout_s=0.3)
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(["train", "--config", write_config(tmp_path, bad), "--output", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"grpo-jax train: error: every episode of step 1 failed; the first: {tmp_path}/hangs.py:"
                           "Hangs.reset: CallTimeout: took longer than 0.3 s; the run stopped after step 1 of 4"), last
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1"]
    assert [r["env/errors"] for r in read_metrics(out) if "train/loss" in r] == [16.0]

