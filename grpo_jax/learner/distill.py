"""On-policy distillation (`algorithm: distill`): the student samples, the teacher scores the same
tokens (its log-probs come with the batch, `Batch.teacher_logprobs`, from the teacher's pass on the
mesh), and each token's advantage is the negative reverse KL's per-token estimate,
log pi_teacher(y_t) - log pi_student(y_t) at the sampled token y_t, optionally mixed with the group
advantage of the verifiable rewards. The clipped surrogate of the `grpo` section then moves the
student towards the teacher on the student's own samples (Agarwal et al., 2024, "On-policy
distillation of language models"; Thinking Machines' "On-Policy Distillation", 2025).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from grpo_jax.config import DistillConfig


def distill_advantages(teacher_logprobs: jax.Array, student_logprobs: jax.Array, advantages: jax.Array,
                       config: DistillConfig) -> jax.Array:
    """float32 [R, M]: coef x (teacher - student log-prob of each sampled token, the student's
    without gradient) + reward_coef x the row's group advantage (`advantages` [R]). A teacher equal
    to the student gives 0 on every token (reward_coef 0)."""
    chex.assert_equal_shape([teacher_logprobs, student_logprobs])
    chex.assert_shape(advantages, (teacher_logprobs.shape[0],))
    gap = teacher_logprobs.astype(jnp.float32) - jax.lax.stop_gradient(student_logprobs).astype(jnp.float32)
    out = config.coef * gap
    if config.reward_coef:
        out = out + config.reward_coef * advantages.astype(jnp.float32)[:, None]
    return out


def reverse_kl_sum(teacher_logprobs: jax.Array, student_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """The sum over `mask`'s tokens of log pi_student - log pi_teacher at the sampled tokens: with
    the student's samples, divided by the token count, the k1 estimate of KL(student || teacher)
    per token (`distill/reverse_kl`)."""
    gap = jax.lax.stop_gradient(student_logprobs - teacher_logprobs)
    return jnp.sum(gap * mask)
