"""One process of the cross-mesh copy test (tests/runtime/test_transfer.py); not a test itself.

    python tests/transfer_worker.py OUT_DIR NUM_PROCESSES PROCESS_ID PORT

Each process has 4 CPU devices: the "sampler" mesh is devices 0-1 of every process, the "learner"
mesh devices 2-3. A small tree on the learner mesh (one leaf split over the mesh, one replicated)
is copied to the sampler mesh with `grpo_jax.runtime.transfer.copy_to` (into the sampler's old
arrays, laid out differently), twice; OUT_DIR/process<ID>.json says what each target shard holds.
"""

from __future__ import annotations

import json
import os
import sys

out_dir, num_processes, process_id, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)

from grpo_jax.runtime.transfer import copy_to  # noqa: E402

devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
local = {p: [d for d in devices if d.process_index == p] for p in range(num_processes)}
sampler = Mesh(np.array([local[p][i] for p in range(num_processes) for i in (0, 1)]).reshape(-1, 1), ("data", "tensor"))
learner = Mesh(np.array([local[p][i] for p in range(num_processes) for i in (2, 3)]).reshape(-1, 1), ("data", "tensor"))
values = {"w": np.arange(48, dtype=np.float32).reshape(8, 6), "b": np.arange(6, dtype=np.float32) - 2.5}


def on(mesh, specs, scale):
    return {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i] * scale)
            for k, v in values.items()}


source = on(learner, {"w": P("data"), "b": P()}, 1.0)
targets = {"w": NamedSharding(sampler, P(None, "tensor")), "b": NamedSharding(sampler, P())}  # another layout
old = on(sampler, {k: t.spec for k, t in targets.items()}, 0.0)
report = {}
for round_ in range(2):
    copied = copy_to(source, targets, into=old)
    report[f"round{round_}"] = {
        k: {"sharding_devices": sorted(d.id for d in x.sharding.device_set), "spec": str(x.sharding.spec),
            "equal": all(np.array_equal(np.asarray(s.data), values[k][s.index]) for s in x.addressable_shards),
            "shards": len(x.addressable_shards)} for k, x in copied.items()}
    old = copied
    source = {k: x * 2 for k, x in source.items()}
    values = {k: v * 2 for k, v in values.items()}
report["sampler_ids"] = sorted(d.id for d in sampler.devices.flat)
with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
    json.dump(report, f)
