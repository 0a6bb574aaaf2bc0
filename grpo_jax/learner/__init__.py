"""The learner side: the objectives (GRPO, PPO, log-probs), the train step, the optimizer, the
jit/pmap parallelism and the `Learner` the loop updates."""
