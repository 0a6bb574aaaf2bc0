"""What goes wrong with a run's checkpoints on storage, said in one line (grpo_jax.faults).

- A save that fails (a full disk, a quota, storage that refuses or times out): orbax writes in a
  background thread, so its error surfaces later, on its own, as a long traceback at the next save
  or at exit. `Checkpointer` (grpo_jax.trainer.checkpoint) asks after the save in flight at every
  step and before the next save, and raises `CheckpointError`: the step, the directory and the
  cause (`storage_fault`), in one line. orbax deletes older steps only after a save succeeded, so
  the newest complete checkpoint stays and the run resumes from it; the failed step's temporary
  directory is removed at the next start (orbax's `cleanup_tmp_directories`), not at once: writes
  of that save may still be running.
- orbax's own reports of that failure (ERROR logs with tracebacks from its threads, and unraisable
  "Event loop is closed" errors from its writes still in flight when the failed save's event loop
  closed) say the same fault again: `Quiet` keeps exactly those off stderr.
- A step directory without orbax's step metadata (`STEP_METADATA`, written before a step's
  directory gets its final name, so only a deletion leaves one without it: a kill while orbax
  removed an old step) is not a checkpoint: `remove_incomplete` removes it when a run opens its
  checkpoints, with one notice there, so no later start warns about it again.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import re
import sys

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from grpo_jax.faults import RunFault, one_line
from grpo_jax.runtime.hosts import multi_process

STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's step metadata file
TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX  # "<step>.orbax-checkpoint-tmp": a save not finalized

# A storage error as tensorstore and XLA word it: an absl status code first, and for a file system
# error the errno (`[os_error_code='28']`).
_STATUS = re.compile(r"^(RESOURCE_EXHAUSTED|PERMISSION_DENIED|UNAVAILABLE|DEADLINE_EXCEEDED|NOT_FOUND|DATA_LOSS|"
                     r"ABORTED|FAILED_PRECONDITION|INTERNAL|UNKNOWN)\b")
_OS_CODE = re.compile(r"os_error_code='?(\d+)")


class CheckpointError(RunFault):
    """The save of `step` failed; the run stops. `newest`: the newest complete step (None: none)."""

    def __init__(self, step: int, directory, cause: str, newest: int | None):
        self.step, self.directory, self.cause, self.newest = step, str(directory), cause, newest
        then = (f"the newest complete checkpoint is step {newest}: run the same command again to resume from it"
                if newest is not None else "no checkpoint is complete yet: run the same command again to start afresh")
        super().__init__(f"checkpoint of step {step} failed in {directory}: {cause}; the run stopped and {then} "
                         "once the storage is fixed")


def short_error(e: BaseException) -> str:
    """One line naming an exception: its type and the start of its message."""
    return f"{type(e).__name__}: {one_line(e, limit=200)}"


def storage_fault(e: BaseException | None) -> str | None:
    """The cause in a few words if `e` (or an exception it was raised from) is a storage error: an
    OSError, or tensorstore's or XLA's status error; None for anything else (a bug keeps its
    traceback). An errno is named: "No space left on device (ENOSPC)"."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        found = _OS_CODE.search(str(e))
        code = code or (int(found[1]) if found else None)
        if code:
            return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
        if isinstance(e, OSError) or _STATUS.search(str(e)):
            return short_error(e)
        e = e.__cause__ or e.__context__
    return None


def remove_incomplete(directory) -> list[int]:
    """Remove the step directories without STEP_METADATA (process 0; every host waits for it):
    their steps, oldest first."""
    root, steps = epath.Path(str(directory)), []
    if jax.process_index() == 0 and root.exists():
        steps = sorted(int(p.name) for p in root.iterdir()
                       if p.name.isdigit() and p.is_dir() and not (p / STEP_METADATA).exists())
        for step in steps:
            (root / str(step)).rmtree()
    if multi_process():
        multihost_utils.sync_global_devices("grpo_jax_remove_incomplete")
    return steps


_NOISY = ("absl", "asyncio")  # orbax logs through absl; asyncio reports its failed writes' tasks


def _orbax_noise(record: logging.LogRecord) -> bool:
    """An ERROR log of a storage fault, with its traceback, by orbax or about an orbax task ("Task
    exception was never retrieved"): a CheckpointError says it."""
    exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
    return (record.levelno >= logging.ERROR and exc is not None and storage_fault(exc) is not None
            and ("orbax" in record.pathname or "orbax" in record.getMessage()))


class Quiet:
    """While installed, orbax's own reports of a failed save stay off stderr: the ERROR logs of a
    storage fault by orbax or about its tasks (`_orbax_noise`), the unraisable "Event loop is closed" RuntimeErrors (no object)
    of its writes that outlive a failed save's event loop, and, once `failed`, the errors of those
    writes' coroutines finalized at exit. Everything else passes."""

    def __init__(self):
        self.failed = False
        self._previous = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        for name in _NOISY:
            logging.getLogger(name).addFilter(self._record)

    def _record(self, record: logging.LogRecord) -> bool:
        return not _orbax_noise(record)

    def _unraisable(self, unraisable) -> None:
        exc, coroutine = unraisable.exc_value, unraisable.object
        if coroutine is None and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        if self.failed and inspect.iscoroutine(coroutine) and "orbax" in coroutine.cr_code.co_filename:
            return
        self._previous(unraisable)

    def remove(self) -> None:
        """Uninstall, unless a save failed: its writes still in flight may report until exit."""
        if self.failed:
            return
        for name in _NOISY:
            logging.getLogger(name).removeFilter(self._record)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous
