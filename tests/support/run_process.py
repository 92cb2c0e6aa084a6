"""One ``rollpoint run`` as a child process the test can watch and SIGKILL.

Owns starting the command in its own session (so one ``killpg`` takes down the run and
every server it started), collecting its stderr as it comes, waiting for a condition while
the run is alive (noting its server processes on the way), and the kill itself, reporting
which processes outlived it. It does not judge the run's outputs (see
``tests/chaos/invariants``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import descendants_of, group_members, wait_gone

POLL_S = 0.01
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# Without a terminal rich wraps at 80 columns, which would split the messages we match.
RICH_ENV = {"NO_COLOR": "1", "COLUMNS": "240"}
SERVERS_EVERY_S = 0.2


@dataclass(frozen=True)
class Finished:
    returncode: int
    stderr: str
    started_at: float
    """Unix time the command was started."""


class RunProcess:
    """``python -m rollpoint run CONFIG`` started now, in a new session."""

    def __init__(
        self, config: Path, *args: str, launcher: tuple[str, ...] = ("-m", "rollpoint")
    ) -> None:
        """``launcher``: what runs the CLI (``-m rollpoint``; a test wrapper that injects
        faults first, e.g. ``tests/support/full_disk.py``)."""
        self.started_at = time.time()
        self._chunks: list[bytes] = []
        self._servers: set[int] = set()
        self._servers_seen_at = 0.0
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, "run", str(config), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **RICH_ENV},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        while chunk := os.read(fd, 65536):
            with self._lock:
                self._chunks.append(chunk)

    @property
    def stderr(self) -> str:
        """What it printed so far, escape codes removed."""
        with self._lock:
            raw = b"".join(self._chunks)
        return _ANSI.sub("", raw.decode(errors="replace"))

    def wait_until(
        self,
        condition: Callable[[], bool],
        what: str,
        *,
        timeout_s: float = 60,
        poll_s: float = POLL_S,
    ) -> None:
        """Poll ``condition`` while the run is alive; fail naming ``what`` if it exits first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            self._note_servers()
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                raise AssertionError(
                    f"run exited ({self.proc.returncode}) before {what}:\n{self.stderr[-3000:]}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {what} within {timeout_s}s:\n{self.stderr[-3000:]}")
            time.sleep(poll_s)

    def _note_servers(self) -> None:
        """Remember what runs below the run now and then (its servers, and the zygote they
        were forked from): once it is killed they are orphans nobody can list by parent,
        and one that left the process group would escape."""
        now = time.monotonic()
        if now - self._servers_seen_at >= SERVERS_EVERY_S:
            self._servers.update(descendants_of(self.proc.pid))
            self._servers_seen_at = now

    def kill(self) -> list[int]:
        """SIGKILL the whole process group at once (no scan first: the moment matters);
        return the pids of its servers and group still alive a moment later."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        suspects = self._servers | set(group_members(self.proc.pid))
        return wait_gone(sorted(suspects), timeout_s=5)

    def finish(self, timeout_s: float = 90) -> Finished:
        """Wait for the run to exit on its own (killing it on timeout)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"run did not finish in {timeout_s}s:\n{self.stderr[-3000:]}"
            ) from None
        self._reader.join(timeout=5)
        return Finished(self.proc.returncode, self.stderr, self.started_at)
