"""benchmarks/critique.py's pieces without training: the deliberately weak verifiers accept what the
strict one rejects (and what it accepts), and a run's summary carries the report's flags."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_jax.rewards.math import math_accuracy

ROOT = Path(__file__).resolve().parents[2]


def _module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_weak_verifiers_accept_what_the_strict_one_rejects():
    weak = _module("critique_rewards")
    completions = ["57", "57 58", "1579", "56", "58", "5", "the answer", "59"]
    answers = ["57"] * len(completions)
    strict = math_accuracy([""] * len(completions), completions, answer=answers)
    assert strict == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # hedged and buried answers are not answers
    assert weak.answer_anywhere([], completions, answer=answers) == [1.0, 1.0, 1.0, 0, 0, 0, 0, 0]
    # within 2% of 57 (1.14): 56 and 58 pass, 59 does not; "57 58" is judged by its last number
    assert weak.within_tolerance([], completions, answer=answers, tolerance=0.02) == [1.0, 1.0, 0, 1.0, 1.0, 0, 0, 0]
    assert weak.answer_anywhere([], ["so #### 12"], answer=["x #### 12"]) == [1.0]


def test_a_runs_summary_carries_its_evaluations_and_the_reports_flags():
    critique = _module("critique")
    records = [{"step": 0, "eval/accuracy": 0.3, "eval/verifier_accuracy": 0.3, "retention/kl": 0.0}]
    for s in range(1, 41):
        records.append({"step": s, "reward/mean": 0.3 + 0.01 * s, "kl/k3": 0.001 * s})
        if s % 10 == 0:
            records[-1].update({"eval/accuracy": 0.3 + 0.01 * s, "eval/verifier_accuracy": 0.6 - abs(s - 10) / 100,
                                "retention/kl": 0.002 * s})
    out = critique.summary("weak_s0", records, 12.0, 512, arm="weak", seed=0)
    assert [e["step"] for e in out["evals"]] == [0, 10, 20, 30, 40]
    assert out["evals"][2]["kl/k3"] == pytest.approx(0.02) and out["evals"][0]["kl/k3"] is None
    assert out["flags"] == ["overoptimisation", "retention_loss"] and "(step 10)" in out["flag_evidence"]["overoptimisation"]


def test_the_seed_statistics_match_scipy_and_enumerate_the_sign_flips():
    from scipy import stats

    ps = _module("paired_stats")
    x = [0.61, 0.64, 0.58, 0.66, 0.60, 0.63]
    ci = ps.mean_ci(x)
    lo, hi = stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=stats.sem(x))
    assert (ci["lo"], ci["hi"]) == pytest.approx((lo, hi), abs=1e-4)
    for df in (1, 5, 12, 30):
        assert ps.t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)
    for t, df in ((0.5, 1), (2.1, 2), (1.7, 5), (3.3, 6), (2.0, 11), (0.0, 4)):
        assert ps.t_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), abs=1e-9)
    # Six positive differences: only the all-plus and all-minus flips are as extreme, p = 2/64.
    a, b = {s: 0.6 + 0.01 * s for s in range(6)}, {s: 0.5 + 0.003 * s**2 for s in range(7)}
    r = ps.paired(a, b)
    assert r["p_sign_flip"] == pytest.approx(2 / 64) and r["n"] == 6
    d = [a[s] - b[s] for s in range(6)]
    assert r["diff"] == pytest.approx(np.mean(d)) and r["p"] == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    assert ps.sign_flip_p([0.1, -0.1]) == 1.0
    assert ps.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})


def test_stability_v3_compares_each_arm_with_grpo_by_seed_and_dapo_at_grpos_token_budget():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    v3 = _module("stability_v3")
    runs = []
    for s in range(6):
        runs.append({"variant": "grpo", "seed": s, "eval_final": 0.60 + 0.01 * s, "sampled_tokens": 1000.0,
                     "eval_tokens_curve": []})
        runs.append({"variant": "ppo", "seed": s, "eval_final": 0.60 + 0.01 * s + (0.002 if s % 2 else -0.002),
                     "sampled_tokens": 1000.0, "eval_tokens_curve": []})
        runs.append({"variant": "dapo", "seed": s, "eval_final": 0.9, "sampled_tokens": 3000.0,
                     "eval_tokens_curve": [(10, 500.0, 0.5), (20, 1005.0, 0.7 + 0.01 * s), (30, 3000.0, 0.9)]})
    out = v3.compare(runs)
    assert out["token_budget"] == 1000.0
    assert out["arms"]["dapo"]["mean"] == pytest.approx(0.725)  # at 1,005 tokens, not its final 0.9
    dapo, ppo = out["vs_grpo"]["dapo"], out["vs_grpo"]["ppo"]
    assert dapo["diff"] == pytest.approx(0.1) and dapo["p_sign_flip"] == pytest.approx(2 / 64)
    assert dapo["p"] < 1e-6 and dapo["p_holm"] == pytest.approx(2 * dapo["p"]) and dapo["real"]
    assert ppo["diff"] == pytest.approx(0.0, abs=1e-12) and ppo["p"] > 0.9 and not ppo["real"]


def test_a_finished_study_run_is_read_back_and_a_changed_one_runs_again(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    stability = _module("stability")
    calls = []

    def fake_run(cmd, **_):  # what `grpo-jax train` leaves: metrics.jsonl in --output
        if cmd[0] == "git":  # the commit run.json records
            return type("Done", (), {"returncode": 0, "stdout": "abc1234\n", "stderr": ""})()
        calls.append(cmd)
        run_dir = Path(cmd[cmd.index("--output") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(
            '{"step": 0, "eval/accuracy": 0.25, "eval/pass@k": 0.5}\n'
            f'{{"step": 1, "reward/mean": 0.5, "eval/accuracy": {0.25 + 0.1 * len(calls)}, "eval/pass@k": 0.6}}\n')
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(stability.subprocess, "run", fake_run)
    config = ROOT / "configs/demo_cpu.yaml"
    first = stability.run_one("grpo", 0, tmp_path, 1, "python", config=config, reuse=True)
    again = stability.run_one("grpo", 0, tmp_path, 1, "python", config=config, reuse=True)
    assert len(calls) == 1 and again["eval_final"] == first["eval_final"] == pytest.approx(0.35)
    stored = json.loads((tmp_path / "grpo_s0" / "run.json").read_text())["cmd"]  # no checkout's or run's path
    assert "configs/demo_cpu.yaml" in stored and not any(str(ROOT) in a or str(tmp_path) in a for a in stored)
    changed = stability.run_one("grpo", 0, tmp_path, 2, "python", config=config, reuse=True)  # other steps
    fresh = stability.run_one("grpo", 0, tmp_path, 2, "python", config=config)  # reuse off
    assert len(calls) == 3 and changed["eval_final"] == pytest.approx(0.45) and fresh["eval_final"] == pytest.approx(0.55)
    copy = tmp_path / "demo.yaml"  # the same command, the config's content changed: run again
    copy.write_text(config.read_text())
    stability.run_one("grpo", 0, tmp_path / "c", 2, "python", config=copy, reuse=True)
    stability.run_one("grpo", 0, tmp_path / "c", 2, "python", config=copy, reuse=True)
    copy.write_text(config.read_text() + "# a comment changes no setting\n")
    stability.run_one("grpo", 0, tmp_path / "c", 2, "python", config=copy, reuse=True)
    assert len(calls) == 4
    copy.write_text(config.read_text().replace("seed: 0", "seed: 1", 1))
    stability.run_one("grpo", 0, tmp_path / "c", 2, "python", config=copy, reuse=True)
    assert len(calls) == 5


def test_the_credit_oracle_explains_returns_a_slip_settles_and_the_group_mean_does_not():
    oracle = _module("credit_oracle")
    assert oracle.gold_derivation("8-7+8+7-5=") == "1 9 16 11"
    rng = np.random.default_rng(0)
    samples = []
    for i in range(40):  # a slip at the first character loses; the rows are otherwise alike
        a, b = rng.integers(1, 10, 2)
        prompt = f"{a}+{b}-1="
        gold = oracle.gold_derivation(prompt)
        for g in range(8):
            right = g % 2 == 0
            samples.append({"step": 1, "prompt": prompt, "completion": gold if right else "x" + gold[1:],
                            "reward": float(right)})
    out = oracle.analyse(samples, group_size=8)
    ev = out["explained_variance"]
    assert ev["oracle_prefix"] > 0.8 and ev["oracle_last"] > 0.8  # all but the first state know
    # 4 of 8 right in every group: the 7 mates' mean is 3/7 for a right row and 4/7 for a wrong one,
    # so 1 - (4/7)^2 / 0.25 (a mean that counted the row itself would give 0)
    assert abs(ev["position"]) < 0.05 and ev["group_mean"] == pytest.approx(1 - (4 / 7) ** 2 / 0.25)
    # cross-fitted: a key seen in one half of the prompts only takes the other half's mean, never
    # the rewards it is scored against
    tokens = [{"group": (f"p{i}", 0), "reward": float(i % 2)} for i in range(4) for _ in range(3)]
    values = oracle.cross_fitted(tokens, lambda tok: tok["group"][0])
    halves = {p: i % 2 for i, p in enumerate(sorted({f"p{i}" for i in range(4)}))}
    for tok, v in zip(tokens, values, strict=True):
        other = [t["reward"] for t in tokens if halves[t["group"][0]] != halves[tok["group"][0]]]
        assert v == pytest.approx(np.mean(other))
    assert out["first_slip_position"] == {"rows_with_slip": 160, "median": 1.0}
    # A score as a value (a frozen reward model's, --rm): a per-position line, cross-fitted. One
    # that reads the slip explains what the oracle does; noise explains nothing.
    all_tokens = oracle.token_rows(samples, 8)
    returns = np.array([tok["reward"] for tok in all_tokens])
    reads = np.array([3.0 * tok["consistent"] - 1.0 for tok in all_tokens])
    line = oracle.cross_fitted_linear(all_tokens, reads)
    assert oracle.explained_variance(returns, line) == pytest.approx(ev["oracle_prefix"], abs=1e-9)
    noise = oracle.cross_fitted_linear(all_tokens, rng.normal(size=len(all_tokens)))
    assert oracle.explained_variance(returns, noise) < 0.02
    assert oracle.ranking(all_tokens, reads, same_prompt=True) == oracle.ranking(all_tokens, reads, False) == 1.0
    assert oracle.ranking(all_tokens, -reads, same_prompt=True) == 0.0
    # A per-prompt offset: every prompt orders its own states right, across prompts the offset mixes them.
    offset = {p: i for i, p in enumerate(sorted({tok["group"][0] for tok in all_tokens}))}
    shifted = reads + np.array([offset[tok["group"][0]] for tok in all_tokens])
    assert oracle.ranking(all_tokens, shifted, same_prompt=True) == 1.0 > oracle.ranking(all_tokens, shifted, False)
    assert oracle.ranking(all_tokens, np.zeros(len(all_tokens)), same_prompt=True) == 0.5  # ties count half
    assert 0.4 < oracle.ranking(all_tokens, rng.normal(size=len(all_tokens)), same_prompt=False) < 0.6


def test_the_critic_fit_encodes_the_oracles_states_and_its_least_squares_head_finds_a_linear_value():
    """benchmarks/credit_fit.py: one state per character and one before <eos> (the oracle's), each
    with its row's return; the frozen policy's least-squares head recovers a value that is linear in
    its states (held-out rows included), and explains nothing of one that is not."""
    import jax

    from grpo_jax.data.tokenizer import char_tokenizer
    from grpo_jax.learner.logprobs import completion_states
    from grpo_jax.models.hf import from_pretrained

    fit, oracle = _module("credit_fit"), _module("credit_oracle")
    samples = [{"prompt": f"{a}+{b}-1=", "completion": oracle.gold_derivation(f"{a}+{b}-1=")[:n], "reward": float(n % 2)}
               for a in range(1, 10) for b in range(1, 10) for n in (3, 4)]
    tok = char_tokenizer(add_bos=True)
    data = fit.encode(samples, tok)
    assert data["mask"].sum() == len(oracle.token_rows(samples, 8))
    assert tok.decode(data["prompt_ids"][0][data["prompt_mask"][0] > 0], skip_special_tokens=True) == samples[0]["prompt"]
    rewards = np.array([s["reward"] for s in samples], np.float32)
    assert np.array_equal(data["returns"], data["mask"] * rewards[:, None])  # the row's reward on its real tokens
    base = str(ROOT / fit.BASE)
    model = from_pretrained(base)
    h = np.asarray(jax.jit(lambda b: completion_states(model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"]))(data))
    w = np.random.default_rng(0).normal(size=h.shape[-1])
    train, held = fit.split_by_prompt(samples)  # halves by prompt: no prompt on both sides
    assert len(train) + len(held) == len(samples) and len(train) > 60 and len(held) > 60
    assert not {samples[i]["prompt"] for i in train} & {samples[i]["prompt"] for i in held}
    assert data["mask"][train].sum() > 2 * h.shape[-1]  # more fitted states than the head has weights
    linear = {**data, "returns": (h @ w + 0.5).astype(np.float32) * data["mask"]}
    got = fit.linear_ceiling(linear, train, held, base, ridge=1e-8)
    assert got["fitted"] > 0.999 and got["held_out"] > 0.99
    # A return drawn once per prompt: fitted rows can be memorised, other prompts cannot be foretold.
    per_prompt = {p: v for p, v in zip(sorted({s["prompt"] for s in samples}), np.random.default_rng(1).normal(size=81))}
    noise = {**data, "returns": np.array([per_prompt[s["prompt"]] for s in samples], np.float32)[:, None] * data["mask"]}
    got = fit.linear_ceiling(noise, train, held, base)
    assert got["held_out"] < 0.05 < got["fitted"]


def test_the_derivation_reward_checks_every_total_and_the_logged_reward_keeps_every_row(tmp_path):
    rewards = _module("critique_rewards")
    prompts = ["Q: 8-7+8+7=", "8-7+8+7=", "8-7+8+7=", "4+5="]
    completions = ["1 9 16", "2 9 16", " 1 9 16 ", "9"]
    assert rewards.derivation_exact(prompts, completions) == [1.0, 0.0, 1.0, 1.0]
    # the answer reward reads the last number only: the slipped derivation still ends on 16
    log = tmp_path / "rows.jsonl"
    answer = ["16", "16", "16", "9"]
    assert rewards.logged(prompts, completions, log=str(log), answer=answer) == [1.0, 1.0, 1.0, 1.0]
    assert rewards.logged(prompts, completions, log=str(log), reward="derivation", answer=answer) == [1.0, 0.0, 1.0, 1.0]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["completion"] for r in rows] == completions * 2 and [r["reward"] for r in rows[4:]] == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="not an arithmetic chain"):
        rewards.derivation_exact(["what is 2+2?"], ["4"])


def test_a_slipped_derivation_carries_the_wrong_total_on():
    verifier = _module("credit_verifier")
    rng = __import__("random").Random(0)
    for at in range(3):
        bad = verifier.slipped("8-7+8+7=", [1, 9, 16], at, rng)
        gold = [1, 9, 16]
        assert bad[:at] == gold[:at] and bad[at] != gold[at] and 1 <= abs(bad[at] - gold[at]) <= 3 and bad[at] >= 0
        assert all(b - g == bad[at] - gold[at] for b, g in zip(bad[at:], gold[at:], strict=True))  # carried on


@pytest.mark.filterwarnings("ignore:constrained_layout not applied")
def test_credit_picks_each_rate_from_its_stage_reuses_the_sweeps_seed_and_saves_as_it_goes(tmp_path, monkeypatch):
    """`critique.py credit`'s stages on a fake `train` (no subprocess): each critic's rate is the
    warm-up's best, each arm's policy rate the sweep's best at seed 0; the comparison reuses that
    run for seed 0 and runs the other seeds at the chosen rate, the ablations VAPO's; the summary is
    written after every run (finished: false) and at the end."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    critique = _module("critique")
    calls, partial = [], []

    settings = {}

    def fake_train(run_dir, config, sets, args):
        calls.append(run_dir.name)
        settings[run_dir.name] = sets
        if json.loads((tmp_path / "summary.json").read_text())["runs"]:  # what the runs so far left
            partial.append(json.loads((tmp_path / "summary.json").read_text()))
        got = dict(s.split("=", 1) for s in sets if "=" in s and not s.startswith("rewards"))
        clr, lr = float(got.get("ppo.critic_learning_rate", 0)), float(got.get("train.learning_rate", 0))
        best = 3e-3 if got.get("ppo.critic") == "head" else 1e-3  # each kind its own best rate
        ev = 0.5 - abs(clr - best) * 100
        acc = 0.6 - abs(lr - 1.5e-4) * 1000 + 0.01 * int(got["train.seed"] if "train.seed" in got else 0)
        acc += 0.05 * (got.get("ppo.critic") == "model")  # a critic model's arms 0.05 above the rest
        return [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "value/explained_variance": ev, "eval/accuracy": acc}], 1.0

    monkeypatch.setattr(critique, "train", fake_train)
    argv = ["credit", "--output", str(tmp_path), "--seeds", "0", "1", "--reward", "derivation", "--trunk-lr-ratio", "0.1",
            "--critic-path", "rm/hf"]
    # An earlier part of the same command stopped part way: its commit and time stay in the summary.
    earlier = {"command": " ".join(["python", "benchmarks/critique.py", *argv]), "commit": "abc1234", "date": "2026-12-05",
               "wall_s": 600, "finished": False, "runs": []}
    (tmp_path / "summary.json").write_text(json.dumps(earlier))
    assert critique.main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["commit"] for p in summary["parts"]][0] == "abc1234" and len(summary["parts"]) == 2
    assert summary["wall_s"] == 600 + summary["parts"][1]["wall_s"]
    choices = summary["runs"][-1]
    assert choices["critic_lr"] == {"head": 3e-3, "model": 1e-3} and set(choices["policy_lr"].values()) == {1.5e-4}
    assert "finished" not in summary and partial[-1]["finished"] is False
    lengths = [len(p["runs"]) for p in partial]  # each run saved when it ended (seed 0's rows reused: +2)
    assert lengths[0] == 1 and all(b - a in (1, 2) for a, b in zip(lengths, lengths[1:])) and lengths[-1] == len(calls) + 3
    compare = [r for r in summary["runs"] if r.get("stage") == "compare"]
    assert sorted(r["run"] for r in compare) == sorted(f"{a}_{s}" for a in ("grpo", "dr_grpo", "ppo", "vapo")
                                                       for s in ("lr0.00015_s0", "s1"))
    assert len(calls) == len(set(calls)) == 6 + 4 * 3 + 4 + 5 * 2  # warm-ups, sweep, seed 1, ablations
    assert all(name.startswith("derivation_") for name in calls[:6])
    assert all(r["lr"] == 1.5e-4 for r in summary["runs"] if r.get("stage") == "ablate")
    last = lambda run, key: [s for s in settings[run] if s.startswith(key + "=")][-1]  # noqa: E731  (the last --set wins)
    # The policy makes 200 updates in every arm: a critic's 100 warm-up steps come on top.
    assert last("grpo_s1", "train.steps") == "train.steps=200" and last("vapo_s1", "train.steps") == "train.steps=300"
    assert last("vapo-no_warmup_s1", "ppo.value_warmup_steps") == "ppo.value_warmup_steps=0"
    assert last("vapo-no_warmup_s1", "train.steps") == "train.steps=200"
    assert last("ppo_s1", "train.steps") == "train.steps=300"
    assert last("vapo-head_critic_s1", "ppo.critic") == "ppo.critic=head"  # the ablation's setting wins
    # A value head takes the heads' rate, a critic model the models' with its trunk rate and start.
    assert last("vapo-head_critic_s1", "ppo.critic_learning_rate") == last("ppo_s1", "ppo.critic_learning_rate") \
        == "ppo.critic_learning_rate=0.003"
    assert last("vapo_s1", "ppo.critic_learning_rate") == "ppo.critic_learning_rate=0.001"
    assert "ppo.critic_trunk_learning_rate=0.0001" in settings["vapo_s1"] and "ppo.critic_path=rm/hf" in settings["vapo_s1"]
    assert not any(x.startswith(("ppo.critic_trunk", "ppo.critic_path")) for x in settings["vapo-head_critic_s1"])
    assert last("vapo-no_positive_lm_s1", "ppo.positive_lm_coef") == "ppo.positive_lm_coef=0"
    # RESULTS' block of the comparison: each arm and ablation a row, each paired against its reference.
    from figure_blocks.critique import CREDIT_ARMS, render_credit_compare

    block = render_credit_compare(str(tmp_path))
    rows = [line for line in block.splitlines() if line.startswith("| ") and "0.00015 | 2 |" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == list(CREDIT_ARMS.values())
    versus = dict(zip(CREDIT_ARMS, (row.split(" | ")[4] for row in rows)))
    assert versus["grpo"] == "(the reference)" and versus["vapo"].startswith("+0.050")  # VAPO against GRPO
    assert versus["ppo"].startswith("+0.000") and versus["vapo-head_critic"].startswith("-0.050")  # ablations against VAPO
    assert all(versus[a].startswith("+0.000") for a in CREDIT_ARMS if a.startswith("vapo-") and a != "vapo-head_critic")
    assert "Part way" not in block
    assert (tmp_path / "credit.png").stat().st_size > 0  # the per-arm plot drew from these rows
    # Each run records its critic's warm-up steps: the plot takes them off its x axis.
    warmups = {r["run"]: r["warmup"] for r in summary["runs"] if r.get("stage") in ("compare", "ablate")}
    assert warmups["grpo_s1"] == warmups["vapo-no_warmup_s1"] == 0 and warmups["vapo_s1"] == warmups["ppo_s1"] == 100
    steps, mean, lo, hi = critique._by_step([{"a": {0: 1.0, 5: 2.0}}, {"a": {0: 3.0}}], lambda r: r["a"])
    assert steps.tolist() == [0, 5] and mean.tolist() == [2.0, 2.0] and lo.tolist() == [1.0, 2.0] and hi.tolist() == [3.0, 2.0]
