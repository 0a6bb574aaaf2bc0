"""Parameters from the learner's devices to the sampler's (grpo_jax.runtime.transfer.copy_to):
within one process by device_put, and across two processes (multi-controller, gloo, no Pathways)
by the stacked copy, each target shard holding exactly its part of the source."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_jax.runtime.transfer import copy_to

ROOT = Path(__file__).resolve().parents[2]


def test_one_process_copies_between_device_sets():
    devices = np.array(jax.devices()[:8])
    learner, sampler = Mesh(devices[4:].reshape(2, 2), ("data", "tensor")), Mesh(devices[:4].reshape(2, 2),
                                                                                   ("data", "tensor"))
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = jax.device_put(w, NamedSharding(learner, P("data", "tensor")))
    y = copy_to({"w": x}, {"w": NamedSharding(sampler, P())})["w"]
    assert y.sharding.device_set == set(devices[:4]) and y.sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(y), w)


def test_two_processes_copy_device_to_device_without_pathways(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "transfer_worker.py"), str(tmp_path), "2", str(i),
                               str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    for i in range(2):
        report = json.loads((tmp_path / f"process{i}.json").read_text())
        for round_ in ("round0", "round1"):  # the second copy goes into the first one's arrays
            for leaf in ("w", "b"):
                got = report[round_][leaf]
                assert got["equal"] and got["shards"] == 2, (i, round_, leaf, got)
                assert got["sharding_devices"] == report["sampler_ids"], got
        assert report["round0"]["w"]["spec"] == str(P(None, "tensor"))
