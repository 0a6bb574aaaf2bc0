"""The platform a program runs on ("cpu", "gpu" or "tpu"), as every implementation choice reads it
(attention, the paged engine's decode step, the experts' matmul), and a faked platform for tests:
under `faked_platform("gpu")` on a CPU machine those choices are made as on a GPU and the Pallas
kernels they pick run in interpret mode (`interpret_kernels`), so a GPU- or TPU-shaped run trains
on CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

PLATFORMS = ("cpu", "gpu", "tpu")

_faked: list[str] = []


def real_platform(mesh=None) -> str:
    """The platform of `mesh`'s devices (else JAX's default backend), CUDA and ROCm as "gpu"; TPU
    devices of a compile-only topology count as "tpu"."""
    name = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def platform_of(mesh=None) -> str:
    """The platform implementation choices are made for: the faked one inside `faked_platform`,
    else `real_platform(mesh)`."""
    return _faked[-1] if _faked else real_platform(mesh)


def interpret_kernels(mesh=None) -> bool:
    """Whether a Pallas kernel must run in interpret mode here: its devices are CPUs."""
    return real_platform(mesh) == "cpu"


@contextlib.contextmanager
def faked_platform(name: str) -> Iterator[None]:
    """Choose implementations as on `name` ("gpu", "tpu" or "cpu") while inside; for tests on CPU
    (the kernels chosen then run interpreted). JAX's trace caches are cleared on the way in and out:
    a program traced for one platform is never reused for another."""
    if name not in PLATFORMS:
        raise ValueError(f"faked_platform: {name!r} is not one of {PLATFORMS}")
    jax.clear_caches()
    _faked.append(name)
    try:
        yield
    finally:
        _faked.pop()
        jax.clear_caches()
