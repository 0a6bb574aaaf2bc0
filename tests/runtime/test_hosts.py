"""grpo_jax.runtime.hosts (per-host rows on a mesh) and grpo_jax.runtime.storage (remote run directories) in one
process; the two-process run is in tests/trainer/test_multihost.py."""

from __future__ import annotations

import fsspec
import jax
import numpy as np
import pytest

from grpo_jax.config import ConfigError, MeshConfig
from grpo_jax.runtime.hosts import (RowShare, any_host, gather_json, gather_rows, local_rows, replicated_key, row_share,
                            sum_over_shares, to_global, whole)
from grpo_jax.runtime.sharding import make_mesh
from grpo_jax.runtime.storage import RunDirectory


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 2, 1, 2), (1, 1, 1, 8), (1, 2, 4, 1)])
def test_one_process_owns_every_row_and_rows_round_trip(shape):
    data, fsdp, expert, tensor = shape
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, expert=expert, tensor=tensor))
    share = row_share(mesh, 16)
    assert share == whole(16) and (share.index, share.count) == (0, 1)
    rows = {"ids": np.arange(16 * 3).reshape(16, 3), "per_group": np.arange(8) * 10.0}  # 2 rows per group
    placed = to_global(rows, mesh, share)
    assert placed["ids"].sharding.spec[0] == ("data", "fsdp", "expert") and placed["per_group"].shape == (8,)
    np.testing.assert_array_equal(np.asarray(placed["ids"]), rows["ids"])
    np.testing.assert_array_equal(local_rows(placed, share)["ids"], rows["ids"])


def test_a_share_scales_to_its_samples_and_rejects_a_misfit():
    share = RowShare(8, 16, 32)
    assert (share.size, share.index, share.count) == (8, 1, 4)
    assert share.scaled(4) == RowShare(32, 64, 128)
    mesh = make_mesh(MeshConfig(data=8))
    with pytest.raises(ValueError, match="block has 16 rows"):
        to_global(np.zeros(5), mesh, whole(16))


def as_process_zero_of_many(monkeypatch, others):
    """Pretend this is process 0 of several: the k-th allgather stacks this host's value with the
    other hosts' values `others[k]`."""
    from grpo_jax.runtime import hosts

    calls = iter(others)
    monkeypatch.setattr(hosts, "multi_process", lambda: True)
    monkeypatch.setattr(hosts.multihost_utils, "process_allgather",
                        lambda x: np.stack([np.asarray(x), *map(np.asarray, next(calls))]))


def test_rows_of_every_host_are_put_together_by_their_start(monkeypatch):
    share = RowShare(4, 8, 12)  # this host holds rows 4..8; the others 8..12 and 0..4
    mine = np.arange(4, 8)
    as_process_zero_of_many(monkeypatch, [[np.arange(8, 12), np.arange(0, 4)], [8, 0]])
    np.testing.assert_array_equal(gather_rows(mine, share), np.arange(12))


def test_counts_are_summed_once_per_share(monkeypatch):
    # Three hosts: the second holds the same block as this one (a tensor axis across hosts).
    as_process_zero_of_many(monkeypatch, [[[0, 1.0, 10.0], [4, 2.0, 20.0]]])
    assert sum_over_shares({"b": 10, "a": 1}, RowShare(0, 4, 8)) == {"a": 3.0, "b": 30.0}


def test_a_decision_is_true_on_every_host_if_any_host_says_so(monkeypatch):
    as_process_zero_of_many(monkeypatch, [[1], [0]])
    assert any_host(False) is True  # another host is short
    assert any_host(False) is False


def test_json_of_every_host_in_process_order(monkeypatch):
    import json

    other = np.frombuffer(json.dumps({"position": 12345}).encode(), np.uint8)
    mine = {"x": [1]}
    n = max(other.size, len(json.dumps(mine)))
    padded = np.zeros(n, np.uint8)
    padded[:other.size] = other
    as_process_zero_of_many(monkeypatch, [[other.size], [other.size], [padded]])
    assert gather_json(mine) == [{"x": [1]}, {"position": 12345}]


def test_a_replicated_key_draws_what_the_key_draws():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    key = replicated_key(jax.random.key(7), mesh)
    assert key.sharding.is_fully_replicated
    assert jax.random.uniform(key) == jax.random.uniform(jax.random.key(7))


def test_a_remote_run_directory_stages_files_and_uploads_what_changed(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_JAX_STAGING", str(tmp_path))
    run = RunDirectory("memory://bucket/runs/a")
    assert run.remote and run.checkpoints == "memory://bucket/runs/a/checkpoints"
    assert run.local.parent == tmp_path
    run.local.mkdir(parents=True)
    (run.local / "metrics.jsonl").write_text('{"step": 1}\n')
    (run.local / "model").mkdir()
    (run.local / "model" / "config.json").write_text("{}")
    assert run.sync() == ["metrics.jsonl", "model/config.json"]
    fs = fsspec.filesystem("memory")
    assert fs.cat("/bucket/runs/a/metrics.jsonl") == b'{"step": 1}\n'
    with open(run.local / "metrics.jsonl", "a") as f:  # appended in place: uploaded again, alone
        f.write('{"step": 2}\n')
    assert run.sync() == ["metrics.jsonl"]
    assert fs.cat("/bucket/runs/a/metrics.jsonl").count(b"step") == 2
    assert run.sync() == []


def test_a_local_run_directory_is_the_path_itself(tmp_path):
    run = RunDirectory(tmp_path / "run")
    assert not run.remote and run.local == tmp_path / "run" and run.checkpoints == tmp_path / "run" / "checkpoints"
    assert run.sync() == []


def test_an_unknown_storage_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="run directory 'nosuch://x'"):
        RunDirectory("nosuch://x")


def test_a_model_name_url_is_not_remote_storage():
    from grpo_jax.runtime.storage import is_remote

    assert is_remote("gs://bucket/run") and is_remote("s3://b/x")
    # gguf://NAME names a model (grpo_jax.models.gguf), resolved to a local file: not a place to sync.
    assert not is_remote("gguf://smollm2-135m-instruct") and not is_remote("/tmp/run") and not is_remote("model.gguf")
