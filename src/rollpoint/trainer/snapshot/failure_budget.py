"""The failure budget: when failed snapshots in a row stop the run.

Owns the count of snapshots failed in a row (a published one clears it), the rule that
stops the run (:data:`MAX_FAILED_IN_A_ROW` failures in a row that also span
``snapshot.retry_after_seconds``), and the one line the stop says (:func:`stop_message`):
for a store that is full or cannot be written, what to free (:func:`storage_fault`), else
the last blockers, each cut short.

It does not take, retry or log saves (every save is still tried:
:class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator` does), nor say why one
failed (:class:`~rollpoint.trainer.snapshot.cut.SaveReport`).
"""

from __future__ import annotations

import errno
import os
import time

from rollpoint.protocol.errors import SnapshotError

__all__ = ["MAX_FAILED_IN_A_ROW", "FailureBudget", "stop_message", "storage_fault"]

MAX_FAILED_IN_A_ROW = 3


class FailureBudget:
    """The snapshots of one coordinator that failed in a row, and whether they stop the run."""

    def __init__(self) -> None:
        self._failures: list[str] = []
        self._failing_since = 0.0

    def published(self) -> None:
        """A snapshot was published: the run is no longer failing."""
        self._failures.clear()

    def failed(self, failure: str) -> int:
        """Count one failed snapshot (``failure``: its id and what blocked it); returns how
        many failed in a row."""
        if not self._failures:
            self._failing_since = time.monotonic()
        self._failures.append(failure)
        return len(self._failures)

    def check(self, retry_after_s: float, root: str) -> None:
        """Raise :class:`SnapshotError` (the :func:`stop_message` for the store at ``root``)
        once the budget is spent."""
        # Back-to-back saves (train checkpoints) fail within milliseconds of one
        # another while a replica dies or a link is down: the budget is spent only
        # by failures that also span retry_after_seconds. Every save is still tried,
        # so the first one after the fault commits.
        failing_for = time.monotonic() - self._failing_since
        if len(self._failures) >= MAX_FAILED_IN_A_ROW and failing_for >= retry_after_s:
            raise SnapshotError(stop_message(self._failures, failing_for, root))


_STORAGE_FAULTS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EIO: "an I/O error",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
_FAILURE_CHARS = 240
"""Each blocker named in the stop message is cut to this: the message stays one line."""


def storage_fault(failure: str) -> str | None:
    """What a failed save's blocker says about the store's disk, if it was one of the write
    faults an operator fixes by freeing space or fixing permissions (from the OS's words:
    a participant reports its failed write over the wire as text)."""
    for code, meaning in _STORAGE_FAULTS.items():
        if os.strerror(code) in failure:
            return meaning
    return None


def stop_message(failures: list[str], failing_for: float, root: str) -> str:
    """One line: how many failed, and what to do; for a full or unwritable store, what to
    free, else the last blockers, each cut short."""
    count = len(failures)
    last = failures[-MAX_FAILED_IN_A_ROW:]
    faults = [storage_fault(f) for f in last]
    head = (
        f"{count} snapshots failed in a row; stopping the run after {failing_for:.1f}s of failures"
    )
    if all(faults):
        return (
            f"{head}: the snapshot store {root} cannot be written ({faults[-1]}); free space "
            "there (older snapshots of other runs, or a lower snapshot.keep) or fix its "
            "permissions, then rerun: the run resumes from its last snapshot"
        )
    shown = [f if len(f) <= _FAILURE_CHARS else f[: _FAILURE_CHARS - 1] + "…" for f in last]
    return f"{head}: " + "; ".join(" ".join(f.split()) for f in shown)
