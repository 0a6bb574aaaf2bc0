"""The GRPO loop: sample -> reward -> group advantages -> clipped update, with evaluation, logging
and checkpoints. Orchestration only; each phase lives where it can be tested alone:

- inputs checked and built before any compile: `run.prepare`;
- the supervised warm start: `sft.warm_start`;
- the jit-on-mesh / pmap choice (placing the state, the update, the sampler's params):
  `parallel.make_parallel`;
- sampling rounds with dynamic sampling, reward statistics: `rollouts.collect`;
- group normalisation and the KL reference's log-probs, on device: `train_step.advantages_step`,
  `train_step.ref_logprobs_step`;
- checkpoints, resume and preemption: `checkpoint.save_step`, `checkpoint.check_resumable` (before
  anything is written), `checkpoint.resume`, `checkpoint.StopSignals` (SIGTERM/SIGINT: save the
  step and stop; checkpoints by the clock).

Files in the run directory: `config.yaml`, `model/` (architecture + tokenizer), `metrics.jsonl`,
`samples.jsonl`, `tensorboard/`, `checkpoints/<step>/`, `metrics.png` (at the end).

Several hosts (`distributed.enabled`): every process runs this same loop. Each loads and formats
only its block of each batch's prompts, scores the rollout rows its devices hold, and contributes
its rows to the global batch (grpo_jax.runtime.hosts); advantages are computed on the global rewards array,
and reward statistics and counters are put together across hosts, so every process sees the same
metrics. Only process 0 writes the run directory's files and the progress bar; every process
takes part in saving checkpoints (orbax writes each process's shards), so the run directory must
be on storage all hosts share.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from jax.experimental import multihost_utils

from grpo_jax.trainer import lora_base

from grpo_jax.trainer.checkpoint import Checkpointer, StopSignals, check_resumable, resume, save_step, short_error
from grpo_jax.config import ConfigError, RunConfig, config_to_dict
from grpo_jax.rollout.evaluation import decode_completions, evaluate, repeat_fields
from grpo_jax.rollout.health import distinct_answers, random_control, rollout_health
from grpo_jax.runtime.hosts import (any_host, common_bucket, gather_rows, is_primary, local_rows, max_over_hosts,
                            sum_over_shares, to_global)
from grpo_jax.models import save_pretrained
from grpo_jax.models.lora import strip_adapters
from grpo_jax.observe.metrics import MetricsWriter, ProgressBar, plot_run, read_metrics
from grpo_jax.learner.parallel import make_parallel
from grpo_jax.learner.ppo import init_critic
from grpo_jax.rewards import RewardResult, combine_rewards
from grpo_jax.rollout.collect import Collected, Round, collect, reward_metrics, sample_records, step_key
from grpo_jax.trainer.prepare import add_run_adapters, build_model, model_json, prepare, write_model_files
from grpo_jax.rollout.sampling import generate, pad_prompts
from grpo_jax.learner.sft import warm_start
from grpo_jax.runtime.sharding import place_model
from grpo_jax.runtime.storage import RunDirectory
from grpo_jax.learner.train_step import Batch, check_skips, init_state, run_optimizer, split_trainable

MetricHook = Callable[[int, dict], None]
_ROLLOUT_FIELDS = ("tokens", "logprobs", "mask", "truncated", "lengths")


class Trainer:
    def __init__(self, config: RunConfig, run_dir: str | Path, *, hooks: Sequence[MetricHook] = (),
                 log: Callable[[str], None] | None = None):
        # Log lines go above the progress bar (to stderr), unless the caller takes them.
        # A remote run directory (gs://...) stages the small files locally (grpo_jax.runtime.storage).
        self.storage = RunDirectory(run_dir)
        self.config, self.run_dir, self.hooks = config, self.storage.local, list(hooks)
        self._bar: ProgressBar | None = None
        self.log = log or (lambda line: (self._bar.write(line) if self._bar else print(line, file=sys.stderr)))
        self.prepared = prepare(config)  # every input check, before any compile
        self.primary = is_primary()  # process 0 writes the run directory's files
        if not self.primary:
            self.log = lambda line: None
        self.mesh, self.share = self.prepared.mesh, self.prepared.share
        for note in self.prepared.notes:
            self.log(note)
        self.rows = self.share.scaled(config.sampling.group_size)  # this host's rows of the rollout and batch
        self.sampling = self.prepared.sampling
        self.rng = jax.random.key(config.train.seed)
        self._reward_streaks: dict[str, int] = {}  # reward name -> steps in a row it failed on every sample
        self._slow_rewards_said = False
        self.pass_rates = np.zeros(0)  # the last step's per-group pass rates (TensorBoard histogram)
        self.base_record: dict | None = None  # a LoRA run's base (lora_base.record), in checkpoint metadata

    def _open_run_dir(self) -> None:
        """Write the run's config and model files (after the checkpoint check: a refused start
        leaves an existing run directory as it was)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_count() > 1 and not self.storage.remote:
            self.log(f"run directory {self.run_dir} is a local path: every host must see the same directory "
                     "(a shared file system), or each host's checkpoint shards land on its own disk; use gs://...")
        if self.storage.remote:
            self.log(f"run directory {self.storage}: checkpoints written there, logs staged in {self.run_dir} and "
                     "uploaded at every checkpoint")
        if self.primary:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(self.config), sort_keys=False))
            write_model_files(self.prepared, self.run_dir / "model")

    # --- setup ------------------------------------------------------------------------------------
    def _setup(self, checkpointer: Checkpointer, candidates: list[int]):
        """The model, the parallelism, the placed train state and the KL reference (restored from
        the newest of `candidates` that restores, when resuming) -> (state, the step resumed or None)."""
        cfg = self.config
        self.model = build_model(cfg.model, self.prepared.model_config, cfg.train.seed)
        # Every host built the same parameters; place them on the mesh by the rules (pmap mode: its
        # data-only mesh, so replicated) for the warm start and the sampler.
        place_model(self.model, self.mesh)
        for spec in {id(s.fn): s for s in self._judges()}.values():
            if hasattr(spec.fn, "place"):  # a reward model: on the run's mesh, by the policy's rules
                spec.fn.place(self.mesh)
        resume_from = None
        if cfg.sft.steps and not candidates:  # a resumed run's params come from its checkpoint
            t0 = time.perf_counter()
            losses = warm_start(self.prepared, self.model, self.log)
            self.log(f"warm start: {cfg.sft.steps} steps in {time.perf_counter() - t0:.1f} s, "
                     f"loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}")
        t = cfg.train
        optimizer = run_optimizer(cfg)
        critic = init_critic(self.prepared.model_config.hidden_size) if cfg.algorithm == "ppo" else None
        if cfg.lora.enabled:
            self._lora_base(checkpointer, candidates)
        add_run_adapters(self.model, cfg)  # after the warm start: a LoRA run adapts the warm-started base
        place_model(self.model, self.mesh)  # the adapters too
        graphdef, state = init_state(self.model, optimizer, critic=critic)
        frozen = split_trainable(self.model)[2]
        # The KL reference (beta > 0): a copy of the params, saved with each checkpoint; a LoRA run's
        # is its frozen base in the structure without adapters (no copy; the base is on disk, lora_base).
        ref_graphdef = None if frozen is None else nnx.split(strip_adapters(self.model), nnx.Param)[0]
        self.par = make_parallel(cfg, self.mesh, graphdef, optimizer, temperature=self.sampling.temperature,
                                 frozen=frozen, ref_graphdef=ref_graphdef)
        state = self.par.place(state)
        for line in self.par.not_sharded:
            self.log(f"not sharded (its mesh axis does not divide it): {line}")
        self.ref_params = None
        if cfg.grpo.beta > 0 and frozen is None:
            self.ref_params = jax.tree.map(jnp.copy, nnx.state(self.model, nnx.Param))
        if candidates:
            state, resume_from = self._restore(checkpointer, candidates, self.par.unplace(state))
            state = self.par.place(state)
            self.log(f"resumed from the checkpoint of step {resume_from} in {self.storage}"
                     + (f"; the run already reached train.steps={t.steps}, nothing left to train"
                        if resume_from >= t.steps else ""))
        nnx.update(self.model, self.par.sampler_params(state))
        return state, resume_from

    def _lora_base(self, checkpointer: Checkpointer, candidates: list[int]) -> None:
        """A LoRA run's base (`grpo_jax.trainer.lora_base`), before its adapters are added: a fresh run
        writes a base that exists only in it (random init, warm start) to RUN_DIR/base; a resumed
        run loads such a base from there (its fingerprint was checked by `_resumable`). Either way
        `self.base_record` is what each checkpoint's metadata records of it."""
        cfg = self.config
        if candidates:
            saved = checkpointer.restore_meta(candidates[0])["base"]
            if saved["path"] == lora_base.BASE_DIR:
                base = build_model(dataclasses.replace(cfg.model, path=str(self.run_dir / lora_base.BASE_DIR),
                                                       architecture=None), self.prepared.model_config, cfg.train.seed)
                nnx.update(self.model, nnx.state(base, nnx.Param))
                place_model(self.model, self.mesh)
        elif lora_base.base_is_written(cfg):
            if self.primary:
                save_pretrained(self.model, self.run_dir / lora_base.BASE_DIR)
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("grpo_jax_lora_base_written")
        self.base_record = lora_base.record(cfg, self.run_dir)

    # --- one step ---------------------------------------------------------------------------------
    def _round(self, step: int, round_index: int) -> Round:
        """One sampling round of this host's block of prompts: sampled on the mesh, scored here."""
        p, G = self.prepared, self.sampling.group_size
        examples = p.train_stream.next_batch(self.share.size)
        prompts = [ex.prompt_ids for ex in examples]
        ids = pad_prompts(prompts, common_bucket(prompts, self.sampling.prompt_buckets), self.sampling.pad_id)
        t0 = time.perf_counter()
        rollout = generate(self.model, to_global(ids, self.mesh, self.share), self.sampling,
                           step_key(self.rng, step, round_index), mesh=self.mesh)
        rows = dict(zip(_ROLLOUT_FIELDS, local_rows(tuple(getattr(rollout, k) for k in _ROLLOUT_FIELDS), self.rows)))
        sample_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        texts = decode_completions(p.tokenizer, rows["tokens"], rows["lengths"])
        fields = {**repeat_fields(examples, G), "completion_tokens": rows["lengths"].tolist()}
        result = combine_rewards(p.rewards, [ex.prompt_text for ex in examples for _ in range(G)], texts, fields)
        scores = None
        if self.config.reward_control == "random":
            everyone = gather_rows(result.total, self.rows)
            judged = everyone[~np.isnan(everyone)]
            mean = float(judged.mean()) if judged.size else float("nan")  # the whole batch's mean reward
            rng = np.random.default_rng([self.config.train.seed, step, round_index, self.rows.start])
            scores = random_control(result.total, mean, rng)
        return Round(examples=examples, rows=rows, texts=texts, rewards=result, sample_s=sample_s,
                     reward_s=time.perf_counter() - t1, scores=scores)

    def _collect(self, step: int) -> Collected:
        t = self.config.train
        return collect(functools.partial(self._round, step), num_groups=self.share.size,
                       group_size=self.sampling.group_size, dynamic_sampling=t.dynamic_sampling,
                       max_resample_rounds=t.max_resample_rounds, any_short=any_host)

    def _batch(self, c: Collected) -> tuple[Batch, int, float]:
        """The global batch from every host's chosen groups, completed on device (advantages of the
        whole batch; the reference's log-probs), the number of tokens in it, and the seconds the
        reference pass took."""
        G = self.sampling.group_size
        prompts = [ex.prompt_ids for ex in c.examples]
        prompt_ids, prompt_mask = pad_prompts(prompts, common_bucket(prompts, self.sampling.prompt_buckets),
                                              self.sampling.pad_id)
        rows = dict(prompt_ids=np.repeat(prompt_ids, G, axis=0), prompt_mask=np.repeat(prompt_mask, G, axis=0),
                    completion_ids=c.rows["tokens"], completion_mask=c.rows["mask"], rewards=c.rewards,
                    truncated=c.rows["truncated"], old_logprobs=c.rows["logprobs"])
        # The update's tokens: each prompt once per group when the prompt pass is shared.
        prompt_tokens = prompt_mask.sum() * (1 if self.config.train.shared_prompt else G)
        tokens = sum_over_shares({"t": prompt_tokens + rows["completion_mask"].sum()}, self.share)["t"]
        rows = to_global(rows, self.mesh, self.rows)
        adv = self.par.advantages(rows["rewards"])
        batch = Batch(**rows, advantages=adv.advantages, valid=adv.valid, zero_std=adv.zero_std)
        ref_s = 0.0
        if self.config.grpo.beta > 0:
            t0 = time.perf_counter()
            reference = self.ref_params if self.par.frozen is None else self.par.frozen
            # Waiting for it costs nothing (the update needs it next) and times it on its own.
            ref = jax.block_until_ready(self.par.ref_logprobs(reference, batch))
            batch, ref_s = batch.replace(ref_logprobs=ref), time.perf_counter() - t0
        return batch, int(tokens), ref_s

    def _host_metrics(self, c: Collected) -> dict[str, float]:
        """Reward statistics of the first round, dynamic sampling and data counters, over all hosts."""
        first = c.first.rewards
        everyone = RewardResult(
            total=gather_rows(first.total, self.rows),
            per_fn={k: gather_rows(v, self.rows) for k, v in first.per_fn.items()},
            failures={k: int(v) for k, v in sum_over_shares(first.failures, self.share).items()},
            messages=first.messages)
        stats = dict(self.prepared.train_stream.stats)
        epoch = max_over_hosts(stats.pop("epoch"))
        local = ("dynamic/rounds", "sample_s", "reward_s")  # the same on every host, or its own time
        counts = sum_over_shares({**{k: v for k, v in c.stats.items() if k not in local},
                                  **{f"data/{k}": v for k, v in stats.items()}}, self.share)
        sample_tokens = counts.pop("sample_tokens")
        G = self.sampling.group_size
        health, self.pass_rates = rollout_health(
            everyone, gather_rows(distinct_answers(c.first.texts, G), self.share),
            gather_rows(c.first.rows["lengths"], self.rows), group_size=G,
            correct_by=self.prepared.eval_reward.name, specs=self.prepared.rewards)
        return {**reward_metrics(everyone, G), **health, **counts, "data/epoch": float(epoch),
                "dynamic/rounds": c.stats["dynamic/rounds"], "perf/sample_s": c.stats["sample_s"],
                "perf/reward_s": c.stats["reward_s"], "perf/sample_tokens": sample_tokens,
                "perf/sample_tokens_per_s": sample_tokens / max(c.stats["sample_s"], 1e-9)}

    # --- the loop ---------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.config
        checkpointer = Checkpointer(self.storage.checkpoints, keep=cfg.checkpoint.keep)  # every process
        try:
            steps = checkpointer.all_steps()
            if steps and not cfg.train.resume:
                raise ConfigError(f"{self.storage} already holds checkpoints (newest: step {steps[0]}); resume "
                                  "it (train.resume: true) or choose another --output")
            candidates = self._resumable(checkpointer, steps) if steps else []  # before anything is written
            self._open_run_dir()
            return self._run(checkpointer, candidates)
        finally:
            checkpointer.close()

    def _judges(self) -> list:
        """Every reward spec the run scores with: training, evaluation and the verifier."""
        p = self.prepared
        return [*p.rewards, p.eval_reward, *([p.eval_verifier] if p.eval_verifier is not None else [])]

    def _resumable(self, checkpointer: Checkpointer, steps: list[int]) -> list[int]:
        """The saved steps to resume from, newest first, starting at the newest whose metadata
        restores; every reason to refuse the restart (another model, data layout, seed, host count:
        a ConfigError) is found here, before the run directory is written. Damaged checkpoints are
        skipped with a warning (decided by all hosts together)."""
        if self.primary:
            self.storage.pull()  # a remote run's model/config.json, to compare
        errors = []
        for i, step in enumerate(steps):
            try:
                check_resumable(checkpointer, step, stream=self.prepared.train_stream, run_dir=self.run_dir,
                                model_json=model_json(self.prepared))
                self._check_base(checkpointer.restore_meta(step))
                error = None
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - unreadable metadata: a damaged or partial checkpoint
                error = e
            if not any_host(error is not None):
                return steps[i:]
            why = short_error(error) if error else "damaged on another host"
            errors.append(f"step {step}: {why}")
            self.log(f"warning: checkpoint of step {step} in {self.storage} is damaged or incomplete ({why}); "
                     "trying the previous one")
        raise ConfigError(f"{self.storage} holds checkpoints {sorted(steps)} but none of them restores ("
                          + "; ".join(errors) + "); move checkpoints/ away to start afresh")

    def _check_base(self, meta: dict) -> None:
        """A LoRA run resumes only LoRA checkpoints of the same base (fingerprint), a full fine-tune
        only full ones: a ConfigError otherwise."""
        saved = meta.get("base")
        if self.config.lora.enabled != (saved is not None):
            kinds = ("LoRA adapters", "full parameters")
            have, want = kinds[saved is None], kinds[not self.config.lora.enabled]
            raise ConfigError(f"{self.storage} holds checkpoints of {have}, this config trains {want} (lora.rank="
                              f"{self.config.lora.rank}); resume it with its own config or choose another --output")
        if saved is not None:
            lora_base.locate(saved, self.run_dir)

    def _restore(self, checkpointer: Checkpointer, candidates: list[int], state):
        """(state, step) from the newest candidate that restores completely; damaged newer steps are
        set aside (`Checkpointer.set_aside`) so the resumed run can save those steps again."""
        damaged = [s for s in checkpointer.all_steps() if s > candidates[0]]  # skipped by `_resumable`
        for step in candidates:
            try:
                restored, reference = resume(checkpointer, step, state, stream=self.prepared.train_stream,
                                             reference=self.ref_params, rewards=self.prepared.rewards)
                error = None
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - unreadable arrays: a damaged checkpoint
                error = e
            if any_host(error is not None):
                self.log(f"warning: checkpoint of step {step} in {self.storage} is damaged or incomplete "
                         f"({short_error(error) if error else 'damaged on another host'}); trying the previous one")
                damaged.append(step)
                continue
            if damaged:
                checkpointer.set_aside(damaged)
                self.log(f"set aside the damaged checkpoints of steps {sorted(damaged)} (checkpoints_damaged/)")
            self.ref_params = reference
            return restored, step
        raise ConfigError(f"none of the checkpoints in {self.storage} restores (steps {sorted(damaged)}); move "
                          "checkpoints/ away to start afresh")

    def _run(self, checkpointer: Checkpointer, candidates: list[int]) -> dict:
        cfg = self.config
        with StopSignals(self.log, every_minutes=cfg.checkpoint.every_minutes) as signals:
            state, resume_from = self._setup(checkpointer, candidates)
            evals, rewards = self._past_evals(resume_from), []
            writer = MetricsWriter(self.run_dir) if self.primary else None
            if writer is not None and resume_from is not None:
                writer.truncate_after(resume_from)  # what the interrupted run wrote after its last checkpoint
            first_step = (resume_from or 0) + 1
            bar = self._bar = ProgressBar(cfg.train.steps, enabled=cfg.train.progress and self.primary,
                                          initial=min(first_step - 1, cfg.train.steps))
            stopped_at = None
            try:
                if resume_from is None:
                    evals.append((0, self._evaluate(0, writer)))
                for step in range(first_step, cfg.train.steps + 1):
                    state, metrics, collected = self._step(step, state)
                    last = step == cfg.train.steps
                    if cfg.eval.every and step % cfg.eval.every == 0 or last:
                        evals.append((step, self._evaluate(step, None)))
                        metrics.update(evals[-1][1])
                    self._publish(step, metrics, collected.first, writer, bar)
                    stop, due = signals.check(step)
                    if stop or due or cfg.checkpoint.every and step % cfg.checkpoint.every == 0 or last:
                        self._save(checkpointer, step, state)
                        signals.saved()
                    rewards.append(metrics["reward/mean"])
                    if stop and not last:
                        stopped_at = step
                        break
                if stopped_at is None and any_host(not evals):  # resumed after the last step, on a host without the logs
                    evals.append((cfg.train.steps, self._evaluate(cfg.train.steps, None)))
            finally:
                bar.close()
                self._bar = None
                if writer is not None:
                    writer.close()
                if self.primary:
                    self.storage.sync()  # what there is, even when the run stops with an error
        self.state = state
        if stopped_at is not None:
            return self._stopped(checkpointer, stopped_at, signals.received)
        return self._summary(evals, rewards)

    def _step(self, step: int, state):
        """Sample and score, complete the batch, update -> (state, the step's metrics, the rollout)."""
        cfg = self.config
        t0 = time.perf_counter()
        collected = self._collect(step)
        batch, tokens, ref_s = self._batch(collected)
        t1 = time.perf_counter()
        for i in range(cfg.grpo.num_iterations):
            state, out = self.par.step(state, batch)
            if i == 0:  # sampler vs trainer: only the first update sees the sampler's policy
                drift = {k: v for k, v in out.items() if k.startswith("health/sampler_train")}
        metrics = {k: float(v) for k, v in {**out, **drift}.items()}  # waits for the last update
        train_s = time.perf_counter() - t1
        nnx.update(self.model, self.par.sampler_params(state))
        check_skips(metrics, cfg.train.max_consecutive_skips)
        metrics.update(self._host_metrics(collected))
        metrics["perf/train_tokens_per_s"] = tokens * cfg.grpo.num_iterations / max(train_s, 1e-9)
        metrics.update({"perf/ref_s": ref_s, "perf/train_s": train_s,
                        "perf/prompt_len": float(batch.prompt_ids.shape[1])})
        metrics["perf/step_s"] = time.perf_counter() - t0
        self._check_rewards(step, collected.first, metrics)
        return state, metrics, collected

    def _stopped(self, checkpointer: Checkpointer, step: int, why: str) -> dict:
        """After a stop signal: the step's checkpoint complete on storage, one line on how to go on."""
        checkpointer.wait()
        if self.primary:
            self.storage.sync()
        self.log(f"stopped by {why} after step {step} of {self.config.train.steps}: its checkpoint is in "
                 f"{self.storage}; run the same command again to resume from it")
        return {"stopped": why, "step": step, "run_dir": str(self.storage)}

    # --- around the loop --------------------------------------------------------------------------
    def _check_rewards(self, step: int, first: Round, metrics: dict) -> None:
        """Make reward failures visible: each failing function's first message of the step (this
        host's samples) is logged; one that failed on every sample of the batch for
        `train.max_reward_failure_steps` steps in a row stops the run with its message (decided
        from the global counts, so every host stops together). Rewards that take more than half of
        a step are reported once."""
        reward_s, step_s = metrics["perf/reward_s"], metrics["perf/step_s"]
        if reward_s > 0.5 * step_s and not self._slow_rewards_said:
            self._slow_rewards_said = True
            self.log(f"step {step}: rewards took {reward_s:.1f} s of a {step_s:.1f} s step (perf/reward_s); the "
                     "reward functions, not the model, set the pace")
        rows = self.config.data.prompts_per_step * self.sampling.group_size
        streaks = self._reward_streaks
        for spec in self.prepared.rewards:
            failed = int(metrics.get(f"reward/{spec.name}/failures", 0))
            message = first.rewards.messages.get(spec.name)
            if failed and message:
                self.log(f"step {step}: reward {spec.name!r} raised on {failed} of {rows} samples (scored None, "
                         f"dropped): {message}")
            streaks[spec.name] = streaks.get(spec.name, 0) + 1 if failed >= rows else 0
            limit = self.config.train.max_reward_failure_steps
            if streaks[spec.name] >= limit:
                raise RuntimeError(f"reward function {spec.name!r} raised on every sample for {limit} steps in a row "
                                   f"(train.max_reward_failure_steps); last error: {message or 'on another host'}")

    def _past_evals(self, resume_from: int | None) -> list[tuple[int, dict]]:
        """A resumed run's evaluations so far, from its metrics.jsonl (pulled from remote storage)."""
        if resume_from is None or not self.primary:
            return []
        self.storage.pull()  # a remote run resumed on a fresh machine: its logs so far
        if not (self.run_dir / "metrics.jsonl").exists():
            return []
        return [(r["step"], r) for r in read_metrics(self.run_dir) if "eval/accuracy" in r and r["step"] <= resume_from]

    def _publish(self, step: int, metrics: dict, first: Round, writer: MetricsWriter | None, bar) -> None:
        if writer is not None:
            writer.write(step, metrics)
            writer.write_histogram(step, "health/pass_rate", self.pass_rates, bins=self.sampling.group_size + 1,
                                   value_range=(0.0, 1.0))
            t = self.config.train
            if t.samples_every and step % t.samples_every == 0:  # process 0's rows: the batch's first
                writer.write_samples(step, sample_records(first, self.sampling.group_size, t.samples_count))
        for hook in self.hooks:
            hook(step, metrics)
        bar.update(step, metrics)

    def _save(self, checkpointer: Checkpointer, step: int, state) -> None:
        save_step(checkpointer, step, self.par.unplace(state), stream=self.prepared.train_stream,
                  seed=self.config.train.seed, reference=self.ref_params, base=self.base_record,
                  rewards=self.prepared.rewards)
        if self.primary:
            self.storage.sync()

    def _evaluate(self, step: int, writer: MetricsWriter | None) -> dict:
        p = self.prepared
        ev = evaluate(self.model, p.eval_examples, reward=p.eval_reward, verifier=p.eval_verifier,
                      sampling=p.eval_sampling,
                      tokenizer=p.tokenizer, mesh=self.mesh, rng=jax.random.key(self.config.train.seed + 1))
        if writer is not None:
            writer.write(step, ev)
        self.log(f"eval at step {step}: accuracy {ev['eval/accuracy']:.3f}, pass@{self.config.eval.k} "
                 f"{ev['eval/pass@k']:.3f}")
        return ev

    def _summary(self, evals: list[tuple[int, dict]], rewards: list[float]) -> dict:
        plot = plot_run(self.run_dir) if self.primary else None
        if self.primary:
            self.storage.sync()
        start, end = evals[0][1], evals[-1][1]
        self.log(f"eval accuracy {start['eval/accuracy']:.3f} -> {end['eval/accuracy']:.3f}; "
                 f"metrics: {self.run_dir / 'metrics.jsonl'}; plot: {plot}")
        return {"eval_start": start, "eval_end": end, "reward": rewards, "run_dir": str(self.storage),
                "plot": str(plot) if plot else None}


def train(config: RunConfig, run_dir: str | Path, *, hooks: Sequence[MetricHook] = (),
          log: Callable[[str], None] | None = None) -> dict:
    """Run GRPO as configured; returns start/end evaluation and the per-step mean rewards."""
    return Trainer(config, run_dir, hooks=hooks, log=log).run()
