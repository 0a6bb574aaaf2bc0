"""XLA's CPU client runs each device's part of a program on a pool of max(cores, devices) threads (8
here) unless PJRT_NPROC sets it. Two multi-device programs with collectives, dispatched in turn and
neither waiting on the other, can then deadlock: each pool thread holds a part waiting at a
rendezvous for a part that has no thread, and XLA aborts the process after 40 s (this program: 3 of
3 tries with the default pool, 2026-12-06; seen once in tests/trainer/test_multihost.py).
tests/conftest.py sets PJRT_NPROC=16; this runs the two programs under the suite's own
environment, in a process of its own so that a deadlock is a failure here, not a lost worker."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = """
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("a", "b")))
y = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("b", "a")))

@jax.jit
def f(v):  # each product reshards: collectives over both axes
    for _ in range(20):
        v = jnp.tanh(v @ v.T @ v) * 0.01
    return v

@jax.jit
def g(v):
    for _ in range(5):
        v = jnp.sin(v.T @ v @ v.T).T * 0.01
    return v

outs = [h(a) for _ in range(300) for h, a in ((f, x), (g, y))]
print(len(jax.block_until_ready(outs)), jax.device_count(), flush=True)
"""


def test_two_multi_device_programs_in_flight_finish_with_the_suites_thread_pool():
    assert int(os.environ["PJRT_NPROC"]) >= 2 * 8
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["600", "8"]
