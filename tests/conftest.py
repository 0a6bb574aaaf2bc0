"""Test setup: 8 emulated CPU devices (set before JAX is imported) and float32 matmuls."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The slowest files first: CI runs the suite on 2 xdist workers by file (`--dist loadfile`), which
# hands out files in collection order, so starting the long ones early keeps both workers busy to the
# end instead of leaving one of them alone with a long file at the tail.
SLOW_FIRST = ("test_trainer_parallel.py", "test_sharding.py", "test_trainer.py", "test_train_step.py",
              "test_sampling.py", "test_cli.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept
