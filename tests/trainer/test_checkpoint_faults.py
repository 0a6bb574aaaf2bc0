"""Faults a long run's checkpoints meet: a save the full disk refuses stops the run with one line
naming the step, the directory and the cause, keeps the previous checkpoint (it restores) and the
rerun resumes from it; a step directory an interrupted deletion left without metadata is removed at
the next start with one notice, and no later start says anything about it."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time

import orbax.checkpoint as ocp
import pytest
from runs import CONFIG, write_config
from test_checkpoint import leaves, state_of

from grpo_jax import cli
from grpo_jax.data import IndexSampler
from grpo_jax.observe.writers import read_metrics
from grpo_jax.trainer.checkpoint import Checkpointer, save_step
from grpo_jax.trainer.run_state import CheckpointMeta
from grpo_jax.trainer.checkpoint_faults import STEP_METADATA, TMP_SUFFIX, CheckpointError
from grpo_jax.trainer.resume import resume

FULL = "No space left on device (ENOSPC)"


class _DiskFull:
    """The last of a save's commit futures, failing as a write to a full disk does, in orbax's
    background thread (orbax waits for the others first: none is left writing)."""

    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def cancel(self):
        return None


def disk_full(monkeypatch, *, call: int = 1) -> None:
    """The disk is full for the `call`-th save: it fails after `save` returned, as on a real disk."""
    original, calls = ocp.handlers.CompositeCheckpointHandler.async_save, []

    async def async_save(self, directory, args):
        calls.append(directory)
        futures = await original(self, directory, args) or []
        return [*futures, _DiskFull()] if len(calls) == call else futures

    monkeypatch.setattr(ocp.handlers.CompositeCheckpointHandler, "async_save", async_save)


def disk_full_at_once(monkeypatch, checkpointer) -> None:
    """The disk is full before orbax writes anything: its `save` itself raises (a directory it cannot create)."""
    def save(step, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(checkpointer.directory / f"{step}{TMP_SUFFIX}"))

    monkeypatch.setattr(checkpointer._manager, "save", save)


def _entries(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _gone(path, timeout: float = 30.0) -> None:
    """Until `path` is gone: orbax removes temporary directories at a start, in a thread of its own."""
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("when", ["in the background", "while saving"])
def test_a_save_the_full_disk_refuses_is_one_line_naming_it_and_the_previous_checkpoint_restores(
        tmp_path, monkeypatch, caplog, when):
    directory, stream, saved = tmp_path / "checkpoints", IndexSampler(50, seed=3), state_of(0)
    checkpointer = Checkpointer(directory, keep=1)  # orbax deletes step 1 once a step 2 commits
    save_step(checkpointer, 1, saved, components={"data": stream}, seed=3)
    with monkeypatch.context() as patch, pytest.raises(CheckpointError) as failed:
        disk_full(patch) if when == "in the background" else disk_full_at_once(patch, checkpointer)
        save_step(checkpointer, 2, state_of(1), components={"data": stream}, seed=3)  # in the background: returns
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the loop's checkpoint hook asks at every step
            checkpointer.check()
            time.sleep(0.01)
    assert str(failed.value) == (f"checkpoint of step 2 failed in {directory}: {FULL}; the run stopped and the "
                                 "newest complete checkpoint is step 1: run the same command again to resume "
                                 "from it once the storage is fixed")
    checkpointer.close()  # nothing more to say
    # orbax's own reports of the same fault (its threads' tracebacks) are not shown again.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []

    with Checkpointer(directory) as checkpointer:
        assert checkpointer.all_steps() == [1]
        _gone(directory / f"2{TMP_SUFFIX}")  # step 2's partial directory, had a write outlived the failure
        assert _entries(directory) == ["1"]
        state, _ = resume(checkpointer, 1, state_of(2), stream=IndexSampler(50, seed=3))
    assert all((a == b).all() for a, b in zip(leaves(saved), leaves(state)))


def test_a_step_left_without_metadata_is_removed_at_the_next_start_with_one_notice_and_never_again(
        tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, state_of(0), CheckpointMeta(step=step, seed=0))
    # A kill while orbax deleted step 1 (its deleter removes files in any order, the metadata among
    # the first), and one while it saved step 4 (a temporary directory).
    (directory / "1" / STEP_METADATA).unlink()
    shutil.rmtree(directory / "1" / "params")
    shutil.copytree(directory / "3", directory / f"4{TMP_SUFFIX}")

    notices: list[str] = []
    caplog.clear()
    with Checkpointer(directory, log=notices.append) as checkpointer:
        assert checkpointer.all_steps() == [3, 2]
        _gone(directory / f"4{TMP_SUFFIX}")
    assert notices == [f"removed incomplete checkpoint directories [1] in {directory} (no {STEP_METADATA}: a "
                       "save or a deletion of them was interrupted)"]
    assert _entries(directory) == ["2", "3"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # orbax's "Metadata file does not exist"

    with Checkpointer(directory, log=notices.append) as checkpointer:  # a later start: nothing to say
        assert checkpointer.all_steps() == [3, 2]
    assert len(notices) == 1 and [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_train_stops_at_the_save_the_full_disk_refuses_in_one_line_and_the_rerun_resumes(tmp_path, monkeypatch,
                                                                                         capsys):
    config = {**CONFIG, "data": {**CONFIG["data"], "data_dir": str(tmp_path / "tfds")}, "sft": {"steps": 0},
              "train": {**CONFIG["train"], "steps": 3, "samples_every": 0},
              "eval": {"every": 0, "num_prompts": 8, "k": 2}, "checkpoint": {"every": 1, "keep": 1}}
    out = tmp_path / "run"
    args = ["train", "--config", write_config(tmp_path, config), "--output", str(out)]
    with monkeypatch.context() as patch:
        disk_full(patch, call=2)
        assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"grpo-jax train: error: checkpoint of step 2 failed in {out / 'checkpoints'}: "
                                    f"{FULL}; the run stopped and the newest complete checkpoint is step 1: run the "
                                    "same command again to resume from it once the storage is fixed")
    assert err.count(FULL) == 1
    # Step 1 kept (keep: 1); step 2's temporary directory waits for the next start.
    assert _entries(out / "checkpoints") == ["1", f"2{TMP_SUFFIX}"] and not (out / "run.lock").exists()

    assert cli.main(args) == 0  # the same command, the disk fixed: nothing was lost
    assert "resumed from the checkpoint of step 1" in capsys.readouterr().err
    assert _entries(out / "checkpoints") == ["3"]
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]


def test_a_run_faults_message_is_one_line_whatever_it_carries():
    """A user's error text inside a stop reason (a reward's traceback, an environment's message) or a
    storage error's: the CLI prints str(fault) as its one line."""
    from grpo_jax.faults import RunFault
    from grpo_jax.trainer.preemption import RunFailed

    assert str(RunFailed("every episode of step 3 failed; the first: ValueError: a\nb\r\nc")) == (
        "every episode of step 3 failed; the first: ValueError: a b c")
    assert "\n" not in str(CheckpointError(4, "/runs/x", "OSError: disk\nfull", None))
    long = str(RunFault("x" * 5000))
    assert len(long) < 2100 and long.endswith("[... 3000 more characters]")
