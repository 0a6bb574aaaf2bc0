"""TFDS builders and load_source: seeded synthetic sets, GSM8K from local files, error messages."""

from __future__ import annotations

import ast
import collections
import json
import operator
import re
import socket
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from grpo_jax.data import ArithmeticConfig, load_source
from grpo_jax.env.calculator import calculate

SMALL = {"num_train": 60, "num_test": 20}


def rows(source) -> list[dict]:
    return [source[i] for i in range(len(source))]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tfds")


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "arithmetic_preferences", "arithmetic_chain"])
def test_synthetic_deterministic_per_seed_and_splits_disjoint(name, data_dir, tmp_path):
    train = rows(load_source(name, "train", data_dir=data_dir, seed=1, **SMALL))
    test = rows(load_source(name, "test", data_dir=data_dir, seed=1, **SMALL))
    # The same config built elsewhere gives the same rows; another seed gives other rows.
    again = rows(load_source(name, "train", data_dir=tmp_path / "other", seed=1, **SMALL))
    other_seed = rows(load_source(name, "train", data_dir=data_dir, seed=2, **SMALL))
    assert (len(train), len(test)) == (60, 20)
    assert train == again
    assert [r["question"] for r in train] != [r["question"] for r in other_seed]
    assert all(isinstance(r["question"], str) and isinstance(r["answer"], str) for r in train + test)
    assert len({r["id"] for r in train + test}) == 80

    def problem(row):  # the wording-independent problem
        if name == "countdown":
            return tuple(sorted(row["numbers"])), row["target"]
        return tuple(re.findall(r"\d+|[-+*/]", row["question"]))

    assert len({problem(r) for r in train}) == 60  # distinct problems within a split...
    assert not {problem(r) for r in train} & {problem(r) for r in test}  # ...and across splits


@pytest.mark.parametrize("kinds", [None, ["wrong", "digit", "verbose"]])
def test_preference_pairs_prefer_the_right_concise_answer(data_dir, kinds):
    source = load_source("arithmetic_preferences", "train", data_dir=data_dir, num_train=300, num_test=10, max_offset=4,
                         **({"kinds": kinds} if kinds else {}))
    seen, moved = set(), set()
    for row in rows(source):
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["question"]).groups())
        assert row["chosen"] == row["answer"] == str(a + b)
        seen.add(row["kind"])
        if row["kind"] == "wrong":
            assert 1 <= abs(int(row["rejected"]) - (a + b)) <= 4
        elif row["kind"] == "digit":  # one digit one up or down, no leading zero
            chosen, rejected = row["chosen"], row["rejected"]
            assert len(rejected) == len(chosen) and (rejected[0] != "0" or len(rejected) == 1)
            diff = [i for i in range(len(chosen)) if chosen[i] != rejected[i]]
            assert len(diff) == 1 and abs(int(rejected[diff[0]]) - int(chosen[diff[0]])) == 1
            moved.add(len(chosen) - diff[0])  # 1 = the last digit, 2 = tens, ...
        else:  # the right number, buried in filler
            assert row["rejected"] != row["chosen"] and re.findall(r"\d+", row["rejected"]) == [row["chosen"]]
    assert seen == set(kinds or ["wrong", "verbose"])  # the default keeps the first datasets' kinds
    assert moved == ({1, 2, 3} if kinds else set())
    with pytest.raises(ValueError, match="kinds must be a non-empty subset"):
        load_source("arithmetic_preferences", "train", data_dir=data_dir, kinds=["rude"])


def test_more_train_rows_leave_the_test_split_unchanged(data_dir):
    test_a = rows(load_source("arithmetic", "test", data_dir=data_dir, num_train=30, num_test=10))
    test_b = rows(load_source("arithmetic", "test", data_dir=data_dir, num_train=50, num_test=10))
    assert test_a == test_b


