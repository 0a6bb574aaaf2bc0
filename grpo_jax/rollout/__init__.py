"""The actor side: the sampler, rollout collection with dynamic sampling, evaluation, rollout health,
and the rollout sources the loop pulls trajectory batches from."""
