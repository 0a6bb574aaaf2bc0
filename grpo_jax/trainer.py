"""The GRPO loop: sample -> reward -> group advantages -> clipped update, with evaluation, logging
and checkpoints. Orchestration only: the math lives in sampling, grpo, train_step.

One step: draw `data.prompts_per_step` prompts, sample G completions each (`generate`), score them
on the host (`combine_rewards`), and with `train.dynamic_sampling` keep only groups whose rewards
differ, resampling fresh prompts up to `train.max_resample_rounds` times; a batch still short is
filled with groups marked invalid (no gradient, counted in `dynamic/filled_groups`). Every reward
function also receives `completion_tokens` (the token count of each completion). The batch
always has the same shape, so the train step compiles once. Reward metrics (`reward/*`,
`groups/frac_zero_std`) describe the first round's samples, the policy as it is, not the filtered
batch.

Files in the run directory: `config.yaml`, `model/` (architecture + tokenizer), `metrics.jsonl`,
`samples.jsonl`, `tensorboard/`, `checkpoints/<step>/`, `metrics.png` (at the end).

Several hosts (`distributed.enabled`): every process runs this same loop. Each loads and formats
only its block of each batch's prompts, scores the rollout rows its devices hold, and contributes
its rows to the global batch (grpo_jax.hosts); reward statistics and counters are put together
across hosts, so every process sees the same metrics. Only process 0 writes the run directory's
files and the progress bar; every process takes part in saving checkpoints (orbax writes each
process's shards), so the run directory must be on storage all hosts share.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from grpo_jax.checkpoint import Checkpointer
from grpo_jax.config import ConfigError, RunConfig, config_to_dict
from grpo_jax.evaluation import decode_completions, evaluate, repeat_fields
from grpo_jax.grpo import group_advantages
from grpo_jax.hosts import (any_host, gather_json, gather_rows, is_primary, local_rows, max_over_hosts,
                            sum_over_shares, to_global)
from grpo_jax.logprobs import completion_logprobs
from grpo_jax.metrics import MetricsWriter, ProgressBar, plot_run, read_metrics
from grpo_jax.rewards import RewardResult, combine_rewards
from grpo_jax.run import Prepared, build_model, prepare, write_model_files
from grpo_jax.sampling import generate, pad_prompts
from grpo_jax.sft import completion_batch, sft_step
from grpo_jax.storage import RunDirectory
from grpo_jax.sharding import (param_shardings, place_train_state, replicate, replicated, shard_rows, split_rows,
                               unreplicate)
from grpo_jax.train_step import Batch, check_skips, init_state, make_optimizer, make_train_step

MetricHook = Callable[[int, dict], None]


@dataclasses.dataclass
class _Groups:
    """Host-side rows of the groups chosen for one step (G rows per group)."""

    examples: list
    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    mask: list[np.ndarray]
    truncated: list[np.ndarray]
    rewards: list[np.ndarray]

    @classmethod
    def empty(cls):
        return cls([], [], [], [], [], [])

    def add(self, example, sl: slice, rollout: dict, rewards: np.ndarray):
        self.examples.append(example)
        for name in ("tokens", "logprobs", "mask", "truncated"):
            getattr(self, name).append(rollout[name][sl])
        self.rewards.append(rewards[sl])

    def add_invalid_copy(self, other: "_Groups", j: int):
        """Group j of `other` with NaN rewards: no gradient, not in the loss normaliser."""
        self.examples.append(other.examples[j])
        for name in ("tokens", "logprobs", "mask", "truncated"):
            getattr(self, name).append(getattr(other, name)[j])
        self.rewards.append(np.full_like(other.rewards[j], np.nan))


def _uniform_groups(total_R: np.ndarray, group_size: int) -> np.ndarray:
    """bool [N]: groups whose judged rewards are all equal, or with fewer than 2 judged (no signal)."""
    groups = total_R.reshape(-1, group_size)
    judged = ~np.isnan(groups)
    hi = np.where(judged, groups, -np.inf).max(axis=1)
    lo = np.where(judged, groups, np.inf).min(axis=1)
    return (judged.sum(axis=1) < 2) | (hi == lo)


def _schedule(config: RunConfig):
    t = config.train
    if t.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, max(t.warmup_steps, 1), t.steps)
    if t.warmup_steps:
        return optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps)
    return t.learning_rate


def common_bucket(prompts: Sequence[Sequence[int]], buckets: Sequence[int]) -> tuple[int, ...]:
    """The one prompt bucket that fits every host's longest prompt (all hosts must pad alike)."""
    longest = max_over_hosts(max(len(p) for p in prompts))
    return tuple(b for b in sorted(buckets) if b >= longest)[:1] or tuple(buckets)