def test_arithmetic_answers_correct(data_dir):
    source = load_source(
        "arithmetic", "train", data_dir=data_dir, digits=2, ops=["+", "-", "*", "/"], num_train=200, num_test=10
    )
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": Fraction}
    seen_ops, seen_formats = set(), set()
    for row in rows(source):
        m = re.fullmatch(r"What is (\d+) ([-+*/]) (\d+)\?|(\d+)([-+*/])(\d+)=", row["question"])
        assert m, row
        a, op, b = [g for g in m.groups() if g is not None]
        seen_ops.add(op)
        seen_formats.add(row["question"].startswith("What"))
        assert 10 <= int(b) <= 99
        value = ops[op](int(a), int(b))
        assert value == int(row["answer"]) and value >= 0  # exact division, no negative results
    assert seen_ops == set("+-*/") and seen_formats == {True, False}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Value of an arithmetic expression (exact) and the numbers it uses."""
    used = []

    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            used.append(node.value)
            return Fraction(node.value)
        raise AssertionError(f"unexpected syntax in {expression!r}")

    return ev(ast.parse(expression, mode="eval").body), used


def _reachable(numbers: list[int], target: int) -> bool:
    """Brute force: can some subset of numbers reach target with + - * / (exact rationals)?"""
    values = [Fraction(n) for n in numbers]
    if target in values:
        return True
    for i in range(len(values)):
        for j in range(len(values)):
            if i == j:
                continue
            rest = [v for k, v in enumerate(values) if k not in (i, j)]
            a, b = values[i], values[j]
            results = [a + b, a - b, a * b] + ([a / b] if b else [])
            if any(_reachable(rest + [r], target) for r in results):
                return True
    return False


def test_countdown_targets_reachable(data_dir):
    source = load_source("countdown", "train", data_dir=data_dir, num_train=40, num_test=5, seed=3)
    for row in rows(source):
        value, used = _evaluate(row["answer"])
        assert value == row["target"], row
        assert not collections.Counter(used) - collections.Counter(row["numbers"]), row  # each number at most once
        assert row["target"] not in row["numbers"] and 1 <= row["target"] <= 100
        assert _reachable(row["numbers"], row["target"])
        assert row["question"] == (
            f"Using the numbers {row['numbers']}, reach {row['target']} with + - * / (each number at most once)."
        )


GSM8K_ROWS = {
    "train": [("Tom has 3 apples and buys 4. How many?", "3 + 4 = <<3+4=7>>7\n#### 7"),
              ("Ann reads 5 pages a day for 2 days. Pages?", "5 * 2 = <<5*2=10>>10\n#### 10")],
    "test": [("What is 6 halved?", "6 / 2 = <<6/2=3>>3\n#### 3")],
    "train_socratic": [("Socratic q?", "How many? ** 1 + 1 = 2\n#### 2")],
    "test_socratic": [("Socratic t?", "How many? ** 2 + 2 = 4\n#### 4")],
}


def write_gsm8k(directory: Path, splits=tuple(GSM8K_ROWS)) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split in splits:
        lines = [json.dumps({"question": q, "answer": a}) for q, a in GSM8K_ROWS[split]]
        (directory / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def test_gsm8k_builds_from_local_files(tmp_path):
    manual = write_gsm8k(tmp_path / "manual")
    train = rows(load_source("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=manual))
    got = sorted((r["question"], r["answer"], r["short_answer"]) for r in train)
    want = sorted((q, a, a.split("#### ")[1]) for q, a in GSM8K_ROWS["train"])
    assert got == want
    test = load_source("gsm8k", "test_socratic", data_dir=tmp_path / "tfds", manual_dir=manual)
    assert [r["answer"] for r in rows(test)] == ["How many? ** 2 + 2 = 4\n#### 4"]
    # Prepared data is reused without the manual files (and without network).
    for f in manual.iterdir():
        f.unlink()
    assert len(load_source("gsm8k", "test", data_dir=tmp_path / "tfds", manual_dir=manual)) == 1
    assert (tmp_path / "tfds" / "gsm8k" / "1.0.0").is_dir()  # the stock builder's layout


def test_gsm8k_missing_file_named(tmp_path):
    manual = write_gsm8k(tmp_path / "manual", splits=("train", "test", "train_socratic"))
    with pytest.raises(FileNotFoundError, match=r"test_socratic\.jsonl") as err:
        load_source("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=manual)
    assert str(manual / "test_socratic.jsonl") in str(err.value)
    assert "train.jsonl" not in str(err.value).split("missing")[0]  # only the missing one is listed
    with pytest.raises(FileNotFoundError, match="does not exist.*train.jsonl"):
        load_source("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "nowhere")


def test_gsm8k_offline_without_manual_dir_fails_fast(tmp_path, monkeypatch):
    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(ConnectionError, match=r"pass manual_dir=DIR holding train\.jsonl"):
        load_source("gsm8k", "train", data_dir=tmp_path)


def test_gsm8k_bad_line_names_file_and_line(tmp_path):
    manual = write_gsm8k(tmp_path / "manual")
    with open(manual / "test.jsonl", "a") as f:
        f.write(json.dumps({"question": "q", "answer": "no final marker"}) + "\n")
    with pytest.raises(ValueError, match=r"test\.jsonl line 2"):
        load_source("gsm8k", "test", data_dir=tmp_path / "tfds", manual_dir=manual)


def test_a_chains_derivation_is_its_running_totals_and_the_strict_verifier_accepts_it(data_dir):
    from grpo_jax.rewards.math import math_accuracy

    rows_ = rows(load_source("arithmetic_chain", "test", data_dir=data_dir, builder_config="long", num_train=40,
                             num_test=30))
    for r in rows_:
        start, *moves = re.findall(r"[-+]?\d+", r["question"])
        totals = list(np.cumsum([int(start), *map(int, moves)])[1:])
        assert [int(t) for t in r["derivation"].split()] == totals and r["steps"] == 8 == len(moves)
        assert all(0 <= t <= 99 for t in totals) and r["answer"] == str(totals[-1])
    assert math_accuracy([""] * 30, [r["derivation"] for r in rows_], answer=[r["answer"] for r in rows_]) == [1.0] * 30


def test_load_source_errors(data_dir, tmp_path):
    valid = r"\['arithmetic', 'countdown', 'word_problems', 'arithmetic_preferences', 'arithmetic_chain', 'gsm8k'\]"
    with pytest.raises(ValueError, match=rf"unknown dataset 'gsm8K'.*{valid}.*did you mean 'gsm8k'"):
        load_source("gsm8K", "train", data_dir=data_dir)
    with pytest.raises(ValueError, match=r"no split 'tset'.*\['test', 'train'\].*did you mean 'test'"):
        load_source("arithmetic", "tset", data_dir=data_dir, **SMALL)
    with pytest.raises(ValueError, match=r"no builder config 'smal'.*did you mean 'small'"):
        load_source("arithmetic", "train", data_dir=data_dir, builder_config="smal")
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['digit'\].*'digits'"):
        load_source("arithmetic", "train", data_dir=data_dir, digit=3)
    with pytest.raises(ValueError, match="found only .* distinct problems"):
        load_source("arithmetic", "train", data_dir=tmp_path, digits=1, ops=["+"], num_train=90, num_test=20)
    with pytest.raises(TypeError, match="needs a CountdownConfig"):
        load_source("countdown", "train", data_dir=data_dir, builder_config=ArithmeticConfig(name="a"))
    with pytest.raises(ValueError, match="ops must be"):
        ArithmeticConfig(name="x", ops=("^",))
    # A custom config whose name is reused with other parameters is refused, not silently read.
    mine = ArithmeticConfig(name="mine", num_train=5, num_test=2)
    load_source("arithmetic", "train", data_dir=tmp_path, builder_config=mine)
    with pytest.raises(ValueError, match="was prepared with parameters"):
        mine_again = ArithmeticConfig(name="mine", num_train=6, num_test=2)
        load_source("arithmetic", "train", data_dir=tmp_path, builder_config=mine_again)


def test_source_rows_are_python_values(data_dir):
    source = load_source("countdown", "test", data_dir=data_dir, **SMALL)
    row = source[-1]
    assert row == source[len(source) - 1]
    assert type(row["target"]) is int and all(type(n) is int for n in row["numbers"])
    with pytest.raises(IndexError, match="out of range"):
        source[len(source)]


def _word_problem_key(question: str) -> tuple:
    """The story with names, items and numbers taken out, and its numbers: the builder's notion of
    one problem, recovered from the text alone."""
    from grpo_jax.data.word_problems import ITEMS, NAMES

    skeleton = re.sub(r"\b(" + "|".join(NAMES + ITEMS) + r")\b", "_", question)
    return re.sub(r"\d+", "#", skeleton), tuple(int(n) for n in re.findall(r"\d+", question))


@pytest.mark.parametrize("config, steps", [("one_step", {1}), ("easy", {1, 2}), ("hard", {2, 3})])
def test_word_problems_worked_answers_are_right_and_splits_disjoint(config, steps, data_dir):
    kw = {"builder_config": config, "num_train": 150, "num_test": 30}
    train = rows(load_source("word_problems", "train", data_dir=data_dir, **kw))
    test = rows(load_source("word_problems", "test", data_dir=data_dir, **kw))
    assert train == rows(load_source("word_problems", "train", data_dir=data_dir / "again", **kw))  # seeded
    seen_steps = set()
    for row in train + test:
        *lines, last = row["solution"].split("\n")
        assert last == f"#### {row['answer']}", row
        seen_steps.add(len(lines))
        numbers = collections.Counter(int(n) for n in re.findall(r"\d+", row["question"]))
        results = []
        for line in lines:
            expression, value = line.rsplit(" = ", 1)
            exact, used = _evaluate(expression)
            assert exact == int(value) and int(value) >= 0, row  # exact division, nothing negative
            # every operand is a number of the question, an earlier result, or the story's "2" (split with a sibling)
            assert all(n in numbers or n in results or (n == 2 and "sibling" in row["question"]) for n in used), row
            results.append(int(value))
        assert results[-1] == int(row["answer"])
        assert calculate(row["expression"]) == row["answer"], row  # the whole computation in one expression
    assert seen_steps == steps
    train_keys, test_keys = {_word_problem_key(r["question"]) for r in train}, {_word_problem_key(r["question"]) for r in test}
    assert len(train_keys) == len(train) and not train_keys & test_keys


def test_without_commutative_twins_no_test_sum_is_a_train_sums_twin(data_dir):
    def pairs(twins, split):
        source = load_source("arithmetic", split, data_dir=data_dir, builder_config="small", num_train=2000,
                             num_test=300, ops=["+"], formats=["{a}{op}{b}="], commutative_twins=twins)
        return [tuple(sorted(map(int, re.findall(r"\d+", r["question"])))) for r in rows(source)]

    leaked = set(pairs(True, "test")) & set(pairs(True, "train"))
    assert len(leaked) > 20  # the original sets: 2000 of 8100 ordered pairs drawn, twins land apart
    assert not set(pairs(False, "test")) & set(pairs(False, "train"))
    assert len(set(pairs(False, "train"))) == 2000  # and no twins within a split either
