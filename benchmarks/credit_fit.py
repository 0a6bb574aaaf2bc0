"""Can the chain task's critic learn its value at all, given the data at rest? (issue 46, the credit task)

    python benchmarks/credit_fit.py --output benchmarks/results/critique/credit_fit

The online critics of `critique.py credit` explain ~none of the return (value/explained_variance
~0.02 after a 100-300-step warm-up, every rate swept) where credit_oracle.py's table by (position,
prefix still gold) explains 0.27 of the same warm start's rollouts. This separates the network
from the online loop: the same critic networks fitted by plain supervised regression (Adam, masked
squared error, the Monte-Carlo return of every completion token, as the warm-up's targets) to the
rows credit_oracle.py logged from the warm start (--samples), on half the prompts, for --steps
minibatches (many passes over the rows), and scored on the other half's tokens every --eval-every
steps (and on the half they were fitted to: capacity apart from generalisation).

- `head`: a value head on the frozen warm-start policy's last hidden states (`ppo.critic: head`
  during its warm-up: the trunk is the policy's and gets no gradient).
- `model`: the warm-start policy's weights with a value head, all trained (`ppo.critic: model`
  without `critic_path`: a copy of the policy).

The value of token t is read from the state before it (`learner.completion_states`, the critic's
state in training), so a state sees the characters before token t, as the oracle's table does.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from credit_oracle import explained_variance as _ev  # noqa: E402
from credit_oracle import groups, prompt_halves, token_rows  # noqa: E402

SAMPLES = "benchmarks/results/critique/credit_oracle_shared/rows.jsonl.gz"
BASE = "benchmarks/results/critique/credit_shared/warm_start_sft800_s0/base"


def encode(samples: list[dict], tokenizer, prompt_len: int = 24, completion_len: int = 29) -> dict[str, np.ndarray]:
    """The rows as the trainer sees them: prompts left-padded (<bos> first), completions with <eos>
    right-padded, the mask over the completion's real tokens, and each token's return (the row's reward)."""
    R = len(samples)
    out = {"prompt_ids": np.zeros((R, prompt_len), np.int32), "prompt_mask": np.zeros((R, prompt_len), np.int32),
           "completion_ids": np.zeros((R, completion_len), np.int32), "mask": np.zeros((R, completion_len), np.float32),
           "returns": np.zeros((R, completion_len), np.float32)}
    for i, s in enumerate(samples):
        p = tokenizer(s["prompt"])["input_ids"]
        c = tokenizer(s["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(p) > prompt_len or len(c) > completion_len:
            raise ValueError(f"row {i} does not fit ({len(p)} prompt, {len(c)} completion tokens)")
        out["prompt_ids"][i, prompt_len - len(p):], out["prompt_mask"][i, prompt_len - len(p):] = p, 1
        out["completion_ids"][i, :len(c)], out["mask"][i, :len(c)] = c, 1.0
        out["returns"][i, :len(c)] = float(s["reward"])
    return out


def explained_variance(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> float:
    """credit_oracle's explained variance over the real tokens (mask > 0)."""
    m = mask > 0
    return _ev(returns[m], values[m])


def fit(kind: str, lr: float, data: dict, train: np.ndarray, held: np.ndarray, args) -> dict:
    """One critic fitted on the rows `train`, scored on `held` (and on `train`) along the way."""
    from flax import nnx

    from grpo_jax.learner.logprobs import completion_states
    from grpo_jax.learner.ppo import init_critic, values
    from grpo_jax.models.hf import from_pretrained

    model = from_pretrained(args.base)
    graphdef, trunk = nnx.split(model, nnx.Param)
    params = {**init_critic(model.config.hidden_size), **({"model": trunk} if kind == "model" else {})}

    def predict(params, b):
        m = nnx.merge(graphdef, params["model"] if kind == "model" else trunk)
        h = completion_states(m, b["prompt_ids"], b["prompt_mask"], b["completion_ids"])
        return values(params, h if kind == "model" else jax.lax.stop_gradient(h))

    def loss(params, b):
        return jnp.sum(b["mask"] * (predict(params, b) - b["returns"]) ** 2) / jnp.maximum(b["mask"].sum(), 1.0)

    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state, b):
        grads = jax.grad(loss)(params, b)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    score = jax.jit(predict)

    def ev(rows):
        v = np.concatenate([np.asarray(score(params, {k: a[rows[i:i + 256]] for k, a in data.items()}))
                            for i in range(0, len(rows), 256)])
        return explained_variance(data["returns"][rows], v, data["mask"][rows])

    rng, curve, t0 = np.random.default_rng(args.seed), [], time.perf_counter()
    for i in range(args.steps + 1):
        if i % args.eval_every == 0:
            curve.append({"step": i, "held_out": round(ev(held), 4), "fitted": round(ev(train), 4)})
            print(json.dumps({"kind": kind, "lr": lr, **curve[-1]}), flush=True)
        if i < args.steps:
            rows = rng.choice(train, args.batch_size, replace=False)
            params, state = step(params, state, {k: a[rows] for k, a in data.items()})
    best = max(curve, key=lambda c: c["held_out"])
    return {"kind": kind, "lr": lr, "curve": curve, "held_out_end": curve[-1]["held_out"],
            "held_out_best": best["held_out"], "best_step": best["step"], "wall_s": round(time.perf_counter() - t0)}


def split_by_prompt(samples: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(rows fitted, rows held out): credit_oracle's halves, by prompt, so no prompt is in both."""
    half = prompt_halves([{"group": g} for g in groups(samples, 8)])
    side = np.array([half[s["prompt"]] for s in samples])
    return np.flatnonzero(side == 0), np.flatnonzero(side == 1)


def linear_ceiling(data: dict, train: np.ndarray, held: np.ndarray, base: str, ridge: float = 1e-3) -> dict:
    """A value head on the frozen policy's states without its optimiser's path: the least-squares
    line (ridge `ridge`, the intercept penalised too) from the states [E] and 1 to the return,
    fitted on the tokens of `train`, scored on both halves."""
    from grpo_jax.learner.logprobs import completion_states
    from grpo_jax.models.hf import from_pretrained

    model = from_pretrained(base)
    states = jax.jit(lambda b: completion_states(model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"]))

    def features(rows):
        h = np.concatenate([np.asarray(states({k: a[rows[i:i + 256]] for k, a in data.items()}), np.float64)
                            for i in range(0, len(rows), 256)])  # float64: the normal equations square the condition
        m = data["mask"][rows] > 0
        return np.concatenate([h[m], np.ones((int(m.sum()), 1), h.dtype)], axis=1), data["returns"][rows][m]

    x, y = features(train)
    w = np.linalg.solve(x.T @ x + ridge * len(y) * np.eye(x.shape[1]), x.T @ y)
    xh, yh = features(held)
    return {"fitted": round(_ev(y, x @ w), 4), "held_out": round(_ev(yh, xh @ w), 4), "ridge": ridge}


def _shown(path) -> str:
    """A path as the summary records it: from the project's root when inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--samples", type=Path, default=ROOT / SAMPLES, help="credit_oracle.py's rows (the warm start's rollouts)")
    p.add_argument("--base", default=str(ROOT / BASE), help="the warm-start policy the critics start from (HF directory)")
    p.add_argument("--kinds", nargs="+", choices=["head", "model"], default=["model", "head"])
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from grpo_jax.data.tokenizer import char_tokenizer

    t0 = time.perf_counter()
    with gzip.open(args.samples, "rt") as f:
        samples = [json.loads(line) for line in f if line.strip()]
    train, held = split_by_prompt(samples)
    data = encode(samples, char_tokenizer(add_bos=True))
    n_tokens = int(data["mask"].sum())
    if n_tokens != len(token_rows(samples, 8)):  # one state per character and one before <eos>, as the oracle's
        raise SystemExit(f"{n_tokens} tokens encoded, not the oracle's {len(token_rows(samples, 8))}")
    ceiling = linear_ceiling(data, train, held, args.base)
    print(json.dumps({"head_least_squares": ceiling}), flush=True)
    fits = [fit(kind, lr, data, train, held, args) for kind in args.kinds for lr in args.lrs]
    result = {"command": " ".join(["python", "benchmarks/credit_fit.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "samples": _shown(args.samples), "base": _shown(args.base),
              "rows": {"fitted": len(train), "held_out": len(held)}, "tokens": n_tokens,
              "steps": args.steps, "batch_size": args.batch_size, "head_least_squares": ceiling, "fits": fits, "wall_s": round(time.perf_counter() - t0)}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
