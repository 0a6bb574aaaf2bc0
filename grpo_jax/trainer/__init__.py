"""A training run: its inputs prepared and checked, the loop and its hooks, checkpoints and resume."""
