"""`grpo-jax train-rm`'s preference pairs, and how a trained reward model is scored on held-out ones
(the loss and steps: grpo_jax.learner.bradley_terry; the model: grpo_jax.models.build; the run, in
the RL trainer's loop: grpo_jax.trainer.reward_run). A reward model trained on preference pairs with
the Bradley-Terry loss:

    loss = mean over pairs of -log sigmoid(r(prompt, chosen) - r(prompt, rejected) - margin)
           + lm_coef * (the backbone's next-token cross-entropy on the chosen answers' tokens)

on the same mesh machinery as the policy (the model placed by the sharding rules, the step jitted
with explicit shardings, rows split over data x fsdp x expert). Pairs come from a TFDS builder of this
project (`arithmetic_preferences`) or jsonl files; each answer is put after its prompt exactly as
the `reward_model` reward will put a policy's completion (`rewards.reward_model.rm_input`), so the
model is scored at training time on what it will see at GRPO time. The language-model term
(`train.lm_coef`, off by default) is there for correctness: a Bradley-Terry loss alone lets a small
model rank pairs by the easy cues (length, filler words) and never learn what makes an answer right;
predicting the right answer's tokens makes the backbone compute it, and the score head can then
compare (the demo's reward model needs it to tell wrong sums apart: configs/rm_demo_cpu.yaml).
Rows without the fields, or with answers that are not text, are skipped and counted; pairs longer
than `data.max_length` keep their last tokens (counted). Held-out pair accuracy (`rm/pair_accuracy`) is measured before the first
step, every `train.eval_every` steps and after the last; the model is saved as an HF
`*ForSequenceClassification` directory in `OUTPUT/hf` (with its tokenizer), which transformers'
AutoModelForSequenceClassification loads with equal scores.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from grpo_jax.config import ConfigError, RMRunConfig
from grpo_jax.rewards.reward_model import rm_input
from grpo_jax.runtime.sharding import pow2_bucket


@dataclasses.dataclass
class Pairs:
    """Encoded preference pairs: ids / mask int32 [N, 2, T] (0 = chosen, 1 = rejected, right-padded),
    margin float32 [N], answer_start int32 [N] (the chosen row's first answer token), and the rows'
    `kind` (or None) for per-kind accuracy."""

    ids: np.ndarray
    mask: np.ndarray
    margin: np.ndarray
    answer_start: np.ndarray
    kinds: list[str | None]


def read_rows(config: RMRunConfig, split: str) -> Sequence[dict]:
    d = config.data
    if d.name is not None:
        from grpo_jax.data import load_source

        try:
            return load_source(d.name, d.train_split if split == "train" else d.eval_split, data_dir=d.data_dir,
                               builder_config=d.builder_config, **dict(d.builder_kwargs))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"data: {e}") from None
    path = Path(d.train_file if split == "train" else d.eval_file)
    if not path.is_file():
        raise ConfigError(f"data.{split}_file: {str(path)!r} does not exist")
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            rows.append({"_error": f"line {i + 1} is not JSON: {e}"})
    return rows


def encode_pairs(rows: Sequence[dict], config: RMRunConfig, tokenizer, *, limit: int = 0) -> tuple[Pairs, dict]:
    """(the encodable pairs, counters {pairs, skipped, truncated, first_skip}) of `rows`."""
    d = config.data
    use_chat = d.chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
    texts, prompts, margins, kinds = [], [], [], []
    stats = {"pairs": 0, "skipped": 0, "truncated": 0, "first_skip": None}
    for row in rows:
        if limit and stats["pairs"] == limit:
            break
        try:
            if not isinstance(row, dict) or "_error" in row:
                raise ValueError(row.get("_error") if isinstance(row, dict) else f"a {type(row).__name__}, not an object")
            user = d.template.format(**row)
            answers = [row[d.chosen_field], row[d.rejected_field]]
            margin = float(row[d.margin_field]) if d.margin_field else 0.0
            if not all(isinstance(a, str) for a in answers) or not np.isfinite(margin):
                raise ValueError("the answers are not text, or the margin is not a finite number")
        except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
            stats["skipped"] += 1
            keys = sorted(row) if isinstance(row, dict) else []
            stats["first_skip"] = stats["first_skip"] or f"{type(e).__name__}: {e} (row keys {keys})"
            continue
        messages = ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else []) + [
            {"role": "user", "content": user}]
        texts += [rm_input(tokenizer, user, a, messages, use_chat=use_chat) for a in answers]
        prompts.append(rm_input(tokenizer, user, "", messages, use_chat=use_chat))
        margins.append(margin + config.train.margin)
        kinds.append(row.get("kind"))
        stats["pairs"] += 1
    ids = tokenizer(texts, add_special_tokens=not use_chat)["input_ids"] if texts else []
    prompt_ids = tokenizer(prompts, add_special_tokens=not use_chat)["input_ids"] if prompts else []
    stats["truncated"] = sum(len(a) > d.max_length or len(b) > d.max_length for a, b in zip(ids[::2], ids[1::2]))
    # The answer starts where the chosen row parts from its prompt rendered with an empty answer
    # (with a chat template the empty turn's closing tokens follow the prompt, so a plain prompt
    # length would be wrong); cut rows lose their first tokens.
    starts = [max(0, common_prefix(p, c) - max(0, len(c) - d.max_length)) for p, c in zip(prompt_ids, ids[::2])]
    ids = [row[-d.max_length:] for row in ids]
    T = min(d.max_length, pow2_bucket(max((len(r) for r in ids), default=1), 8))
    out = np.full((len(ids), T), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(ids), T), np.int32)
    for i, row in enumerate(ids):
        out[i, :len(row)], mask[i, :len(row)] = row, 1
    n = len(ids) // 2
    return Pairs(out.reshape(n, 2, T), mask.reshape(n, 2, T), np.asarray(margins, np.float32),
                 np.asarray(starts, np.int32), kinds), stats


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def evaluate_pairs(score, params, pairs: Pairs, batch: int) -> dict[str, float]:
    """`rm/pair_accuracy` (chosen scored above rejected), `rm/eval_loss`, `rm/eval_margin`, and the
    accuracy per pair kind when the rows have one."""
    n = len(pairs.margin)
    rc, rr = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for s in range(0, n, batch):
        idx = np.arange(s, s + batch) % n  # the last batch wraps around: one shape compiles
        c, r = score(params, pairs.ids[idx], pairs.mask[idx])
        keep = slice(0, min(batch, n - s))
        rc[s:s + batch], rr[s:s + batch] = np.asarray(c)[keep], np.asarray(r)[keep]
    diff = rc - rr
    out = {"rm/pair_accuracy": float(np.mean(diff > 0)), "rm/eval_margin": float(diff.mean()),
           "rm/eval_loss": float(np.mean(np.logaddexp(0.0, -(diff - pairs.margin))))}
    for kind in sorted({k for k in pairs.kinds if k is not None}):
        sel = np.asarray([k == kind for k in pairs.kinds])
        out[f"rm/pair_accuracy/{kind}"] = float(np.mean(diff[sel] > 0))
    return out
