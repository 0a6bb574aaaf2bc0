"""A LoRA run's frozen base: where its weights live, and the fingerprint its checkpoints carry.

Checkpoints of a LoRA run hold only the adapters (and their optimizer state). The base they
adapt is either the run's `model.path` as it is (an HF directory, a `.gguf` file or a remote
copy: its HF files are the base), or, when the run changed it before the adapters came (a warm
start, `sft.steps`) or made it up (a random `model.architecture`), an HF directory the run writes
once into `RUN_DIR/base/`. Each checkpoint's metadata records `{"path", "fingerprint"}`: the
SHA-256 of the base's config.json and safetensors files. A resumed run, `grpo-jax eval` and
`grpo-jax export` load the base from there and refuse one whose fingerprint differs (another
model, or a file changed since), naming both.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import jax
from flax import nnx
from jax.experimental import multihost_utils

from grpo_jax.config import ConfigError, RunConfig
from grpo_jax.models import save_pretrained
from grpo_jax.runtime.sharding import place_model
from grpo_jax.models.build import build_model
from grpo_jax.models.gguf import fingerprint as file_sha256
from grpo_jax.models.hf import model_dir

BASE_DIR = "base"  # inside the run directory, for a base the run made


def hf_fingerprint(directory: str | Path) -> str:
    """SHA-256 over an HF directory's config.json and weight files (names and contents)."""
    directory = Path(directory)
    files = sorted([directory / "config.json", *directory.glob("*.safetensors")])
    if not files[1:]:
        raise FileNotFoundError(f"{directory} holds no safetensors weights")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()


def base_is_written(config: RunConfig) -> bool:
    """Whether a LoRA run's base exists only in the run (random init or a warm start): it is then
    written to RUN_DIR/base; else it is `model.path`."""
    return config.model.path is None or config.sft.steps > 0


def record(config: RunConfig, run_dir: Path) -> dict:
    """The `base` entry of a LoRA run's checkpoint metadata ({"path", "fingerprint"}), once the
    base is on disk (written to RUN_DIR/base by the caller when `base_is_written`)."""
    if base_is_written(config):
        return {"path": BASE_DIR, "fingerprint": hf_fingerprint(Path(run_dir) / BASE_DIR)}
    directory = model_dir(config.model.path)  # a .gguf file's converted directory, a remote copy
    return {"path": str(config.model.path), "fingerprint": hf_fingerprint(directory)}


def locate(saved: dict, run_dir: Path) -> Path:
    """The HF directory of the base a checkpoint's `base` entry names, checked against its
    fingerprint (a ConfigError when it differs or is missing)."""
    if saved["path"] == BASE_DIR:
        directory = Path(run_dir) / BASE_DIR
        if not (directory / "config.json").is_file():
            raise ConfigError(f"the LoRA checkpoints in {run_dir} adapt the base in {directory}, which is missing; "
                              "restore that directory or start a new run")
    else:
        directory = model_dir(saved["path"])
    got = hf_fingerprint(directory)
    if got != saved["fingerprint"]:
        raise ConfigError(f"the LoRA checkpoints in {run_dir} adapt a base with fingerprint "
                          f"{saved['fingerprint'][:16]}..., but {saved['path']} now has {got[:16]}...: the base "
                          "model changed since; use the base they were trained on")
    return directory


def settle(config: RunConfig, model, *, mesh, run_dir: Path, saved: dict | None) -> dict:
    """A LoRA run's base, before its adapters are added -> the `base` record each checkpoint's
    metadata carries. A resumed run (`saved`: the checkpoint's record, its fingerprint already
    checked) loads a base that exists only in the run from RUN_DIR/base into `model`; a fresh run
    writes such a base (random init, warm start) there once (process 0; every host waits)."""
    if saved is not None:
        if saved["path"] == BASE_DIR:
            base = build_model(dataclasses.replace(config.model, path=str(Path(run_dir) / BASE_DIR), architecture=None),
                               None, config.train.seed, mesh)
            nnx.update(model, nnx.state(base, nnx.Param))
            place_model(model, mesh)
    elif base_is_written(config):
        if jax.process_index() == 0:
            save_pretrained(model, Path(run_dir) / BASE_DIR)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("grpo_jax_lora_base_written")
    return record(config, run_dir)
