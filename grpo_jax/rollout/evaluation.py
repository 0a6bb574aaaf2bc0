"""Held-out evaluation: accuracy and pass@k of sampled completions, judged by one reward function.

Each of the prompts gets k samples (one `generate` call per chunk of prompts, the last chunk padded
with repeats so every chunk has the same shape and the sampler compiles once). A sample is correct
when the reward function gives it more than 0.5; a sample it cannot judge (None) is left out of
the accuracy and counted. An episode its environment failed is wrong: it stays in the accuracy's
denominator (else a policy could raise its accuracy by making its hard episodes fail) and is
counted on its own (`eval/failed`). pass@k is the share of prompts with at least one correct
sample among their k (the unbiased estimator with n = k).

`evaluate_run` is a run's evaluation as its config's `eval` section says (num_prompts, k,
temperature, reward, verifier, verifier_kwargs): the trainer and `grpo-jax eval` both call it. It
samples on a mesh, as everything does: one device is a (1, 1, 1) mesh
(grpo_jax.runtime.sharding.make_mesh).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_jax.config import SamplingConfig
from grpo_jax.runtime.hosts import gather_rows, local_rows, row_share
from grpo_jax.rewards import RewardSpec, StatefulReward, combine_rewards
from grpo_jax.engine.sampling import generate
from grpo_jax.runtime.sharding import batch_sharding, round_to_row_shards
from grpo_jax.rollout.inputs import EvalInputs


def decode_completions(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    return tokenizer.batch_decode([row[:n].tolist() for row, n in zip(tokens, lengths)],
                                  skip_special_tokens=True)


def repeat_fields(examples: Sequence, group_size: int) -> dict[str, list]:
    """Each example's fields repeated for its G samples (row i*G + j is sample j of prompt i)."""
    keys = list(examples[0].fields) if examples else []
    return {k: [ex.fields.get(k) for ex in examples for _ in range(group_size)] for k in keys}


def prompts_per_call(num_prompts: int, mesh: Mesh, chunk: int = 64) -> int:
    """The prompts of one `generate` call of `evaluate` over `num_prompts`: at most `chunk`, rounded
    up to split evenly over data x fsdp x expert (the last chunk is padded with repeats)."""
    return round_to_row_shards(min(chunk, num_prompts), mesh)


def evaluate_run(model, inputs: EvalInputs, *, teacher=None) -> dict[str, float]:
    """`evaluate` of `model` (placed on `inputs.mesh`, where the run samples) as a run's config says:
    the held-out prompts (eval.num_prompts), eval.k samples each at eval.temperature, judged by
    eval.reward and eval.verifier (with eval.verifier_kwargs), the run's episodes with an
    environment; the rng from the run's seed, so every evaluation of the same parameters samples
    the same completions; with eval.retention, the retention metrics too (grpo_jax.rollout.retention:
    its reference set by the run). `teacher`: as in `evaluate` (distillation's scorer)."""
    out = evaluate(model, inputs.examples, reward=inputs.reward, verifier=inputs.verifier, sampling=inputs.sampling,
                   tokenizer=inputs.tokenizer, mesh=inputs.mesh, episodes=inputs.episodes,
                   rng=jax.random.key(inputs.seed), teacher=teacher)
    if inputs.retention is not None:  # eval.retention: the general corpus, teacher-forced
        out.update(inputs.retention.metrics(model))
    return out


def evaluate(model, examples: Sequence, *, reward: RewardSpec, sampling: SamplingConfig, tokenizer,
             rng: jax.Array, mesh: Mesh, chunk: int = 64, verifier: RewardSpec | None = None,
             episodes=None, teacher=None) -> dict[str, float]:
    """`eval/accuracy` (the share of samples `reward` scores above 0.5), `eval/pass@k` (with k =
    sampling.group_size), `eval/reward_mean` (its mean score) and bookkeeping over `examples`,
    sampled on `mesh` (one device: a (1, 1, 1) mesh), where `model` is placed.

    verifier: a second judge of the same samples: `eval/verifier_accuracy`, and
    `health/verifier_disagreement`, the share of the samples both judged on which one says correct
    and the other not (a training reward that can be satisfied without being right shows here).

    episodes: a run's grpo_jax.episodes.runner.EpisodeRunner: each sample is an episode, judged on
    its last model turn; an episode its environment failed is not judged but counts as wrong in
    `eval/accuracy`, `eval/verifier_accuracy` and `eval/pass@k`, and in `eval/failed`.

    teacher: on-policy distillation's teacher as `teacher(prompt_ids [R, P], prompt_mask [R, P],
    completion_ids [R, M]) -> log-probs [R, M]` (at the evaluation's temperature and k): adds
    `eval/distill_reverse_kl`, the held-out samples' per-token k1 estimate of KL(student || teacher)."""
    judges = [reward] if verifier is None else [reward, verifier]  # each scored on its own
    if not examples:
        raise ValueError("evaluation needs at least one prompt; check data.eval_split and eval.num_prompts")
    k = sampling.group_size
    chunk = prompts_per_call(len(examples), mesh, chunk)
    # Every host has every prompt; each scores only the rows its devices hold, and the scores are
    # put together on every host.
    share = row_share(mesh, chunk).scaled(k)
    scored = []  # [prompts, k, judges + 1] per chunk: the judges' scores (NaN = not judged), then failed (1.0)
    kl = np.zeros(2)  # (sum over held-out tokens of log pi_student - log pi_teacher, tokens)
    for start in range(0, len(examples), chunk):
        part = list(examples[start:start + chunk])
        real = len(part)
        part += [part[0]] * (chunk - real)
        texts_, failed, kl_rows = _sample(model, part, sampling, jax.random.fold_in(rng, start), mesh, share,
                                          tokenizer, episodes, padding=chunk - real, teacher=teacher)
        own = slice(share.start, max(share.start, min(share.stop, real * k)))  # this host's rows of real prompts
        n_own = own.stop - own.start
        scores = np.full((share.size, len(judges) + 1), np.nan, np.float32)
        if n_own:
            scores[:n_own, -1] = failed[:n_own]
            texts = texts_[:n_own]
            prompts = [ex.prompt_text for ex in part[:real] for _ in range(k)][own]
            fields = {key: values[own] for key, values in repeat_fields(part[:real], k).items()}
            for j, judge in enumerate(judges):
                # A reward with state (a reward model's running normalisation) scores held-out
                # samples without learning from them.
                fn = judge.fn.without_updates() if isinstance(judge.fn, StatefulReward) else judge.fn
                result = combine_rewards([dataclasses.replace(judge, fn=fn, weight=1.0)], prompts, texts, fields)
                scores[:n_own, j] = np.where(failed[:n_own], np.nan, result.per_fn[judge.name])
        scored.append(gather_rows(scores, share)[:real * k].reshape(real, k, len(judges) + 1))
        if kl_rows is not None:
            kl += gather_rows(kl_rows, share)[:real * k].sum(axis=0)
    return _summary(np.concatenate(scored), k=k, prompts=len(examples), verifier=verifier is not None,
                    kl=kl if teacher is not None else None)


