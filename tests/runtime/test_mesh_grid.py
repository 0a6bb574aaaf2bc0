"""sharding.mesh_device_grid on fake TPU pod slices: every process owns one contiguous, equal-sized
block of batch rows, `hosts.row_share` gives each host exactly those rows, and the hosts' data
streams side by side are the batch one host would read. No TPU needed: the fakes carry the
attributes JAX's mesh_utils reads (id, process_index, coords, core_on_chip, device_kind, platform,
slice_index).

Slice layouts (chips x by y, each worker VM = one JAX process holding a block of chips):
- v5litepod-8: one VM with all 8 chips (2x4 topology).
- v5litepod-16 / -32 / -64: 4 / 8 / 16 VMs of 4 chips (2x2 each) in 4x4 / 4x8 / 8x8 topologies.
- v6e-16 / v6e-32: 4 / 8 VMs of 4 chips in 4x4 / 4x8.
Checked against Cloud TPU's v5e and v6e pages (v6e's table: 4x4 = 16 chips, 2 hosts, 4 VMs;
4x8 = 32 chips, 4 hosts, 8 VMs; v5e multi-host training slices use 4-chip VMs, so v5litepod-32 is
8 VMs, not the "4 hosts" of 8 chips its table counts) and GKE's TPU_HOST_BOUNDS for a v5e 4x8
slice ("2,4,1": 2 x 4 VMs of 2x2 chips). Which VM gets which process index is not documented, so
the tests also run with the process indices shuffled over the VMs.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from grpo_jax import mesh_device_grid
from grpo_jax.config import MeshConfig
from grpo_jax.data.sampler import IndexSampler
from grpo_jax.runtime.hosts import row_share
from grpo_jax.runtime.sharding import AXES, make_mesh


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    coords: tuple[int, int, int]
    device_kind: str
    core_on_chip: int = 0
    platform: str = "tpu"
    slice_index: int = 0


@dataclasses.dataclass(frozen=True)
class CpuDevice:
    id: int
    process_index: int
    device_kind: str = "cpu"
    platform: str = "cpu"


# name -> (chips along x, y), (chips of one VM along x, y), device_kind
SLICES = {
    "v5litepod-8": ((4, 2), (4, 2), "TPU v5 lite"),
    "v5litepod-16": ((4, 4), (2, 2), "TPU v5 lite"),
    "v5litepod-32": ((4, 8), (2, 2), "TPU v5 lite"),
    "v5litepod-64": ((8, 8), (2, 2), "TPU v5 lite"),
    "v6e-16": ((4, 4), (2, 2), "TPU v6 lite"),
    "v6e-32": ((4, 8), (2, 2), "TPU v6 lite"),
}
MULTI_HOST = [name for name in SLICES if name != "v5litepod-8"]


def pod_slice(name: str, shuffle_processes: bool = False) -> list[FakeDevice]:
    """A slice's devices in id order (jax.devices()'s), ids numbered VM by VM."""
    (cx, cy), (hx, hy), kind = SLICES[name]
    vms = [(vx, vy) for vy in range(cy // hy) for vx in range(cx // hx)]
    process = list(range(len(vms)))
    if shuffle_processes:
        random.Random(0).shuffle(process)
    devices = []
    for p in range(len(vms)):  # VM by VM in process order, so ids stay process-major like on a pod
        vx, vy = vms[process.index(p)]
        for y in range(hy):
            for x in range(hx):
                devices.append(FakeDevice(len(devices), p, (vx * hx + x, vy * hy + y, 0), kind))
    return devices


def mesh_configs(processes: int) -> list[MeshConfig]:
    return [MeshConfig(data=1, fsdp=-1, tensor=1), MeshConfig(data=processes, fsdp=-1, tensor=1),
            MeshConfig(data=2, fsdp=-1, tensor=2), MeshConfig(data=-1, fsdp=1, tensor=1),
            MeshConfig(data=1, fsdp=-1, tensor=4), MeshConfig(data=-1, fsdp=1, tensor=8),
            MeshConfig(data=1, fsdp=2, expert=-1, tensor=1), MeshConfig(data=2, fsdp=1, expert=-1, tensor=2)]


def rows_by_process(grid: np.ndarray) -> dict[int, list[int]]:
    """process -> the row shards ((d * fsdp + f) * expert + e) holding one of its devices."""
    out: dict[int, set[int]] = {}
    for row, devices in enumerate(grid.reshape(-1, grid.shape[-1])):
        for device in devices:
            out.setdefault(device.process_index, set()).add(row)
    return {p: sorted(rows) for p, rows in out.items()}


def contiguous_equal_blocks(grid: np.ndarray) -> bool:
    blocks = rows_by_process(grid).values()
    return (len({len(b) for b in blocks}) == 1
            and all(b == list(range(b[0], b[0] + len(b))) for b in blocks))


@pytest.mark.parametrize("name", MULTI_HOST)
def test_jax_make_mesh_scatters_a_hosts_chips_over_the_rows(name):
    # Why mesh_device_grid exists: JAX's own order (by torus coordinates) gives a host rows that
    # are not one block, and row_share then refuses every such host.
    devices = pod_slice(name)
    mesh = jax.make_mesh((1, len(devices), 1, 1), AXES, devices=devices)
    assert not contiguous_equal_blocks(mesh.devices)
    with pytest.raises(ValueError, match="not one aligned contiguous block"):
        for p in range(devices[-1].process_index + 1):
            row_share(mesh, 4 * len(devices), process=p)


@pytest.mark.parametrize("shuffle", [False, True], ids=["processes_in_order", "processes_shuffled"])
@pytest.mark.parametrize("name", MULTI_HOST)
def test_every_host_owns_one_block_of_rows_and_reads_exactly_them(name, shuffle):
    devices = pod_slice(name, shuffle)
    processes = devices[-1].process_index + 1
    for config in mesh_configs(processes):
        grid = mesh_device_grid(mesh_config=config, devices=random.Random(1).sample(devices, len(devices)))
        data, fsdp, expert, tensor = grid.shape
        assert grid.size == len(devices) and {d.id for d in grid.flat} == {d.id for d in devices}
        assert contiguous_equal_blocks(grid), (config, rows_by_process(grid))
        if tensor <= len(devices) // processes:  # a row's tensor group never leaves its host
            for row in grid.reshape(data * fsdp * expert, tensor):
                assert len({d.process_index for d in row}) == 1

        # row_share (what the trainer calls) agrees, and the hosts' streams make up one batch.
        mesh = Mesh(grid, AXES)
        total = 2 * data * fsdp * expert
        shares = {p: row_share(mesh, total, process=p) for p in range(processes)}
        rows = rows_by_process(grid)
        whole_batch = IndexSampler(1000, seed=3, block=total).next(total)
        for p, share in shares.items():
            assert (share.start, share.stop) == (2 * rows[p][0], 2 * (rows[p][-1] + 1))
            sampler = IndexSampler(1000, seed=3, process_index=share.index, process_count=share.count,
                                   block=share.size)
            assert sampler.next(share.size) == whole_batch[share.start:share.stop]
        assert sorted({(s.start, s.stop) for s in shares.values()})[-1][1] == total
        assert sum(s.size for s in {(s.start, s.stop): s for s in shares.values()}.values()) == total


def test_one_host_keeps_jax_ici_order():
    # v5litepod-8: a single process, so the order is jax.make_mesh's own (its ring over the 2x4
    # chips), as before mesh_device_grid.
    devices = pod_slice("v5litepod-8")
    for shape in [(1, 8, 1, 1), (2, 2, 1, 2), (1, 2, 1, 4), (8, 1, 1, 1), (1, 2, 2, 2), (1, 1, 8, 1)]:
        data, fsdp, expert, tensor = shape
        grid = mesh_device_grid(mesh_config=MeshConfig(data=data, fsdp=fsdp, expert=expert, tensor=tensor),
                                devices=devices)
        assert grid.shape == shape
        assert [d.id for d in grid.flat] == [d.id for d in jax.make_mesh(shape, AXES, devices=devices).devices.flat]
        if expert == 1:  # the order of the three-axis mesh before `expert` existed
            three = jax.make_mesh((data, fsdp, tensor), ("data", "fsdp", "tensor"), devices=devices)
            assert [d.id for d in grid.flat] == [d.id for d in three.devices.flat]
    assert [d.id for d in grid.flat] != list(range(8))  # a ring, not the id order


def test_devices_without_coordinates_keep_their_order():
    # CPU devices (no torus): the in-order reshape, which is already host-major for jax.devices().
    devices = [CpuDevice(d.id, d.process_index) for d in pod_slice("v5litepod-16")]
    grid = mesh_device_grid(mesh_config=MeshConfig(data=2, fsdp=-1, tensor=2), devices=devices)
    assert [d.id for d in grid.flat] == list(range(16)) and contiguous_equal_blocks(grid)
    real = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert list(real.devices.flat) == jax.devices()[:8]


def test_meshes_that_cannot_follow_the_hosts_are_refused():
    devices = pod_slice("v5litepod-32")[:24]  # 6 VMs of 4 chips: tensor=6 would cut a host's chips
    with pytest.raises(ValueError, match="mesh.tensor=6 neither divides nor is a multiple"):
        mesh_device_grid(mesh_config=MeshConfig(data=-1, tensor=6), devices=devices)
    with pytest.raises(ValueError, match=r"processes hold \[3, 4\] devices"):
        mesh_device_grid(mesh_config=MeshConfig(fsdp=-1), devices=pod_slice("v5litepod-16")[:15])
