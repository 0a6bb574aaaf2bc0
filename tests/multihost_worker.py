"""One process of a training run in its own interpreter (its own device count, and with several
processes a multi-host run), started by tests/trainer/test_multihost.py; not a test itself.

    python tests/multihost_worker.py OUT_DIR RUN_DIR NUM_DEVICES NUM_PROCESSES PROCESS_ID PORT [--set k=v ...]

Trains `configs/demo_cpu.yaml` with the overrides and writes OUT_DIR/process<ID>.npz:
- `final/<i>`: the final parameters as this process holds them, assembled from its own addressable
  shards only (no communication), so two processes' files are two independent copies;
- `warm/<i>`: the parameters after the warm start, the same way;
- `metrics`: the JSON of every step's metrics (as the hooks saw them), `rows_read`: prompts this
  process loaded from the train split.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

out_dir, run_dir, num_devices, num_processes, process_id, port = sys.argv[1:7]
overrides = [a for a in sys.argv[7:] if a != "--set"]
# One compute thread per process: the test runs several of these on two cores at once.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
                           " --xla_cpu_multi_thread_eigen=false").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

from grpo_jax.trainer import loop as trainer_module  # noqa: E402
from grpo_jax.trainer import setup as setup_module  # noqa: E402
from grpo_jax.config import load_config  # noqa: E402
from grpo_jax.runtime.devices import initialize_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if int(num_processes) > 1:
    overrides += ["distributed.enabled=true", f"distributed.coordinator_address=127.0.0.1:{port}",
                  f"distributed.num_processes={num_processes}", f"distributed.process_id={process_id}"]
config = load_config(ROOT / "configs" / "demo_cpu.yaml", overrides)
initialize_distributed(config)
assert jax.process_count() == int(num_processes) and jax.local_device_count() == int(num_devices)


def own_copy(tree) -> list[np.ndarray]:
    """Each array assembled from this process's addressable shards (it must hold all of it)."""
    out = []
    for x in jax.tree.leaves(tree):
        full = np.full(x.shape, np.nan, x.dtype)
        for shard in x.addressable_shards:
            full[shard.index] = np.asarray(shard.data)
        assert not np.isnan(full).any(), "this process does not hold a whole copy of a parameter"
        out.append(full)
    return out


warm = []
original = setup_module.warm_start


def warm_start(prepared, model, log):
    losses = original(prepared, model, log)
    from flax import nnx

    warm.extend(own_copy(nnx.state(model, nnx.Param)))
    return losses


setup_module.warm_start = warm_start
seen: list[dict] = []
trainer = trainer_module.Trainer(config, run_dir, hooks=[lambda step, m: seen.append(m)])
trainer.run()
final = own_copy(trainer.state.params)
if config.parallelism == "pmap":  # stacked per-device copies: each must be the same
    assert all(np.array_equal(a[0], a[i]) for a in final for i in range(1, a.shape[0]))
    final = [a[0] for a in final]
np.savez(Path(out_dir) / f"process{process_id}.npz",
         **{f"final/{i}": a for i, a in enumerate(final)}, **{f"warm/{i}": a for i, a in enumerate(warm)},
         metrics=np.asarray(json.dumps(seen)),
         rows_read=np.asarray(trainer.prepared.train_stream.stats["rows_read"]))
print(f"process {process_id}: done", flush=True)
