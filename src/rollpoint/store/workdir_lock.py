"""One writer per workdir: an OS file lock held for the life of the process.

Owns ``<workdir>/.rollpoint.lock``. :func:`lock_workdir` takes an exclusive ``flock`` on it
before anything else in the workdir is read or written, and keeps it until the process
exits: the kernel drops the lock when the last descriptor closes, so a process killed by
SIGKILL leaves no stale lock and the next run needs no cleanup. A second process asking for
the same workdir is refused at once with :class:`~rollpoint.protocol.errors.WorkdirBusyError`
naming the holder's pid (written into the lock file by the holder), before it touches
anything. Within one process the lock is re-entrant: a job that runs twice in the same
process (tests, chaos trials) takes it once.

The descriptor is close-on-exec (the default of :func:`os.open`), and server processes are
started with exec, so no child inherits the lock and outlives its parent holding it.

What it does not cover: ``flock`` is per host on most network filesystems. On NFSv4 and
Lustre (mounted with ``flock``) the Linux client maps it to a server-side lock and it holds
across hosts; on older NFS, CIFS without byte-range locks, or a FUSE mount without lock
support it may be local to one host, or refused (then the run stops with a one-line error
saying so rather than run unguarded). It does not lock the snapshot store when that is
elsewhere (an object store): the workdir is the job's identity.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rollpoint.protocol.errors import ConfigError, WorkdirBusyError

LOCK_NAME = ".rollpoint.lock"


@dataclass(frozen=True)
class WorkdirLock:
    """A held lock: its file and descriptor (closing the descriptor releases it)."""

    workdir: Path
    path: Path
    fd: int


_held: dict[Path, WorkdirLock] = {}
_guard = threading.Lock()


def lock_workdir(workdir: Path) -> WorkdirLock:
    """Lock ``workdir`` for this process (creating it if needed), or refuse naming the holder."""
    key = workdir.resolve()
    with _guard:
        held = _held.get(key)
        if held is not None:
            return held
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            path = workdir / LOCK_NAME
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            # The lock file is the first thing a run writes: the same words as the
            # start check's (rollpoint.app.start_checks) for a workdir that cannot be written.
            raise ConfigError(
                f"workdir {workdir} is not writable: {exc.strerror} (creating {LOCK_NAME})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirBusyError(
                    f"workdir {workdir} is in use by {holder} (lock {path}); "
                    "wait for it to end or stop it, then run again"
                ) from None
            raise ConfigError(
                f"workdir {workdir}: cannot lock {path} ({exc.strerror}): the filesystem does "
                "not support flock; use a local or flock-capable workdir"
            ) from None
        # Who holds it, for the refusal of a second process: pid first, host for shared mounts.
        # Written over the old holder's line, then cut to length: a reader sees the old line
        # or the new one, never an empty file.
        line = f"{os.getpid()} {socket.gethostname()}\n".encode()
        os.pwrite(fd, line, 0)
        os.ftruncate(fd, len(line))
        lock = WorkdirLock(workdir=key, path=path, fd=fd)
        _held[key] = lock
        return lock


def release_workdir(workdir: Path) -> None:
    """Give the lock up before the process ends (tests; a normal exit needs no call)."""
    with _guard:
        lock = _held.pop(workdir.resolve(), None)
    if lock is not None:
        os.close(lock.fd)


HOLDER_WAIT_S = 1.0
"""How long a refused process waits for the holder to write its pid: the lock is taken
before the pid is written, so one that asks in between reads the last holder's line (a
process now dead) or nothing. Two reruns started together by a scheduler meet exactly this."""


def _holder(fd: int) -> str:
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            words = os.pread(fd, 256, 0).decode(errors="replace").split()
        except OSError:
            words = []
        here = len(words) < 2 or words[1] == socket.gethostname()
        if words and (not here or _alive(words[0])):
            return f"process {words[0]}" + ("" if here else f" on {words[1]}")
        if time.monotonic() >= deadline:
            return "another process"
        time.sleep(0.01)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
