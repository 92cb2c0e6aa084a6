"""One writer per workdir: the lock file, its refusal, and what a kill leaves behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpoint.protocol.errors import WorkdirBusyError
from rollpoint.store.workdir_lock import LOCK_NAME, lock_workdir, release_workdir

HOLD = """
import sys, time
from pathlib import Path
from rollpoint.store.workdir_lock import lock_workdir
lock_workdir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``tmp_path/run``'s lock."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_second_process_is_refused_naming_the_holder(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    with pytest.raises(WorkdirBusyError, match=rf"in use by process {holder.pid}\b"):
        lock_workdir(tmp_path / "run")


def test_a_sigkilled_holder_leaves_no_stale_lock(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock_workdir(tmp_path / "run")
    try:
        assert (tmp_path / "run" / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    finally:
        release_workdir(tmp_path / "run")


def test_the_lock_is_reentrant_within_a_process(tmp_path: Path) -> None:
    first = lock_workdir(tmp_path / "run")
    try:
        assert lock_workdir(tmp_path / "run") is first
    finally:
        release_workdir(tmp_path / "run")
    # Released: another process may take it now.
    probe = subprocess.run(
        [sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert probe.returncode == 0 and "locked" in probe.stdout, probe.stderr