def _summary(scored: np.ndarray, *, k: int, prompts: int, verifier: bool, kl) -> dict[str, float]:
    """`evaluate`'s metrics from the scores [prompts, k, judges] (NaN = not judged), each sample's
    failed flag after them ([..., -1]: 1.0 = its environment failed, not judged, wrong), and with a
    teacher the (reverse-KL sum, tokens) pair. Accuracies are over the judged and the failed samples."""
    scores_, failed_ = scored[..., :-1], scored[..., -1] > 0.5
    judged_ = ~np.isnan(scores_)
    correct_ = np.nan_to_num(scores_, nan=0.0) > 0.5
    n_failed = int(failed_.sum())
    n_judged = judged_.sum(axis=(0, 1))
    counted = n_judged + n_failed  # per judge: a failed episode is a wrong answer
    out = {
        "eval/accuracy": float(correct_[..., 0].sum() / counted[0]) if counted[0] else float("nan"),
        "eval/pass@k": float(correct_[..., 0].any(axis=1).mean()),
        "eval/k": float(k),
        "eval/prompts": float(prompts),
        "eval/unjudged": float(judged_[..., 0].size - n_judged[0] - n_failed),
        "eval/failed": float(n_failed),
        # The judge's mean score: a reward model's held-out score, beside eval.verifier's accuracy.
        "eval/reward_mean": float(np.nanmean(scores_[..., 0])) if n_judged[0] else float("nan"),
    }
    if kl is not None:
        out["eval/distill_reverse_kl"] = float(kl[0] / max(kl[1], 1.0))
    if verifier:
        both = judged_[..., 0] & judged_[..., 1]
        out["eval/verifier_accuracy"] = float(correct_[..., 1].sum() / counted[1]) if counted[1] else float("nan")
        # The second judge's mean score (a gold reward model's, where eval.verifier is one): the
        # over-optimisation check's gold curve (grpo_jax.observe.heldout_checks).
        out["eval/verifier_reward_mean"] = float(np.nanmean(scores_[..., 1])) if n_judged[1] else float("nan")
        out["health/verifier_disagreement"] = (float((correct_[..., 0] != correct_[..., 1])[both].mean())
                                               if both.any() else float("nan"))
    return out


def _sample(model, part, sampling: SamplingConfig, rng, mesh, share, tokenizer, episodes, padding: int, teacher=None):
    """This host's rows of one chunk's samples -> (completion texts, failed bool, with a `teacher`
    float64 [rows, 2] (each row's sum of student - teacher log-probs, its tokens), else None): one
    `generate` call, or the chunk's episodes (their last model turns; the `padding` prompts that
    fill the chunk's shape play none)."""
    if episodes is not None:
        batch = episodes.run(model, part, sampling, rng, padding=padding)
        return batch.final_turns(), batch.failed, None
    rollout = generate(model, [ex.prompt_ids for ex in part], sampling, rng, mesh=mesh)
    tokens, lengths = local_rows((rollout.tokens, rollout.lengths), share)
    kl_rows = None
    if teacher is not None:
        k = rollout.group_size
        repeat = _repeat_rows(k, mesh)
        teacher_RM = teacher(repeat(rollout.prompt_ids), repeat(rollout.prompt_mask), rollout.tokens)
        gap_R = jnp.sum((rollout.logprobs - teacher_RM) * rollout.mask, axis=1)
        gap, n = local_rows((gap_R, rollout.mask.sum(axis=1)), share)
        kl_rows = np.stack([gap, n], axis=1).astype(np.float64)
    return decode_completions(tokenizer, tokens, lengths), np.zeros(len(lengths), bool), kl_rows


@functools.lru_cache(maxsize=8)
def _repeat_rows(k: int, mesh):
    """Each prompt's row for each of its k samples, jitted once per (k, mesh), the rows split over
    the mesh as the samples are."""
    return jax.jit(lambda x: jnp.repeat(x, k, axis=0), out_shardings=batch_sharding(mesh, 2))
