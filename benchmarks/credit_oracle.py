"""How much of the chain task's return a value function could explain (issue 46, the credit task):
the explained variance of values that know only what an oracle reads off the prefix, on the warm
start's own rollouts, beside the group mean GRPO uses and the critics' (benchmarks/critique.py credit).

    python benchmarks/credit_oracle.py --output benchmarks/results/critique/credit_oracle
    python benchmarks/credit_oracle.py --reward derivation --output benchmarks/results/critique/credit_oracle_derivation

One `grpo-jax train` run of configs/chain_cpu.yaml with the policy held (PPO's value warm-up,
--steps steps of 32 groups of 8; the evaluations judge unlogged) scores its rollouts with
critique_rewards.py's `logged`, which writes every row of every group (`--reward`: `answer`, the
config's reward on the last total, or `derivation`, every running total checked). The return of every completion token is the row's
reward (the trainer's Monte-Carlo targets, lambda 1; the end-of-sequence token counted). Each
value below is a table of mean rewards, fitted on half the prompts and scored on the other half
(cross-fitted both ways), so no value is scored on rewards it was fitted to:
- `oracle_prefix`: by (the state's position, whether the prefix written so far is still a prefix
  of the gold derivation). A lower bound on the best critic: it ignores the prompt and how close
  a consistent prefix is to a slip.
- `oracle_last`: by (position, still a gold prefix, the last finished total right): the warm
  start often slips once and then writes the next total right again (it adds from the question,
  not always from its own last total), so under the answer reward a slip is not the end; this
  table sees the recovery.
- `position`: by position alone (what a critic that learns only the mean per step can reach).
- `rm_linear` (--rm DIR): the frozen reward model's score of the prompt and the prefix, made a
  value by a least-squares line per position (benchmarks/credit_verifier.py's model: does its
  score, which ranks a gold prefix above a slipped one, carry the value a critic started from it
  would need?). With it, `rm_gold_first`: how often the score puts a still-gold state above a
  slipped one at the same position, of the same prompt and of any prompt.
- `group_mean`: each row's value is the mean reward of the other 7 rows of its group, at every
  token (RLOO's baseline, read as a value function; GRPO's mean counts the row itself, which would
  let the value see 1/8 of the return it is scored against).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/chain_cpu.yaml"
sys.path.insert(0, str(ROOT / "benchmarks"))
import stability  # noqa: E402
from critique_rewards import gold_derivation  # noqa: E402


def groups(samples: list[dict], group_size: int) -> list[tuple]:
    """Each row's group: its prompt and which of that prompt's runs of `group_size` rows it is in
    (the rows of a prompt in the order scored; a prompt drawn again later starts a new group)."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for s in samples:
        out.append((s["prompt"], seen[s["prompt"]] // group_size))
        seen[s["prompt"]] += 1
    return out


def token_rows(samples: list[dict], group_size: int) -> list[dict]:
    """One entry per completion token (its characters and then <eos>): the row, its group (the
    prompt and which of its groups), the state's position t (before token t), whether the completion's
    first t characters are a prefix of the gold derivation, whether the last total finished before
    t is the gold one (None before the first), and the row's reward."""
    out = []
    for row, (s, group) in enumerate(zip(samples, groups(samples, group_size), strict=True)):
        gold, text = gold_derivation(s["prompt"]), s["completion"]
        totals = gold.split(" ")
        for t in range(len(text) + 1):
            done = text[:t].split(" ")[:-1]  # totals followed by a space: finished
            last = None if not done else (len(done) <= len(totals) and done[-1] == totals[len(done) - 1])
            out.append({"row": row, "group": group, "t": t, "last_right": last,
                        "consistent": gold.startswith(text[:t]), "reward": float(s["reward"])})
    return out


def prompt_halves(tokens: list[dict]) -> dict[str, int]:
    """The cross-fitting's two halves: each prompt's half (0 or 1), alternating in sorted order."""
    return {p: i % 2 for i, p in enumerate(sorted({tok["group"][0] for tok in tokens}))}


def cross_fitted(tokens: list[dict], key) -> np.ndarray:
    """Each token's value: the mean reward of the tokens with the same key(token) among the other
    half of the prompts (halves by prompt; a key unseen there takes that half's mean)."""
    half = prompt_halves(tokens)
    values = np.zeros(len(tokens))
    for h in (0, 1):
        sums, fit = defaultdict(lambda: [0.0, 0]), [tok for tok in tokens if half[tok["group"][0]] != h]
        for tok in fit:
            sums[key(tok)][0] += tok["reward"]
            sums[key(tok)][1] += 1
        mean = float(np.mean([tok["reward"] for tok in fit]))
        for i, tok in enumerate(tokens):
            if half[tok["group"][0]] == h:
                s, n = sums.get(key(tok), (0.0, 0))
                values[i] = s / n if n else mean
    return values


def group_means(samples: list[dict], tokens: list[dict], group_size: int) -> np.ndarray:
    """Each token's value: the mean reward of the other rows of its group (leave-one-out)."""
    rewards = defaultdict(list)
    for s, group in zip(samples, groups(samples, group_size), strict=True):
        rewards[group].append(float(s["reward"]))
    own = [float(samples[tok["row"]]["reward"]) for tok in tokens]
    return np.array([(sum(rewards[tok["group"]]) - r) / max(len(rewards[tok["group"]]) - 1, 1)
                     for tok, r in zip(tokens, own, strict=True)])


def rm_scores(samples: list[dict], tokens: list[dict], path: str) -> np.ndarray:
    """Each state's score by the reward model in `path` (frozen): its score of the prompt with the
    completion's first t characters (benchmarks/credit_verifier.py's model scores gold chain
    prefixes above slipped ones)."""
    from grpo_jax.rewards.reward_model import RewardModelReward

    rm = RewardModelReward(path=path, batch_size=256, max_length=64)
    prompts = [samples[tok["row"]]["prompt"] for tok in tokens]
    prefixes = [samples[tok["row"]]["completion"][:tok["t"]] for tok in tokens]
    return np.asarray(rm.without_updates()(prompts, prefixes))


def cross_fitted_linear(tokens: list[dict], x: np.ndarray) -> np.ndarray:
    """Each token's value: a + b x, a and b least squares of the reward on x among the tokens of its
    position in the other half of the prompts (a position with under 2 distinct x there: their mean)."""
    half = prompt_halves(tokens)
    h_of = np.array([half[tok["group"][0]] for tok in tokens])
    t_of, reward = np.array([tok["t"] for tok in tokens]), np.array([tok["reward"] for tok in tokens])
    values = np.zeros(len(tokens))
    for h in (0, 1):
        for t in np.unique(t_of[h_of == h]):
            fit, use = (h_of != h) & (t_of == t), (h_of == h) & (t_of == t)
            if fit.sum() == 0:
                values[use] = reward[h_of != h].mean()
            elif np.ptp(x[fit]) == 0:
                values[use] = reward[fit].mean()
            else:
                b, a = np.polyfit(x[fit], reward[fit], 1)
                values[use] = a + b * x[use]
    return values


def ranking(tokens: list[dict], x: np.ndarray, same_prompt: bool) -> float:
    """The share of (still-gold, slipped) state pairs at the same position, of the same prompt or of
    any, that x orders gold first (ties half): the Mann-Whitney AUC, pooled over the pairs."""
    cells = defaultdict(lambda: ([], []))
    for tok, v in zip(tokens, x, strict=True):
        cells[(tok["t"], tok["group"][0] if same_prompt else None)][0 if tok["consistent"] else 1].append(v)
    wins = pairs = 0.0
    for gold, slipped in cells.values():
        if gold and slipped:
            g, b = np.asarray(gold)[:, None], np.asarray(slipped)[None, :]
            wins += float((g > b).sum() + 0.5 * (g == b).sum())
            pairs += g.size * b.size
    return wins / pairs if pairs else float("nan")


def explained_variance(returns: np.ndarray, values: np.ndarray) -> float:
    return float(1.0 - np.var(returns - values) / np.var(returns))


def analyse(samples: list[dict], group_size: int = 8, rm: str | None = None) -> dict:
    tokens = token_rows(samples, group_size)
    returns = np.array([tok["reward"] for tok in tokens])
    values = {"oracle_prefix": cross_fitted(tokens, lambda tok: (tok["t"], tok["consistent"])),
              "oracle_last": cross_fitted(tokens, lambda tok: (tok["t"], tok["consistent"], tok["last_right"])),
              "position": cross_fitted(tokens, lambda tok: tok["t"]),
              "group_mean": group_means(samples, tokens, group_size)}
    ranks = {}
    if rm:  # the frozen reward model's score, made a value by a per-position linear fit
        scores = rm_scores(samples, tokens, rm)
        values["rm_linear"] = cross_fitted_linear(tokens, scores)
        ranks = {"rm_gold_first": {"same_prompt": ranking(tokens, scores, True),
                                   "any_prompt": ranking(tokens, scores, False)}}
    slips = [next((t for t in range(len(s["completion"]) + 1)
                   if not gold_derivation(s["prompt"]).startswith(s["completion"][:t])), None) for s in samples]
    return {"rows": len(samples), "tokens": len(tokens), "accuracy": float(np.mean([s["reward"] for s in samples])),
            "explained_variance": {k: explained_variance(returns, v) for k, v in values.items()}, **ranks,
            # where the first slip is (the state whose prefix first leaves the gold derivation)
            "first_slip_position": {"rows_with_slip": int(sum(x is not None for x in slips)),
                                    "median": float(np.median([x for x in slips if x is not None] or [np.nan]))}}


def rollouts(args) -> Path:
    """Run the chain config with the policy held and every scored row logged -> the rows' file."""
    run, rows = args.output / "rollouts", args.output / "rows.jsonl"
    rows.unlink(missing_ok=True)
    logged = f"{{name: 'benchmarks/critique_rewards.py:logged', kwargs: {{log: '{rows.resolve()}', reward: {args.reward}}}}}"
    # The evaluations (before the first step and after the last, 4 samples a prompt, the same
    # samples both times while the policy is held) judge by the same reward unlogged (weight 0
    # in training), so the file holds the training groups alone.
    plain = {"answer": "math_accuracy", "derivation": "benchmarks/critique_rewards.py:derivation_exact"}[args.reward]
    cmd = [args.python, "-m", "grpo_jax", "train", "--config", CONFIG, "--output", str(run)]
    for s in ("algorithm=ppo", f"ppo.value_warmup_steps={args.steps}", f"train.steps={args.steps}",
              f"rewards=[{logged}, {{name: '{plain}', weight: 0.0}}]", f"eval.reward={plain}", "eval.every=0",
              "checkpoint.every=0", "train.progress=false", *args.set):
        cmd += ["--set", s]
    stability.train_run(run, cmd, args.output / "rollouts.log")
    with gzip.open(args.output / "rows.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(rows.read_text())
    rows.unlink()
    return args.output / "rows.jsonl.gz"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--reward", choices=["answer", "derivation"], default=None,
                   help="the reward the rollouts are scored with (default answer); with --samples, the one they were "
                   "scored with (recorded only; required)")
    p.add_argument("--steps", type=int, default=8, help="warm-up steps whose rollouts are kept (256 rows each)")
    p.add_argument("--set", action="append", default=[], help="a config override for the run (e.g. sft.steps=1500)")
    p.add_argument("--samples", type=Path, default=None, help="analyse this rows file (.jsonl or .jsonl.gz) instead of running")
    p.add_argument("--rm", default=None, help="also the value a frozen reward model's score gives (its HF directory): "
                   "`rm_linear`, a per-position linear fit, cross-fitted as the tables are")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    if args.samples is not None and args.reward is None:
        p.error("--samples: say which reward the rows were scored with (--reward answer or derivation)")
    args.reward = args.reward or "answer"
    args.output.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = args.samples or rollouts(args)
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    # The run's own config (its --set overrides in), beside the rows it wrote
    run_config = path.parent / "rollouts" / "config.yaml"
    config = yaml.safe_load((run_config if run_config.exists() else ROOT / CONFIG).read_text())
    group_size, per_step = config["sampling"]["group_size"], config["data"]["prompts_per_step"]
    if args.samples is None and len(samples) != args.steps * per_step * group_size:
        raise SystemExit(f"{len(samples)} rows logged, not the {args.steps * per_step * group_size} the training steps scored")
    result = {"command": " ".join(["python", "benchmarks/credit_oracle.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "reward": args.reward, **analyse(samples, group_size, rm=args.rm),
              "wall_s": round(time.perf_counter() - t0)}
    (args.output / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["explained_variance"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
