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

import hashlib
from pathlib import Path

from grpo_jax.config import ConfigError, RunConfig
from grpo_jax.models.gguf import fingerprint as file_sha256

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
    from grpo_jax.models.hf import _model_dir

    directory = _model_dir(config.model.path)  # a .gguf file's converted directory, a remote copy
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
        from grpo_jax.models.hf import _model_dir

        directory = _model_dir(saved["path"])
    got = hf_fingerprint(directory)
    if got != saved["fingerprint"]:
        raise ConfigError(f"the LoRA checkpoints in {run_dir} adapt a base with fingerprint "
                          f"{saved['fingerprint'][:16]}..., but {saved['path']} now has {got[:16]}...: the base "
                          "model changed since; use the base they were trained on")
    return directory
