"""`RunLock`, one run per run directory: a live holder refuses a second start with one line naming it,
a gone holder (dead process on this host, or a lapsed lease on another) is taken over, the holder
renews its lease while it runs, and gives the lock back; the same on remote storage (fsspec memory://).
The trainer's use of it (a refused start leaves the run intact) is in tests/trainer/test_loop.py."""

from __future__ import annotations

import json
import time

import fsspec
import pytest

from grpo_jax.observe.writers import MetricsWriter, read_metrics
from grpo_jax.runtime.run_lock import RunDirectoryBusy, RunLock


def holder(host="pod-worker-3", pid=4242, age_s=0.0) -> str:
    t = time.time() - age_s
    return json.dumps({"pid": pid, "host": host, "token": "theirs", "renewed": t, "started": t})


@pytest.mark.parametrize("remote", [False, True])
def test_a_live_holder_refuses_a_gone_one_is_taken_over_and_the_lease_is_renewed(tmp_path, remote):
    target = f"memory://bucket/run-{tmp_path.name}" if remote else str(tmp_path / "run")
    fs, root = fsspec.core.url_to_fs(target)
    fs.makedirs(root, exist_ok=True)
    lock_path = f"{root}/run.lock"
    notes = []
    fs.pipe_file(lock_path, holder(age_s=5).encode())  # another host's run, its lease fresh
    with pytest.raises(RunDirectoryBusy, match=r"is in use by a live run \(process 4242 on host pod-worker-3, "
                                               r"started \d{4}-\d\d-\d\d"):
        RunLock(target, log=notes.append, lease_s=60, settle_s=0).acquire()
    assert json.loads(fs.cat_file(lock_path))["token"] == "theirs" and notes == []
    fs.pipe_file(lock_path, holder(age_s=120).encode())  # its lease lapsed: the run is gone
    lock = RunLock(target, log=notes.append, lease_s=0.4, settle_s=0).acquire()
    assert notes and "taking over the lock of a run that is gone (process 4242 on host pod-worker-3" in notes[0]
    first = json.loads(fs.cat_file(lock_path))
    assert first["token"] == lock.token
    time.sleep(0.35)  # renewed every lease / 4
    assert json.loads(fs.cat_file(lock_path))["renewed"] > first["renewed"]
    with pytest.raises(RunDirectoryBusy):  # held by a live run: a second start (a fresh lease) is refused
        other = RunLock(target, log=notes.append, lease_s=0.4, settle_s=0)
        other._alive = lambda h: time.time() - h["renewed"] < 0.4  # as another process would see it
        other.acquire()
    lock.release()
    assert not fs.exists(lock_path)
    with RunLock(target, log=notes.append, settle_s=0) as again:  # free again
        assert again.held and json.loads(fs.cat_file(lock_path))["token"] == again.token
    assert not fs.exists(lock_path) and len(notes) == 1


def test_a_dead_process_on_this_host_is_gone_and_an_unreadable_lock_is_taken_over(tmp_path):
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(holder(host=socket.gethostname(), pid=dead.pid))
    notes = []
    with RunLock(tmp_path, log=notes.append):
        assert f"(process {dead.pid} on host {socket.gethostname()}" in notes[-1]
    (tmp_path / "run.lock").write_text("{half a reco")
    with RunLock(tmp_path, log=notes.append):
        assert "unreadable lock" in notes[-1]


def test_a_run_starting_over_drops_the_logs_of_an_attempt_without_a_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(0, {"eval/accuracy": 0.1})
        w.write(1, {"reward/mean": 0.2})
        w.write_samples(1, [{"completion": "x"}])
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        assert w.start_over() == 2
        w.write(0, {"eval/accuracy": 0.1})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
    assert (tmp_path / "samples.jsonl").read_text() == ""
