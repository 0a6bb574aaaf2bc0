"""A critic that starts from a verifier (issue 46, the credit task): can a value function learn what
the chain task's prefix says about its reward when it starts from a reward model trained to tell a
right derivation from a slipped one, where a copy of the policy did not (RESULTS, "A critic where
credit must be assigned")?

    python benchmarks/credit_verifier.py --output benchmarks/results/critique/credit_verifier

1. Preference pairs from `arithmetic_chain`'s long chains (train and held-out splits): each pair
   cuts the derivation after a random number k of totals; `chosen` is the gold prefix, `rejected`
   the same prefix with one total (at a step <= k) off by 1-3 and the totals after it carried on
   from the wrong one, as a slip does. Prefixes, not only whole derivations, so the model judges
   the states a critic is asked about.
2. `grpo-jax train-rm` on them (configs/rm_demo_cpu.yaml's 4-layer model and losses, the chain's
   prompt template; --rm-steps steps): held-out pair accuracy in its metrics.
3. The critic's value warm-up on the derivation reward (`critique.py credit --critic-only --reward
   derivation`), the critic model loaded from that reward model (`ppo.critic_path`: its score head
   becomes the value head), beside the policy-copy critic's runs already in RESULTS.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def slipped(question: str, totals: list[int], at: int, rng: random.Random) -> list[int]:
    """The derivation with total `at` off by 1-3 (kept >= 0) and the later ones carried on from it."""
    body = question.rstrip("=")
    moves = [(body[i], int(body[i + 1])) for i in range(1, len(body), 2)]
    out = list(totals[:at])
    wrong = totals[at] + rng.choice([-3, -2, -1, 1, 2, 3])
    out.append(wrong if wrong >= 0 else totals[at] + 1)
    for op, n in moves[at + 1:]:
        out.append(out[-1] + n if op == "+" else out[-1] - n)
    return out


def pairs(split: str, rng: random.Random) -> list[dict]:
    from grpo_jax.data import load_source

    src = load_source("arithmetic_chain", split, data_dir=str(ROOT / "data/tfds"), builder_config="long",
                      num_train=7500, num_test=500)  # configs/chain_cpu.yaml's splits
    out = []
    for i in range(len(src)):
        row = src[i]
        totals = [int(t) for t in row["derivation"].split()]
        k = rng.randint(1, len(totals))
        bad = slipped(row["question"], totals, rng.randrange(k), rng)[:k]
        out.append({"question": row["question"], "chosen": " ".join(map(str, totals[:k])),
                    "rejected": " ".join(map(str, bad))})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--rm-steps", type=int, default=1000)
    p.add_argument("--value-warmup", type=int, default=300)
    p.add_argument("--critic-lrs", type=float, nargs="+", default=[1e-3])
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    out, t0 = args.output, time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, name in (("train", "pairs_train.jsonl"), ("test", "pairs_eval.jsonl")):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in pairs(split, rng)))
    config = yaml.safe_load((ROOT / "configs/rm_demo_cpu.yaml").read_text())
    config["data"] = {"name": None, "train_file": str((out / "pairs_train.jsonl").resolve()),
                      "eval_file": str((out / "pairs_eval.jsonl").resolve()), "template": "{question}", "max_length": 48}
    config["train"]["steps"] = args.rm_steps
    (out / "rm_chain.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    rm = out / "rm"
    proc = subprocess.run([args.python, "-m", "grpo_jax", "train-rm", "--config", str(out / "rm_chain.yaml"),
                           "--output", str(rm)], cwd=ROOT, capture_output=True, text=True)
    (out / "rm.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"train-rm failed (exit {proc.returncode}); see {out / 'rm.log'}")
    rm_wall = time.perf_counter() - t0
    for junk in ("checkpoints", "tensorboard"):  # kept: rm/hf (the critic's start; not committed), metrics, config
        shutil.rmtree(rm / junk, ignore_errors=True)
    (out / "pairs_train.jsonl").unlink()  # drawn again by this command (seed 0); the held-out pairs stay
    evals = [json.loads(line) for line in (rm / "metrics.jsonl").read_text().splitlines() if "rm/pair_accuracy" in line]
    cmd = [args.python, "benchmarks/critique.py", "credit", "--critic-only", "--reward", "derivation", "--critic-kinds",
           "model", "--value-warmup", str(args.value_warmup), "--critic-lrs", *map(str, args.critic_lrs),
           "--critic-path", str(rm / "hf"), "--output", str(out / "critic")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "critic.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"the critic's warm-up failed (exit {proc.returncode}); see {out / 'critic.log'}")
    critic = json.loads((out / "critic" / "summary.json").read_text())
    result = {"command": " ".join(["python", "benchmarks/credit_verifier.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "rm_steps": args.rm_steps, "rm_wall_s": round(rm_wall),
              "rm_pair_accuracy": [(e["step"], e["rm/pair_accuracy"]) for e in evals],
              "critic": [{k: r[k] for k in ("run", "critic_lr", "ev_end", "ev_plateau_step", "ev_curve", "wall_s")}
                         for r in critic["runs"] if r.get("stage") == "critic_lr"],
              "wall_s": round(time.perf_counter() - t0)}
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"rm_pair_accuracy": result["rm_pair_accuracy"][-1:], "ev_end": [c["ev_end"] for c in result["critic"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
