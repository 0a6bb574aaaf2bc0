"""Tools around training: benchmarks (`bench`), FLOP counts, the reward-model trainer (`reward_run`,
in the trainer's own loop, over `reward_training`'s pairs, model and loss), input checks (`check`)
and the smoke check. The top floor but the CLI: nothing below imports it."""
