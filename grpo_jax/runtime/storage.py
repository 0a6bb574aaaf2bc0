"""Run directories on local disk or on remote storage (`gs://bucket/...`, or any fsspec URL).

A multi-host run needs a run directory every host can reach: each process writes its own shards
of a checkpoint. On a pod that is a bucket. Checkpoints go to `<url>/checkpoints` directly (orbax
writes gs:// itself, through tensorstore). The small files process 0 writes as it goes
(`metrics.jsonl`, `samples.jsonl`, TensorBoard events, `config.yaml`, `model/`, `metrics.png`)
are appended to in place, which object stores cannot do; they live in a local staging directory
and `RunDirectory.sync()` uploads the ones that changed (at every checkpoint and at the end of
the run). Remote URLs other than gs:// need their fsspec package (gs:// needs `gcsfs`, in the
`tpu` extra).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from grpo_jax.config import ConfigError


# URL schemes that name a model rather than a place on storage (grpo_jax.models.gguf: gguf://NAME).
MODEL_SCHEMES = ("gguf://",)


def is_remote(path: str | os.PathLike) -> bool:
    """A URL on remote storage (gs://bucket/run, ...); a model name such as gguf://NAME is not."""
    text = str(path)
    return "://" in text and not text.startswith(MODEL_SCHEMES)


def cache_dir(kind: str) -> Path:
    """This machine's cache for `kind` (gguf conversions, fetched models, remote model copies):
    $GRPO_JAX_CACHE/<kind>, else ~/.cache/grpo_jax/<kind>."""
    base = os.environ.get("GRPO_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "grpo_jax")
    return Path(base) / kind


def _local_name(url: str) -> str:
    """A directory name for remote `url`: its readable tail and a hash of the whole URL."""
    name = url.split("://", 1)[1].strip("/").replace("/", "_")[-80:]
    return f"{name}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"


def staging_root() -> Path:
    """Where remote runs stage their small files: $GRPO_JAX_STAGING, else the temp directory."""
    return Path(os.environ.get("GRPO_JAX_STAGING") or Path(tempfile.gettempdir()) / "grpo_jax_runs")


class RunDirectory:
    """A run's directory: `local` is where files are written, `checkpoints` where orbax saves.
    For a local path both are in the path itself and `sync` does nothing."""

    def __init__(self, target: str | os.PathLike):
        self.target = str(target)
        self.remote = is_remote(target)
        if self.remote:
            import fsspec

            try:
                self._fs, self._root = fsspec.core.url_to_fs(self.target.rstrip("/"))
            except (ImportError, ValueError) as e:
                raise ConfigError(f"run directory {self.target!r}: {e} (gs:// needs `pip install gcsfs`, "
                                  "in the tpu extra)") from None
            self.local = staging_root() / _local_name(self.target)
            self.checkpoints: str | Path = self.target.rstrip("/") + "/checkpoints"
        else:
            self.local = Path(target)
            self.checkpoints = self.local / "checkpoints"
        self._uploaded: dict[str, tuple[int, int]] = {}

    def sync(self) -> list[str]:
        """Upload the staged files that changed since the last sync (remote runs only); returns
        their paths relative to the run directory."""
        if not self.remote or not self.local.exists():
            return []
        sent = []
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            stat = path.stat()
            if self._uploaded.get(rel) == (stat.st_size, stat.st_mtime_ns):
                continue
            dest = f"{self._root}/{rel}"
            self._fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            self._fs.put_file(str(path), dest)
            self._uploaded[rel] = (stat.st_size, stat.st_mtime_ns)
            sent.append(rel)
        return sent

    def pull(self) -> list[str]:
        """Download the run's small files (not its checkpoints) into an empty staging directory: a
        resumed remote run on a fresh machine continues the same metrics.jsonl."""
        if not self.remote or (self.local / "metrics.jsonl").exists() or not self._fs.exists(self._root):
            return []
        got = []
        for remote in sorted(self._fs.find(self._root)):
            rel = remote[len(self._root):].lstrip("/")
            if rel == "checkpoints" or rel.startswith("checkpoints/"):
                continue
            dest = self.local / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self._fs.get_file(remote, str(dest))
            stat = dest.stat()
            self._uploaded[rel] = (stat.st_size, stat.st_mtime_ns)
            got.append(rel)
        return got

    def __str__(self) -> str:
        return self.target


def local_copy(url: str, cache: str | os.PathLike | None = None) -> Path:
    """A remote model (`gs://bucket/Qwen3-0.6B`: an HF directory, or one `.gguf` file) as a local
    path, downloaded once into `cache` (default $GRPO_JAX_CACHE/remote or ~/.cache/grpo_jax/remote)
    and kept: the next run reuses it unless a remote file's size changed. Directories are copied
    without their subdirectories (an HF model directory is flat). Every host of a pod downloads its
    own copy; they all read the same bucket."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    except (ImportError, ValueError) as e:
        raise ConfigError(f"model path {url!r}: {e} (gs:// needs `pip install gcsfs`, in the tpu extra)") from None
    if not fs.exists(root):
        raise FileNotFoundError(f"model path {url!r} does not exist")
    base = Path(cache) if cache is not None else cache_dir("remote")
    local = base / _local_name(url.rstrip("/"))
    if fs.isdir(root):
        entries = [e for e in fs.ls(root, detail=True) if e["type"] == "file"]
        target = local
    else:
        entries = [fs.info(root)]
        target = local / root.rsplit("/", 1)[-1]
    local.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        dest = local / entry["name"].rsplit("/", 1)[-1]
        if dest.exists() and dest.stat().st_size == entry["size"]:
            continue
        part = dest.with_name(f".{dest.name}.part")
        fs.get_file(entry["name"], str(part))
        part.rename(dest)  # a download cut short is never taken for the file
    return target
