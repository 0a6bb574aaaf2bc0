"""Tools around training: benchmarks, FLOP counts, reward-model training, the smoke check."""
