"""Reading safetensors checkpoints tensor by tensor: `TensorReader` over a directory's weight files
(one file, or the shards of `model.safetensors.index.json`) and `read_tensor`, which checks a
tensor's presence and shape and records it as used, so that loaders can refuse unused tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from grpo_jax.config import ConfigError


class TensorReader:
    """The tensors of a checkpoint directory (one `*.safetensors` file, or the shards that
    `model.safetensors.index.json` lists), read one at a time from memory maps. `location`: tensor
    name -> its file. Close it when done (`close`) to release the maps."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
            extra = f" (found {other}: convert them to safetensors with transformers' save_pretrained)" if other else ""
            raise FileNotFoundError(f"no *.safetensors weights in {path}{extra}")
        self.location: dict[str, str] = {}
        for f in files:
            fp = path / f
            if not fp.exists():
                raise FileNotFoundError(f"{index.name} lists {f}, which is missing from {path}")
            try:
                with safe_open(fp, framework="numpy") as h:
                    for k in h.keys():
                        self.location[k] = str(fp)
            except SafetensorError as e:
                raise ConfigError(f"{fp} ({fp.stat().st_size:,} bytes) cannot be read: {e}; a truncated or "
                                  "damaged download? fetch it again") from None
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape, without reading it."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as a NumPy array (its stored dtype and HF layout)."""
        return self._handle(name).get_tensor(name)

    def _handle(self, name: str):
        f = self.location[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="numpy")
        return self._handles[f]

    def close(self) -> None:
        # safe_open handles release their memory maps when dropped.
        self._handles.clear()


def read_tensor(reader: TensorReader, name: str, hf_shape: tuple[int, ...], used: set[str]) -> np.ndarray:
    """Tensor `name` of `reader`, which must exist with shape `hf_shape` (its HF layout; else a
    ValueError naming it), recorded in `used` (for the caller's check that every tensor was used)."""
    if name not in reader.location:
        raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {hf_shape})")
    found = reader.shape(name)
    if found != hf_shape:
        raise ValueError(f"tensor {name!r} has shape {found}, but config.json implies {hf_shape}")
    used.add(name)
    return reader.get(name)
