"""The processes of training runs in their own interpreter (its own device count, and with several
processes a multi-host run), started by tests/trainer/test_multihost.py; not a test itself.

    python tests/multihost_worker.py OUT_DIR NUM_DEVICES NUM_PROCESSES PROCESS_ID PORT RUNS_JSON

RUNS_JSON lists runs ({"name", "run_dir", "overrides"}), trained one after another in this one
interpreter (one start, one `jax.distributed.initialize`; the later runs find the earlier ones'
programs compiled). Each trains `configs/demo_cpu.yaml` with its overrides and writes
OUT_DIR/<name>.process<ID>.npz:
- `final/<i>`: the final parameters as this process holds them, assembled from its own addressable
  shards only (no communication), so two processes' files are two independent copies;
- `warm/<i>`: the parameters after the warm start, the same way;
- `metrics`: the JSON of every step's metrics (as the hooks saw them), `rows_read`: prompts this
  process loaded from the train split;
- `placement/*` (the first run's file, when GRPO_TEST_PLACEMENT_MODEL names an HF directory): that
  model placed on a (1, 4, 2) mesh over every process's devices, before training (`check_placement`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

out_dir, num_devices, num_processes, process_id, port, runs_json = sys.argv[1:7]
RUNS = json.loads(Path(runs_json).read_text())
# One compute thread per process: the test runs several of these on two cores at once.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
                           " --xla_cpu_multi_thread_eigen=false").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

from grpo_jax.trainer import loop as trainer_module  # noqa: E402
from grpo_jax.trainer import setup as setup_module  # noqa: E402
from grpo_jax.config import load_config  # noqa: E402
from grpo_jax.runtime.devices import initialize_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTED = ["distributed.enabled=true", f"distributed.coordinator_address=127.0.0.1:{port}",
               f"distributed.num_processes={num_processes}", f"distributed.process_id={process_id}"]


def run_config(overrides: list[str]):
    return load_config(ROOT / "configs" / "demo_cpu.yaml", overrides + (DISTRIBUTED if int(num_processes) > 1 else []))


initialize_distributed(run_config(RUNS[0]["overrides"]))
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




def cross_process_calls(fn):
    """(fn(), the calls it made into JAX's cross-process paths): `multihost_utils` (device_put checks
    that every host's copy of a host value is equal with `assert_equal`, a gather) and
    `jax.device_put` of a value not yet global onto a sharding that spans processes."""
    from jax.experimental import multihost_utils

    calls: list[str] = []
    names = ("assert_equal", "process_allgather", "broadcast_one_to_all", "host_local_array_to_global_array")
    originals, put = {n: getattr(multihost_utils, n) for n in names}, jax.device_put

    def counted(name):
        return lambda *a, **k: (calls.append(name), originals[name](*a, **k))[1]

    def device_put(x, device=None, *a, **k):
        leaves = jax.tree.leaves(x)
        targets = jax.tree.leaves(device, is_leaf=lambda t: isinstance(t, jax.sharding.Sharding))
        for leaf, target in zip(leaves, targets * len(leaves) if len(targets) == 1 else targets):
            is_global = isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
            if isinstance(target, jax.sharding.Sharding) and not target.is_fully_addressable and not is_global:
                calls.append("device_put")
        return put(x, device, *a, **k)

    for n in names:
        setattr(multihost_utils, n, counted(n))
    jax.device_put = device_put
    try:
        return jax.block_until_ready(fn()), len(calls)
    finally:
        jax.device_put = put
        for n, f in originals.items():
            setattr(multihost_utils, n, f)


def check_placement(path: str) -> dict[str, np.ndarray]:
    """Load the HF directory `path` onto a (1, 4, 2) mesh over every process's devices three ways
    (`from_pretrained(mesh=)`; `place_model` of a model on the default device; `place_model` of one
    loaded `on_host`, a reward model's way), and place a model drawn in host memory (`init_on_host`,
    an initialised policy's way) as well. Returns the cross-process calls each made (and, to show the
    count sees them, the old way's: a device_put of a default-device array onto that mesh), the
    largest difference of any addressable shard from the unsharded model, and the bytes on each
    of this process's devices against the whole model's."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from grpo_jax.config import MeshConfig
    from grpo_jax.models import Transformer, from_pretrained, load_config
    from grpo_jax.runtime.sharding import init_on_host, make_mesh, place_model

    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    params = lambda model: dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))  # noqa: E731
    reference = {k: np.asarray(v.get_value()) for k, v in params(from_pretrained(path)).items()}
    loaded, loaded_calls = cross_process_calls(lambda: params(from_pretrained(path, mesh=mesh)))

    def moved(model):
        place_model(model, mesh)
        return params(model)

    moved_params, moved_calls = cross_process_calls(lambda: moved(from_pretrained(path)))
    # A reward model's or judge's way (loaded into host memory), and an initialised policy's (drawn there).
    host_params, host_calls = cross_process_calls(lambda: moved(from_pretrained(path, on_host=True)))
    config = load_config(path)
    drawn_params, drawn_calls = cross_process_calls(
        lambda: moved(init_on_host(lambda: Transformer(config, rngs=nnx.Rngs(0)))))
    eager = {k: np.asarray(v.get_value()) for k, v in params(Transformer(config, rngs=nnx.Rngs(0))).items()}
    _, old_calls = cross_process_calls(lambda: jax.device_put(jnp.ones(8), NamedSharding(mesh, PartitionSpec())))
    diff, per_device = 0.0, {}
    for placed, want in ((loaded, reference), (moved_params, reference), (host_params, reference),
                         (drawn_params, eager)):
        for key, var in placed.items():
            for shard in var.get_value().addressable_shards:
                diff = max(diff, float(np.abs(np.asarray(shard.data) - want[key][shard.index]).max()))
    for var in loaded.values():
        for shard in var.get_value().addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return {"placement/calls": np.asarray([loaded_calls, moved_calls, host_calls, drawn_calls, old_calls]), "placement/diff": np.asarray(diff),
            "placement/device_bytes": np.asarray(sorted(per_device.values())),
            "placement/model_bytes": np.asarray(sum(v.nbytes for v in reference.values()))}

placement = check_placement(os.environ["GRPO_TEST_PLACEMENT_MODEL"]) if os.environ.get("GRPO_TEST_PLACEMENT_MODEL") else {}
warm = []
original = setup_module.warm_start


def warm_start(prepared, model, log):
    losses = original(prepared, model, log)
    from flax import nnx

    warm.extend(own_copy(nnx.state(model, nnx.Param)))
    return losses


setup_module.warm_start = warm_start
for run in RUNS:
    config, seen = run_config(run["overrides"]), []
    warm.clear()
    trainer = trainer_module.Trainer(config, run["run_dir"], hooks=[lambda step, m: seen.append(m)])
    trainer.run()
    final = own_copy(trainer.state.params)
    if config.parallelism == "pmap":  # stacked per-device copies: each must be the same
        assert all(np.array_equal(a[0], a[i]) for a in final for i in range(1, a.shape[0]))
        final = [a[0] for a in final]
    np.savez(Path(out_dir) / f"{run['name']}.process{process_id}.npz",
             **{f"final/{i}": a for i, a in enumerate(final)}, **{f"warm/{i}": a for i, a in enumerate(warm)},
             metrics=np.asarray(json.dumps(seen)),
             rows_read=np.asarray(trainer.prepared.rollout.stream.stats["rows_read"]), **placement)
    placement = {}
    print(f"{run['name']}, process {process_id}: done", flush=True)