def warm_start(prepared: Prepared, model, log: Callable[[str], None]) -> list[float]:
    """The supervised phase (`sft.steps` steps) on the train split's reference answers, data-parallel
    over the run's mesh (each host builds its block of every batch)."""
    from grpo_jax.hosts import row_share

    cfg, sampling, mesh = prepared.config.sft, prepared.sampling, prepared.mesh
    tok = prepared.tokenizer
    eos = sampling.stop_token_ids[0]
    share = row_share(mesh, cfg.batch_size)
    t = prepared.config.train
    optimizer = optax.adamw(cfg.learning_rate, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps)
    graphdef, params = nnx.split(model, nnx.Param)
    # Moments follow their params; the step count goes on the mesh too, replicated, so the step's
    # inputs keep one sharding from call to call (else the second call compiles again).
    opt_state = jax.tree.map(lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
                             else jax.device_put(x, replicated(mesh)), optimizer.init(params))
    losses = []
    for i in range(cfg.steps):
        examples = prepared.sft_stream.next_batch(share.size)
        answers = [tok.encode(cfg.answer_template.format(**ex.fields), add_special_tokens=False) + [eos]
                   for ex in examples]
        prompts = [ex.prompt_ids for ex in examples]
        batch = completion_batch(prompts, answers, prompt_buckets=common_bucket(prompts, sampling.prompt_buckets),
                                 max_new_tokens=sampling.max_new_tokens, pad_id=sampling.pad_token_id)
        params, opt_state, loss = sft_step(params, opt_state, to_global(batch, mesh, share),
                                           graphdef=graphdef, optimizer=optimizer,
                                           chunk=prepared.config.train.logprob_chunk)
        losses.append(float(loss))
        if (i + 1) % max(1, cfg.steps // 5) == 0 or i + 1 == cfg.steps:
            log(f"sft step {i + 1}/{cfg.steps}: loss {np.mean(losses[-10:]):.4f}")
    nnx.update(model, params)
    return losses


class Trainer:
    def __init__(self, config: RunConfig, run_dir: str | Path, *, hooks: Sequence[MetricHook] = (),
                 log: Callable[[str], None] | None = None):
        # Log lines go above the progress bar (to stderr), unless the caller takes them.
        # A remote run directory (gs://...) stages the small files locally (grpo_jax.storage).
        self.storage = RunDirectory(run_dir)
        self.config, self.run_dir, self.hooks = config, self.storage.local, list(hooks)
        self._bar: ProgressBar | None = None
        self.log = log or (lambda line: (self._bar.write(line) if self._bar else print(line, file=sys.stderr)))
        self.prepared = prepare(config)  # every input check, before any compile
        self.primary = is_primary()  # process 0 writes the run directory's files
        if not self.primary:
            self.log = lambda line: None
        self.mesh, self.share = self.prepared.mesh, self.prepared.share
        self.rows = self.share.scaled(config.sampling.group_size)  # this host's rows of the rollout and batch
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_count() > 1 and not self.storage.remote:
            self.log(f"run directory {self.run_dir} is a local path: every host must see the same directory "
                     "(a shared file system), or each host's checkpoint shards land on its own disk; use gs://...")
        if self.storage.remote:
            self.log(f"run directory {self.storage}: checkpoints written there, logs staged in {self.run_dir} and "
                     "uploaded at every checkpoint")
        if self.primary:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
            write_model_files(self.prepared, self.run_dir / "model")
        self.sampling = self.prepared.sampling
        self.eval_sampling = dataclasses.replace(
            self.sampling, group_size=config.eval.k,
            temperature=self.sampling.temperature if config.eval.temperature is None else config.eval.temperature)
        self.rng = jax.random.key(config.train.seed)

    # --- sampling and rewards -------------------------------------------------------------------
    def _round(self, step: int, rnd: int):
        """One sampling round: N prompts, G samples each, scored. This host's block of them: its
        prompts, its rows of the rollout, their rewards."""
        p, G = self.prepared, self.sampling.group_size
        examples = p.train_stream.next_batch(self.share.size)
        prompts = [ex.prompt_ids for ex in examples]
        ids = pad_prompts(prompts, common_bucket(prompts, self.sampling.prompt_buckets), self.sampling.pad_token_id)
        t0 = time.perf_counter()
        rollout = generate(self.model, to_global(ids, self.mesh, self.share), self.sampling,
                           jax.random.fold_in(self.rng, step * 64 + rnd), mesh=self.mesh)
        names = ("tokens", "logprobs", "mask", "truncated", "lengths")
        host = dict(zip(names, local_rows(tuple(getattr(rollout, k) for k in names), self.rows)))
        sample_s = time.perf_counter() - t0
        texts = decode_completions(p.tokenizer, host["tokens"], host["lengths"])
        prompts = [ex.prompt_text for ex in examples for _ in range(G)]
        fields = {**repeat_fields(examples, G), "completion_tokens": host["lengths"].tolist()}
        result = combine_rewards(p.rewards, prompts, texts, fields)
        return examples, host, texts, result, sample_s

    def collect(self, step: int):
        """This host's N / hosts groups for the step, and the step's statistics over all hosts."""
        G, N = self.sampling.group_size, self.share.size
        t = self.config.train
        chosen, spare = _Groups.empty(), _Groups.empty()
        stats = {"dynamic/rounds": 0.0, "dynamic/dropped_groups": 0.0}
        sample_tokens, sample_s, first = 0, 0.0, None
        while True:
            examples, host, texts, result, secs = self._round(step, int(stats["dynamic/rounds"]))
            stats["dynamic/rounds"] += 1
            sample_tokens += int(host["lengths"].sum())
            sample_s += secs
            if first is None:
                first = (examples, host, texts, result)
            total = result.total
            uniform = _uniform_groups(total, G)
            for i, ex in enumerate(examples):
                sl = slice(i * G, (i + 1) * G)
                if not t.dynamic_sampling or not uniform[i]:
                    chosen.add(ex, sl, host, total)
                else:
                    stats["dynamic/dropped_groups"] += 1
                    spare.add(ex, sl, host, total)
            # Sampling is collective: every host runs the same rounds, as long as any host is short.
            if (not t.dynamic_sampling or stats["dynamic/rounds"] > t.max_resample_rounds
                    or not any_host(len(chosen.examples) < N)):
                break
        missing = max(0, N - len(chosen.examples))
        src = spare if spare.examples else chosen
        for i in range(missing):
            chosen.add_invalid_copy(src, i % len(src.examples))
        stats["dynamic/filled_groups"] = float(missing)
        del chosen.examples[N:]
        for name in ("tokens", "logprobs", "mask", "truncated", "rewards"):
            del getattr(chosen, name)[N:]
        counts = sum_over_shares({**{k: v for k, v in stats.items() if k != "dynamic/rounds"},
                                  "sample_tokens": sample_tokens}, self.share)
        sample_tokens = counts.pop("sample_tokens")
        stats.update(counts)
        perf = {"perf/sample_tokens_per_s": sample_tokens / max(sample_s, 1e-9), "perf/sample_s": sample_s}
        return chosen, first, stats, perf

    def _all_hosts(self, result: RewardResult) -> RewardResult:
        """The first round's rewards of every host's rows (for the step's reward statistics)."""
        return RewardResult(total=gather_rows(result.total, self.rows),
                            per_fn={k: gather_rows(v, self.rows) for k, v in result.per_fn.items()},
                            failures={k: int(v) for k, v in sum_over_shares(result.failures, self.share).items()},
                            messages=result.messages)

    def make_batch(self, groups: _Groups) -> tuple[Batch, int]:
        """The global batch from every host's groups (each host builds its rows; advantages need only
        the host's own whole groups), and the number of tokens in it."""
        G, g = self.sampling.group_size, self.config.grpo
        prompts = [ex.prompt_ids for ex in groups.examples]
        prompt_ids, prompt_mask = pad_prompts(prompts, common_bucket(prompts, self.sampling.prompt_buckets),
                                              self.sampling.pad_token_id)
        rewards = np.concatenate(groups.rewards).astype(np.float32)
        adv = group_advantages(jnp.asarray(rewards), G, scale=g.advantage_scale, estimator=g.advantage_estimator,
                               eps=g.advantage_eps)
        rows = Batch(prompt_ids=np.repeat(prompt_ids, G, axis=0), prompt_mask=np.repeat(prompt_mask, G, axis=0),
                     completion_ids=np.concatenate(groups.tokens), completion_mask=np.concatenate(groups.mask),
                     rewards=rewards, advantages=np.asarray(adv.advantages), valid=np.asarray(adv.valid),
                     zero_std=np.asarray(adv.zero_std), truncated=np.concatenate(groups.truncated),
                     old_logprobs=np.concatenate(groups.logprobs))
        tokens = sum_over_shares({"t": rows.prompt_mask.sum() + rows.completion_mask.sum()}, self.share)["t"]
        batch = to_global(rows, self.mesh, self.rows)
        if g.beta > 0:
            batch = batch.replace(ref_logprobs=self._ref_logprobs(self.ref_params, batch.prompt_ids, batch.prompt_mask,
                                                                  batch.completion_ids))
        return batch, int(tokens)

    # --- the loop ---------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.config
        checkpointer = Checkpointer(self.storage.checkpoints, keep=cfg.checkpoint.keep)  # every process
        resume_from = checkpointer.latest_step()
        try:
            if resume_from is not None and not cfg.train.resume:
                raise ConfigError(f"{self.storage} already holds checkpoints (newest: step {resume_from}); resume "
                                  "it (train.resume: true) or choose another --output")
            return self._run(checkpointer, resume_from)
        finally:
            checkpointer.close()

    def _run(self, checkpointer: Checkpointer, resume_from: int | None) -> dict:
        cfg, p = self.config, self.prepared
        self.model = build_model(cfg.model, p.model_config, cfg.train.seed)
        # Every host built the same parameters; place them on the mesh by the rules (pmap mode: its
        # data-only mesh, so replicated) for the warm start and the sampler.
        params = nnx.state(self.model, nnx.Param)
        nnx.update(self.model, jax.device_put(params, param_shardings(params, self.mesh).shardings))
        if cfg.sft.steps and resume_from is None:  # a resumed run's params come from its checkpoint
            t0 = time.perf_counter()
            losses = warm_start(p, self.model, self.log)
            self.log(f"warm start: {cfg.sft.steps} steps in {time.perf_counter() - t0:.1f} s, "
                     f"loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}")
        optimizer = make_optimizer(_schedule(cfg), max_grad_norm=cfg.train.max_grad_norm,
                                   weight_decay=cfg.train.weight_decay, b1=cfg.train.adam_b1, b2=cfg.train.adam_b2,
                                   eps=cfg.train.adam_eps)
        graphdef, state = init_state(self.model, optimizer)
        step_kw = dict(micro_batches=cfg.train.micro_batches, logprob_chunk=cfg.train.logprob_chunk,
                       temperature=self.sampling.temperature)
        if cfg.parallelism == "jit":
            # One mesh for sampling and training; the params are placed by the logical-axis rules.
            state, shardings, left_whole = place_train_state(state, self.mesh)
            for line in left_whole:
                self.log(f"not sharded (its mesh axis does not divide it): {line}")
            step_fn = make_train_step(graphdef, optimizer, cfg.grpo, mesh=self.mesh, state_shardings=shardings,
                                      **step_kw)
        else:
            # pmap: the state replicated on every local device, rows split; sampling runs data-parallel
            # over the same devices (a data-only mesh, params replicated).
            devices = jax.local_devices()
            state = replicate(state, devices)
            step_fn = make_train_step(graphdef, optimizer, cfg.grpo, parallelism="pmap", devices=devices, **step_kw)
        self.ref_params = None
        if cfg.grpo.beta > 0:
            self.ref_params = jax.tree.map(jnp.copy, nnx.state(self.model, nnx.Param))
            self._ref_logprobs = jax.jit(lambda params, *a: completion_logprobs(
                nnx.merge(graphdef, params), *a, chunk=cfg.train.logprob_chunk,
                temperature=self.sampling.temperature)[0])
        history = {"eval": []}
        if resume_from is not None:
            state = self._resume(checkpointer, resume_from, state)
            if self.primary:
                self.storage.pull()  # a remote run resumed on a fresh machine: its logs so far
                if (self.run_dir / "metrics.jsonl").exists():
                    history["eval"] = [(r["step"], r) for r in read_metrics(self.run_dir)
                                       if "eval/accuracy" in r and r["step"] <= resume_from]
        self._sync_policy(state)
        writer = MetricsWriter(self.run_dir) if self.primary else None
        if writer is not None and resume_from is not None:
            writer.truncate_after(resume_from)  # what the interrupted run wrote after its last checkpoint
        first_step = (resume_from or 0) + 1
        bar = self._bar = ProgressBar(cfg.train.steps, enabled=cfg.train.progress and self.primary,
                                      initial=min(first_step - 1, cfg.train.steps))
        try:
            if resume_from is None:
                history["eval"].append((0, self._evaluate(0, writer)))
            for step in range(first_step, cfg.train.steps + 1):
                t0 = time.perf_counter()
                groups, first, dyn, perf = self.collect(step)
                batch, tokens = self.make_batch(groups)
                t1 = time.perf_counter()
                if cfg.parallelism == "pmap":
                    device_batch = split_rows(jax.tree.map(np.asarray, batch), len(jax.local_devices()))
                else:
                    device_batch = shard_rows(batch, self.mesh)
                for _ in range(cfg.grpo.num_iterations):
                    state, out = step_fn(state, device_batch)
                if cfg.parallelism == "pmap":
                    out = unreplicate(out)
                metrics = {k: float(v) for k, v in out.items()}
                train_s = time.perf_counter() - t1
                self._sync_policy(state)
                check_skips(metrics, cfg.train.max_consecutive_skips)
                metrics.update(self._reward_metrics(self._all_hosts(first[3])), **dyn, **perf, **self._data_metrics())
                metrics["perf/train_tokens_per_s"] = tokens * cfg.grpo.num_iterations / max(train_s, 1e-9)
                metrics["perf/step_s"] = time.perf_counter() - t0
                if cfg.eval.every and step % cfg.eval.every == 0 or step == cfg.train.steps:
                    ev = self._evaluate(step, None)
                    history["eval"].append((step, ev))
                    metrics.update(ev)
                if writer is not None:
                    writer.write(step, metrics)
                for hook in self.hooks:
                    hook(step, metrics)
                bar.update(step, metrics)
                if writer is not None and cfg.train.samples_every and step % cfg.train.samples_every == 0:
                    writer.write_samples(step, self._samples(first))  # process 0's rows: the batch's first
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
                    saved = unreplicate(state) if cfg.parallelism == "pmap" else state
                    streams = gather_json(p.train_stream.state_dict())  # each host's position in its share
                    checkpointer.save(step, saved, {"step": step, "seed": cfg.train.seed, "data": streams[0],
                                                    **({"data_by_process": streams} if len(streams) > 1 else {})},
                                      reference=self.ref_params)
                    if self.primary:
                        self.storage.sync()
                history.setdefault("reward", []).append(metrics["reward/mean"])
            if any_host(not history["eval"]):  # resumed after the last step, on a host without the logs
                history["eval"].append((cfg.train.steps, self._evaluate(cfg.train.steps, None)))
        finally:
            bar.close()
            self._bar = None
            if writer is not None:
                writer.close()
            if self.primary:
                self.storage.sync()  # what there is, even when the run stops with an error
        self.state = state
        plot = plot_run(self.run_dir) if self.primary else None
        if self.primary:
            self.storage.sync()
        (acc0, acc1) = (history["eval"][0][1]["eval/accuracy"], history["eval"][-1][1]["eval/accuracy"])
        self.log(f"eval accuracy {acc0:.3f} -> {acc1:.3f}; metrics: {self.run_dir / 'metrics.jsonl'}; plot: {plot}")
        return {"eval_start": history["eval"][0][1], "eval_end": history["eval"][-1][1],
                "reward": history.get("reward", []), "run_dir": str(self.storage),
                "plot": str(plot) if plot else None}

    def _resume(self, checkpointer: Checkpointer, step: int, state):
        """The state, reference policy and data stream position of checkpoint `step`, placed like `state`."""
        pmap = self.config.parallelism == "pmap"
        restored, reference, meta = checkpointer.restore(step, unreplicate(state) if pmap else state, self.ref_params)
        streams = meta.get("data_by_process") or [meta["data"]]
        if len(streams) != jax.process_count():
            raise ConfigError(f"checkpoint step {step} was written by {len(streams)} processes, this run has "
                              f"{jax.process_count()}; resume with the same number of hosts")
        try:
            self.prepared.train_stream.load_state_dict(streams[jax.process_index()])
        except ValueError as e:
            raise ConfigError(f"cannot resume step {step} with this config: {e}") from None
        if reference is not None:
            self.ref_params = reference
        self.log(f"resumed from the checkpoint of step {step} in {self.storage}"
                 + (f"; the run already reached train.steps={self.config.train.steps}, nothing left to train"
                    if step >= self.config.train.steps else ""))
        return replicate(restored, jax.local_devices()) if pmap else restored

    def _sync_policy(self, state) -> None:
        """The sampler's model gets the state's params (pmap: one copy, replicated over the mesh)."""
        if self.config.parallelism == "pmap":
            params = jax.device_put(unreplicate(state.params), replicated(self.mesh))
        else:
            params = state.params
        nnx.update(self.model, params)

    def _evaluate(self, step: int, writer: MetricsWriter | None) -> dict:
        p = self.prepared
        ev = evaluate(self.model, p.eval_examples, reward=p.eval_reward, sampling=self.eval_sampling,
                      tokenizer=p.tokenizer, mesh=self.mesh, rng=jax.random.key(self.config.train.seed + 1))
        if writer is not None:
            writer.write(step, ev)
        self.log(f"eval at step {step}: accuracy {ev['eval/accuracy']:.3f}, pass@{self.config.eval.k} "
                 f"{ev['eval/pass@k']:.3f}")
        return ev

    def _reward_metrics(self, result: RewardResult) -> dict:
        G = self.sampling.group_size
        total = result.total
        judged = total[~np.isnan(total)]
        out = {"reward/mean": float(judged.mean()) if judged.size else float("nan"),
               "reward/std": float(judged.std()) if judged.size else float("nan"),
               "groups/frac_zero_std": float(_uniform_groups(total, G).mean()), "reward/dropped": float(np.isnan(total).sum())}
        out.update(result.metrics())
        out.update({f"reward/{name}/failures": float(n) for name, n in result.failures.items()})
        return out

    def _data_metrics(self) -> dict:
        """The prompt streams' counters summed over the hosts' shares (the epoch is each host's own)."""
        stats = dict(self.prepared.train_stream.stats)
        epoch = max_over_hosts(stats.pop("epoch"))
        return {f"data/{k}": v for k, v in {**sum_over_shares(stats, self.share), "epoch": float(epoch)}.items()}

    def _samples(self, first) -> list[dict]:
        examples, host, texts, result = first
        G, n = self.sampling.group_size, self.config.train.samples_count
        rows = []
        for r in range(0, min(n * G, len(texts)), G):  # the first sample of each of the first n prompts
            rows.append({"prompt": examples[r // G].prompt_text, "completion": texts[r],
                         "reward": float(result.total[r]),
                         **{f"reward/{k}": float(v[r]) for k, v in result.per_fn.items()}})
        return rows


def train(config: RunConfig, run_dir: str | Path, *, hooks: Sequence[MetricHook] = (),
          log: Callable[[str], None] | None = None) -> dict:
    """Run GRPO as configured; returns start/end evaluation and the per-step mean rewards."""
    return Trainer(config, run_dir, hooks=hooks, log=log).run()
