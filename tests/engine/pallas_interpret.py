"""Two test-time mends to JAX 0.10.2's TPU interpret mode (`pltpu.force_tpu_interpret_mode`), so JAX's
TPU kernel `ragged_paged_attention` runs on CPU and can be compared with our gather path. Both wrap
private `jax._src` functions; nothing in site-packages changes. Install them before the kernel is
first traced (jit caches the interpreted program); single-core interpret mode only.

1. The kernel loads keys/values through a reshaped (and, for bf16, bitcast) ref (kernel.py:616,
   364, 370). The interpreter's `get` callback (interpret_pallas_call.py:621) hands the transforms
   to `utils.to_range`, which reads `.indices` of each and fails on a reshape: "'ReshapeTransform'
   object has no attribute 'indices'". `mend_reshaped_loads` reads with the indexers before the
   first reshape/bitcast and applies the rest in NumPy.
2. `SharedMemory.swap_buffer_content` (shared_memory.py:910-913) builds its in-bounds mask with
   `mask[shape[i]:] = False` on axis 0 for every axis i, so the kernel's in-bounds masked store
   into `acc_ref.at[:, h:h+2, :]` (kernel.py:494) is refused as out of bounds.
   `mend_masked_stores` merges an in-bounds masked store in NumPy and stores it unmasked.

`interpret=True` (the generic interpreter) fails elsewhere (primitives.py:400, "'TypedInt' object has
no attribute 'shape'") and is not used. On CPU the kernel's block sizes must be given: the tuned
table asks for the TPU version.
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
from jax._src.pallas.mosaic.interpret import shared_memory as _shmem
from jax._src.pallas.mosaic.interpret import utils as _iutils
from jax._src.state import types as _state_types

_VIEWS = (_state_types.ReshapeTransform, _state_types.BitcastTransform)


def _bitcast(x: np.ndarray, dtype) -> np.ndarray:
    """jax._src.state.utils.bitcast in NumPy: a TPU ref bitcast packs along the second-minor axis."""
    dtype = np.dtype(dtype)
    xb, yb = x.dtype.itemsize, dtype.itemsize
    if xb == yb:
        return x.view(dtype)
    *lead, m, n = x.shape
    if xb < yb:
        r = yb // xb
        return np.ascontiguousarray(x.reshape(*lead, m // r, r, n).swapaxes(-1, -2)).view(dtype)[..., 0]
    r = xb // yb
    return np.ascontiguousarray(x).view(dtype).reshape(*lead, m, n, r).swapaxes(-1, -2).reshape(*lead, m * r, n)


def _apply(x: np.ndarray, transforms) -> np.ndarray:
    for t in transforms:
        if isinstance(t, _state_types.ReshapeTransform):
            x = x.reshape(t.shape)
        elif isinstance(t, _state_types.BitcastTransform):
            x = _bitcast(x, t.dtype)
        else:  # an NDIndexer
            x = x[_iutils.to_range((t,))]
    return x


def mend_reshaped_loads() -> None:
    if getattr(_ipc.get, "_mended", False):
        return
    original = _ipc.get

    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        ts = list(transforms) if isinstance(transforms, (tuple, list)) else None
        if ts is None or not any(isinstance(t, _VIEWS) for t in ts):
            return original(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs)
        k = next(i for i, t in enumerate(ts) if isinstance(t, _VIEWS))
        token, value = original(token, device_id, local_core_id, memory_space, buffer_id, tuple(ts[:k]),
                                *args, **kwargs)
        return token, np.ascontiguousarray(_apply(np.asarray(value), jax.tree.map(int, tuple(ts[k:]))))

    get._mended = True
    get.__wrapped__ = original.__wrapped__  # the DMA path calls the undecorated function (plain indexers)
    _ipc.get = get  # _interpret_jaxpr looks it up by name


def mend_masked_stores() -> None:
    cls = _shmem.SharedMemory
    if getattr(cls.swap_buffer_content, "_mended", False):
        return
    original = cls.swap_buffer_content

    def swap_buffer_content(self, key, rnge, value, mask, global_core_id, increment_clock=True, logging_info=None):
        old = None
        if mask is not None:
            with self.lock:
                buff = self.mem[key]
                if isinstance(buff, _shmem.Buffer) and not _iutils.is_range_out_of_bounds_for_shape(
                        buff._normalize_range(tuple(rnge)), buff.logical_shape):
                    old = buff[rnge].copy()
        if old is not None and old.shape == value.shape == mask.shape:
            _, sd, clock = original(self, key, rnge, np.where(mask, value, old), None, global_core_id,
                                    increment_clock, logging_info)
            return np.where(mask, old, value), sd, clock
        return original(self, key, rnge, value, mask, global_core_id, increment_clock, logging_info)

    swap_buffer_content._mended = True
    cls.swap_buffer_content = swap_buffer_content
