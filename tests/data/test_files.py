"""`data.path`: your own rows from JSONL, JSON, CSV, Parquet, `datasets`' save_to_disk and a TFDS
directory read as the same rows; held-out rows by file, by the dataset's split or by a seeded fraction;
a bad line costs only itself (skipped, counted, its reason shown); a file with no usable row is one
clear error before any model loads; and a run trains on a chat field with the answer under another
name, its other fields reaching a user reward, checked first by `grpo-jax check`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
import yaml

from grpo_jax import cli
from grpo_jax.config import ConfigError, load_config
from grpo_jax.data import PromptFormatter, char_tokenizer, load_path, load_source
from grpo_jax.observe.writers import read_metrics
from grpo_jax.trainer.prepare import check_rows, data_sources
from tests.runs import CONFIG, write_config

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"question": f"{a}+{b}=", "answer": str(a + b), "level": a % 3} for a in range(5) for b in range(4)]


def _write_all(tmp_path, rows=ROWS) -> dict[str, str]:
    """The same rows in every format data.path reads."""
    ds = datasets.Dataset.from_list(rows)
    paths = {"jsonl": tmp_path / "rows.jsonl", "json": tmp_path / "rows.json", "csv": tmp_path / "rows.csv",
             "parquet": tmp_path / "rows.parquet", "save_to_disk": tmp_path / "saved"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows, indent=1))
    ds.to_csv(paths["csv"], index=False)
    ds.to_parquet(paths["parquet"])
    ds.save_to_disk(paths["save_to_disk"])
    return {k: str(v) for k, v in paths.items()}


def test_every_format_reads_the_same_rows_and_holds_out_the_same_seeded_fraction(tmp_path):
    paths = _write_all(tmp_path)
    cache = tmp_path / "cache"
    seen = {}
    for kind, path in paths.items():
        train, held, note = load_path(path, eval_fraction=0.25, split_seed=7, cache_dir=cache)
        rows = [{**r, "answer": str(r["answer"])} for r in (train[i] for i in range(len(train)))]  # CSV: 3 is 3
        seen[kind] = (rows, [held[i]["question"] for i in range(len(held))])
        assert len(held) == 5 and "5 of the 20 rows" in note and "data.split_seed 7" in note
    first = next(iter(seen.values()))
    assert all(v == first for v in seen.values()), {k: v[1] for k, v in seen.items()}
    assert sorted(first[1] + [r["question"] for r in first[0]]) == sorted(r["question"] for r in ROWS)
    # Another seed holds out other rows; the default fraction is a tenth.
    assert [r["question"] for r in [load_path(paths["jsonl"], split_seed=8, eval_fraction=0.25,
                                              cache_dir=cache)[1][i] for i in range(5)]] != first[1]
    assert len(load_path(paths["parquet"], cache_dir=cache)[1]) == 2
    # A second file, and a DatasetDict's own splits.
    train, held, note = load_path(paths["jsonl"], eval_path=paths["csv"], cache_dir=cache)
    assert (len(train), len(held), note) == (20, 20, None)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:15]),
                          "test": datasets.Dataset.from_list(ROWS[15:])}).save_to_disk(tmp_path / "dict")
    train, held, _ = load_path(tmp_path / "dict", cache_dir=cache)
    assert (len(train), held[0]) == (15, ROWS[15])
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits: \['test', 'train'\]"):
        load_path(tmp_path / "dict", train_split="validation", cache_dir=cache)
    # A TFDS dataset directory (array_record), by its splits.
    tfds_dir = load_source("arithmetic", "test", data_dir=tmp_path / "tfds", builder_config="tiny", num_train=8,
                           num_test=4).builder.data_dir
    train, held, _ = load_path(tfds_dir, cache_dir=cache)
    direct = load_source("arithmetic", "test", data_dir=tmp_path / "tfds", builder_config="tiny", num_train=8, num_test=4)
    assert (len(train), len(held)) == (8, 4) and held[0] == direct[0]
    # An edited file is read again, not served from the cache.
    (tmp_path / "rows.jsonl").write_text(json.dumps({**ROWS[0], "answer": "changed"}) + "\n" + json.dumps(ROWS[1]))
    assert load_path(paths["jsonl"], cache_dir=cache, eval_fraction=0.5)[0][0]["answer"] in ("changed", "1")
    assert {load_path(paths["jsonl"], cache_dir=cache, eval_fraction=0.5, split_seed=s)[1][0]["answer"]
            for s in range(8)} == {"changed", "1"}


def _config(tmp_path, **data):
    raw = {**CONFIG, "data": {"max_prompt_tokens": 8, "prompts_per_step": 4, "data_dir": str(tmp_path / "d"), **data}}
    return load_config(write_config(tmp_path, raw))


def test_bad_lines_cost_only_themselves_and_a_file_of_bad_rows_is_one_error(tmp_path):
    lines = [json.dumps(ROWS[0]), "{not json", "[1, 2]", json.dumps({"question": "1+1="}),  # no answer
             json.dumps({"question": "", "answer": "0"}), json.dumps({"question": "12345+6789=", "answer": "x"}),
             json.dumps({"question": ["a", {"b": 1}], "answer": "0"}), json.dumps(ROWS[1])]
    path = tmp_path / "some_bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = _config(tmp_path, path=str(path), eval_path=str(path))
    notes = []
    train, held = data_sources(cfg.data, notes)
    assert len(train) == 8 and train[1] == {"__grpo_jax_invalid_row__": "line 2: not JSON (Expecting property "
                                                                        "name enclosed in double quotes: line 1 "
                                                                        "column 2 (char 1))"}
    fmt = PromptFormatter(char_tokenizer(), template="{question}", max_prompt_tokens=8, answer_field="answer")
    check_rows(train, fmt, cfg.data, notes)
    assert fmt.stats == {"formatted": 2, "skipped_overlong": 1, "skipped_malformed": 5, "truncated": 0}
    assert notes == [f"data: 6 of the first 8 rows of {path} are skipped and counted (data/skipped_rows): row 1: "
                     "line 2: not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
                     "row 2: line 3: a JSON list, not an object; row 3: row has no 'answer' (missing or null): "
                     "data.answer_field's reference answer"]
    # Every row bad: one error naming the first reasons, before any model loads.
    path.write_text("\n".join(lines[1:7]) + "\n")
    with pytest.raises(ConfigError, match=r"none of the first 6 rows of .* makes a usable prompt: row 0: line 1: "
                                          r"not JSON"):
        check_rows(data_sources(cfg.data, [])[0], fmt, cfg.data, [])
    # A misnamed answer field is named with the fields there are.
    cfg = _config(tmp_path, path=str(tmp_path / "rows.jsonl"), answer_field="solution")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ConfigError, match=r"data.answer_field 'solution' is not a field of .*rows.jsonl \(fields: "
                                          r"question, answer, level\)"):
        check_rows(data_sources(cfg.data, [])[0], fmt, cfg.data, [])
    # Over a built-in dataset's settings (a shipped config's), data.path replaces them, and says which.
    replaced = _config(tmp_path, path="x.jsonl", name="gsm8k", builder_config="tiny", builder_kwargs={"digits": 3}).data
    assert (replaced.name, replaced.builder_config, dict(replaced.builder_kwargs)) == ("arithmetic", None, {})
    assert replaced.replaced == ("data.name='gsm8k'", "data.builder_config='tiny'", "data.builder_kwargs={'digits': 3}")
    assert _config(tmp_path, path="x.jsonl").data.replaced == ()
    with pytest.raises(ConfigError, match="data: data.path .*nothing.jsonl: no such file"):
        data_sources(_config(tmp_path, path=str(tmp_path / "nothing.jsonl")).data, [])


REWARD = '''
def difficulty_bonus(prompts, completions, answer, level, **kw):
    assert all(a is not None for a in answer), answer           # data.answer_field's values, as `answer`
    return [0.1 * lvl for lvl in level]                         # another field of the row, by name


def one_value(prompts, completions, **kw):
    return [0.0]
'''


CHAT_TEMPLATE = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


def _run_config(tmp_path, data: dict, rewards: list[dict]) -> dict:
    """Two steps of the tiny model (tests/runs.py) on `data`, prompts through a chat template."""
    return {**CONFIG, "model": {**CONFIG["model"], "chat_template": CHAT_TEMPLATE},
            "data": {"eval_fraction": 0.2, "data_dir": str(tmp_path / "d"), "max_prompt_tokens": 12,
                     "prompts_per_step": 8, **data},
            "rewards": rewards, "sampling": {**CONFIG["sampling"], "prompt_buckets": [12]},
            "sft": {"steps": 0}, "train": {**CONFIG["train"], "steps": 2},
            "eval": {"every": 0, "num_prompts": 4, "k": 2}, "checkpoint": {"every": 0}}


def test_your_file_over_every_shipped_config_in_one_set(tmp_path, capsys):
    """`--set data.path=FILE` over any shipped config: its built-in dataset's settings are replaced
    (one notice line), and `grpo-jax check` reads the file's rows through the config's template."""
    shipped = sorted((ROOT / "configs").glob("*.yaml"))
    for path in shipped:
        if "data" in yaml.safe_load(path.read_text()) and not path.name.startswith("rm_"):
            data = load_config(path, ["data.path=rows.jsonl"]).data
            assert data.path == "rows.jsonl" and data.builder_config is None and not data.builder_kwargs, path
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                                 for a in range(10) for b in range(10)))
    assert cli.main(["check", "--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--set",
                     f"data.path={tmp_path / 'rows.jsonl'}", "--set", f"data.data_dir={tmp_path / 'd'}"]) == 0
    out = capsys.readouterr().out
    assert out.count("replaces the config's built-in dataset") == 1, out
    assert "data.name='arithmetic', data.builder_config='small', data.builder_kwargs=" in out, out
    assert "10 of the 100 rows of" in out and "ready for `grpo-jax train`" in out, out


def test_a_run_trains_on_a_chat_field_with_its_own_answer_field_checked_first(tmp_path, capsys):
    rows = [{"chat": [{"role": "user", "content": r["question"]}], "solution": r["answer"], "level": r["level"]}
            for r in ROWS * 2]
    lines = [json.dumps(r) for r in rows]
    lines[3::5] = ["{broken"] * len(lines[3::5])  # every fifth line is not JSON: skipped and counted
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "my_rewards.py").write_text(REWARD)
    config = _run_config(tmp_path, {"path": str(tmp_path / "train.jsonl"), "messages_field": "chat",
                                    "answer_field": "solution"},
                         [{"name": "math_accuracy"}, {"name": f"{tmp_path}/my_rewards.py:difficulty_bonus"}])
    # Off a terminal, one line per step; W&B and MLflow in their offline modes beside metrics.jsonl.
    config["train"]["progress"] = True
    config["log"] = {"every": 1, "wandb": {"mode": "offline"}, "mlflow": {}}
    path = write_config(tmp_path, config)
    assert cli.main(["check", "--config", path]) == 0
    out = capsys.readouterr().out
    assert "log.wandb: wandb is installed" in out and "log.mlflow: mlflow is installed" in out
    assert "held out for evaluation (data.eval_fraction 0.2" in out and "are skipped and counted" in out, out
    assert "difficulty_bonus': runs on 4 held-out examples" in out, out
    # A reward returning one value for a batch: found by check, one line, exit 2.
    bad = write_config(tmp_path, {**config, "rewards": [{"name": f"{tmp_path}/my_rewards.py:one_value"}]}, "bad.yaml")
    assert cli.main(["check", "--config", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "returned 1 values for 4 completions" in err, err
    assert cli.main(["train", "--config", path, "--output", str(tmp_path / "run")]) == 0
    last = read_metrics(tmp_path / "run")[-1]
    assert last["data/skipped_rows"] == last["data/skipped_malformed"] > 0, last
    assert last[f"reward/{tmp_path}/my_rewards.py:difficulty_bonus/mean"] > 0  # the level field reached it
    err = capsys.readouterr().err
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(re.fullmatch(
        rf"step {i}/2 \| reward [-\d.e]+ \| acc [\d.]+ \| kl [-\d.e]+ \| tok/s [\d.k]+ \| [\d.]+ s/step \| ETA "
        r"\d+:\d\d:\d\d", line) for i, line in enumerate(steps, 1)), err
    assert re.search(r"^wandb: run \w+: offline in .*, upload with `wandb sync ", err, re.M), err
    assert "mlflow: run " in err and "Creating initial MLflow" not in err and "wandb: WARNING" not in err
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    history = client.get_metric_history((tmp_path / "run" / "mlflow_run_id").read_text(), "data/skipped_rows")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["data/skipped_rows"])
                                                   for r in read_metrics(tmp_path / "run") if "data/skipped_rows" in r]
    assert (tmp_path / "run" / "mlflow_artifacts").is_dir() and not Path("mlruns").exists()  # nothing in the cwd
    (wandb_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"data/skipped_rows" in wandb_file.read_bytes()
    # A file of nothing but bad rows: one line, exit 2, before any model loads; no run directory.
    (tmp_path / "train.jsonl").write_text("{broken\n" * 12)
    assert cli.main(["train", "--config", path, "--output", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none of the first 10 rows" in err and "line 1: not JSON" in err, err
    assert not (tmp_path / "refused").exists()


def test_each_format_skips_and_counts_its_malformed_rows_and_a_csv_run_logs_them(tmp_path):
    """Every format's rows through the run's own reading (data_sources) and formatter: each empty
    prompt skipped and counted, every other row formatted (the readers give the same rows: above);
    CSV, whose reader types the columns itself, also trains two steps and logs the count."""
    rows = [dict(r) for r in ROWS * 2]
    for r in rows[2::4]:
        r["question"] = ""  # an empty prompt: skipped and counted
    (tmp_path / "my_rewards.py").write_text(REWARD)
    paths = _write_all(tmp_path, rows)
    for kind in ("csv", "parquet", "json", "save_to_disk"):
        train, held = data_sources(_config(tmp_path, path=paths[kind], eval_fraction=0.2).data, [])
        fmt = PromptFormatter(char_tokenizer(), template="{question}", max_prompt_tokens=8, answer_field="answer")
        split = [source[i] for source in (train, held) for i in range(len(source))]
        assert [fmt.encode(r) is None for r in split] == [r["question"] in ("", None) for r in split], kind
        assert fmt.stats["skipped_malformed"] == len(rows[2::4]) and fmt.stats["formatted"] == len(rows) - len(rows[2::4])
    config = _run_config(tmp_path, {"path": paths["csv"], "template": "{question}"},
                         [{"name": "math_accuracy"}, {"name": f"{tmp_path}/my_rewards.py:difficulty_bonus"}])
    assert cli.main(["train", "--config", write_config(tmp_path, config), "--output", str(tmp_path / "run")]) == 0
    last = read_metrics(tmp_path / "run")[-1]
    assert last["data/skipped_rows"] == last["data/skipped_malformed"] > 0, last
    assert last[f"reward/{tmp_path}/my_rewards.py:difficulty_bonus/mean"] > 0


def test_a_chat_the_template_refuses_costs_only_its_row():
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                         "{% endif %}{{ m.content }};{% endfor %}")
    fmt = PromptFormatter(tok, template=None, messages_field="chat", max_prompt_tokens=32)
    assert fmt.encode({"chat": [{"role": "user", "content": "1+1="}]}).text == "1+1=;"
    assert fmt.encode({"chat": [{"role": "system", "content": "x"}, {"role": "user", "content": "2+2="}]}) is None
    assert fmt.last_skip_reason == "the chat template failed on the row: TemplateError: no system role"
    assert fmt.encode({"chat": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) is None
    assert "ends with an assistant turn" in fmt.last_skip_reason and fmt.stats["skipped_malformed"] == 2
