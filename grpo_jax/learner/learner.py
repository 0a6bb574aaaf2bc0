"""The learner: one object the loop updates, whatever the parallelism.

`Learner.update(state, trajectories)` completes a rollout source's finished groups on device (group
advantages of the whole batch, the KL reference's log-probs) and applies `grpo.num_iterations`
updates; `place` puts a fresh, restored or unplaced train state where the update wants it,
`params` gives the policy's parameters for the sampler, `unplace` one copy for a checkpoint. The
KL reference (`reference`) is a copy of the starting parameters, or a LoRA run's frozen base; it
is saved with each checkpoint and restored with it.
"""

from __future__ import annotations

import time

import jax
from flax import nnx

from grpo_jax.learner.parallel import Parallel
from grpo_jax.learner.step_factory import TrainState, check_skips
from grpo_jax.learner.train_step import Batch


class Learner:
    def __init__(self, parallel: Parallel, *, num_iterations: int, beta: float, max_consecutive_skips: int,
                 reference: nnx.State | None = None):
        """`reference`: the KL reference's parameters when `beta` > 0 and the policy has no frozen
        base (a copy of the policy's own); a LoRA run's reference is its frozen base."""
        self.parallel = parallel
        self.num_iterations, self.beta, self.max_consecutive_skips = num_iterations, beta, max_consecutive_skips
        self.reference = reference  # saved in checkpoints; None for LoRA (the base is on disk) or beta 0

    @property
    def frozen(self) -> nnx.State | None:
        """The parameters that do not train (a LoRA run's base, on the mesh), else None."""
        return self.parallel.frozen

    @property
    def not_sharded(self) -> list[str]:
        return self.parallel.not_sharded

    def place(self, state: TrainState) -> TrainState:
        return self.parallel.place(state)

    def unplace(self, state: TrainState) -> TrainState:
        return self.parallel.unplace(state)

    def params(self, state: TrainState) -> nnx.State:
        """The policy's parameters on the mesh, for the sampler."""
        return self.parallel.sampler_params(state)

    def footprint(self, state: TrainState) -> dict[str, int]:
        """Bytes the learner holds between steps, by part."""
        def nbytes(tree) -> int:
            return int(sum(x.nbytes for x in jax.tree.leaves(tree)))

        return {"trainable_params_bytes": nbytes(state.params), "optimizer_state_bytes": nbytes(state.opt_state),
                "critic_params_bytes": nbytes(state.critic),
                "frozen_params_bytes": nbytes(self.frozen), "reference_params_bytes": nbytes(self.reference),
                "teacher_params_bytes": nbytes(self.parallel.teacher)}

    def complete(self, trajectories) -> tuple[Batch, dict[str, float]]:
        """The train step's batch from a source's `Trajectories`: advantages of the whole batch, its
        packing plan (train.packing), (beta > 0) the reference's log-probs and (distillation) the
        teacher's -> (batch, metrics: `perf/ref_s`, the seconds the reference and teacher passes
        took, and with packing `perf/pack_fill`, the share of the bins' tokens that are real)."""
        t = trajectories.rows
        adv = self.parallel.advantages(t.rewards)
        batch = Batch(prompt_ids=t.prompt_ids, prompt_mask=t.prompt_mask, completion_ids=t.completion_ids,
                      completion_mask=t.completion_mask, rewards=t.rewards, truncated=t.truncated,
                      old_logprobs=t.old_logprobs, advantages=adv.advantages, valid=adv.valid, zero_std=adv.zero_std,
                      prompt_experts=t.prompt_experts, completion_experts=t.completion_experts)
        batch, fill = self.parallel.pack(batch)
        t0 = time.perf_counter()
        if self.parallel.teacher is not None:  # on-policy distillation: the teacher scores the tokens
            batch = batch.replace(teacher_logprobs=self.parallel.teacher_logprobs(batch))
        if self.beta > 0:
            reference = self.reference if self.frozen is None else self.frozen
            batch = batch.replace(ref_logprobs=self.parallel.ref_logprobs(reference, batch))
        # Waiting for them costs nothing (the update needs them next) and times them on their own.
        jax.block_until_ready((batch.ref_logprobs, batch.teacher_logprobs))
        return batch, {"perf/ref_s": time.perf_counter() - t0, **({} if fill is None else {"perf/pack_fill": fill})}

    def update(self, state: TrainState, trajectories, while_waiting=None) -> tuple[TrainState, dict[str, float]]:
        """`grpo.num_iterations` updates on one step's trajectories -> (state, the update's metrics).
        `while_waiting()` runs after the updates are dispatched, before their results are read (a
        pipelined source samples its next batch while the learner's programs run)."""
        batch, completed = self.complete(trajectories)
        t0 = time.perf_counter()
        for i in range(self.num_iterations):
            state, out = self.parallel.step(state, batch)
            if i == 0:  # sampler vs trainer: only the first update sees the sampler's policy
                drift = {k: v for k, v in out.items() if k.startswith("health/sampler_train")}
        ahead_s = 0.0
        if while_waiting is not None:
            t1 = time.perf_counter()
            while_waiting()
            ahead_s = time.perf_counter() - t1
        metrics = {k: float(v) for k, v in {**out, **drift}.items()}  # waits for the last update
        train_s = time.perf_counter() - t0 - ahead_s  # the learner's own time, less the sampling beside it
        check_skips(metrics, self.max_consecutive_skips)
        if while_waiting is not None:
            metrics["perf/ahead_s"] = ahead_s  # sampling the next batch, during the update
        metrics.update({"perf/train_tokens_per_s": trajectories.tokens * self.num_iterations / max(train_s, 1e-9),
                        **completed, "perf/train_s": train_s,
                        "perf/prompt_len": float(batch.prompt_ids.shape[1])})
        return state, metrics
