"""The message that stops a run after three failed snapshots: one line, saying what to do."""

from __future__ import annotations

import errno
import os

from rollpoint.trainer.snapshot.failure_budget import stop_message, storage_fault

FULL = (
    "publish: trainer files: cannot write /runs/a/snapshots/staging/s1/ledger.json: "
    f"[Errno 28] {os.strerror(errno.ENOSPC)}: '/runs/a/snapshots/staging/s1/ledger.json'"
)


def test_a_full_store_says_what_to_free_in_one_short_line() -> None:
    failures = [f"snap-{i}: {FULL}" for i in range(3)]

    message = stop_message(failures, 1.4, "/runs/a/snapshots")

    assert message.startswith("3 snapshots failed in a row; stopping the run after 1.4s")
    assert "the snapshot store /runs/a/snapshots cannot be written (the disk is full)" in message
    assert "free space there" in message and "\n" not in message and len(message) < 400


def test_other_blockers_are_named_each_cut_short() -> None:
    long = "agent@replica-0 prepare: " + "x" * 5000 + "\nline two"
    failures = [f"snap-{i}: {long}" for i in range(4)]

    message = stop_message(failures, 2.0, "/s")

    assert message.startswith("4 snapshots failed in a row")
    assert message.count("agent@replica-0 prepare") == 3 and "\n" not in message
    assert len(message) < 1000


def test_storage_faults_are_read_from_the_os_words_over_the_wire() -> None:
    assert storage_fault(f"agent@replica-1 confirm: {os.strerror(errno.EIO)}") == "an I/O error"
    assert storage_fault(f"x: [Errno 13] {os.strerror(errno.EACCES)}") == "permission denied"
    assert storage_fault("agent@replica-0 prepare: not ready by the deadline") is None
