"""One writer per workdir: OS file locks held for the life of the process, kept honest.

Owns ``<workdir>/.rollpoint.lock`` and the lock on the workdir folder itself.
:func:`lock_workdir` takes an exclusive ``flock`` on the workdir folder, then on the lock
file, before anything else in the workdir is read or written, and keeps both until the
process exits: the kernel drops a lock when the last descriptor closes, so a process killed
by SIGKILL leaves no stale lock and the next run needs no cleanup. A second process asking
for the same workdir is refused at once with
:class:`~rollpoint.protocol.errors.WorkdirBusyError` naming the holder's pid (written into
the lock file by the holder), before it touches anything. Within one process the lock is
re-entrant: a job that runs twice in the same process (tests, chaos trials) takes it once.

**Why two locks, and the identity check** (issue 33): a lock on a file guards only as long
as the path still names that file. An operator deleting ``.rollpoint.lock`` to clear a
"stale lock" let a second run lock a new file at the same path and run beside the first
(rows trained twice). So the folder is locked too (deleting the lock file does not free
it: a second run is refused while the first lives), and the lock file's identity (inode
and device) is checked after taking it (a file swapped in between open and lock is taken
again) and then periodically by :func:`check_lock` (the job's
:mod:`~rollpoint.store.lock_watch`): a lock file deleted or replaced is taken again, with
one warning, and the pid written anew; when another process holds the new file (a second
run on a filesystem without folder locks), :func:`check_lock` raises and the run stops at
once with one line.

The descriptors are close-on-exec (the default of :func:`os.open`), and server processes
are started with exec, so no child inherits the lock and outlives its parent holding it.

**Network and object-store workdirs**: ``flock`` is per host on most network filesystems.
On NFSv4 and Lustre (mounted with ``flock``) the Linux client maps it to a server-side
byte-range lock, which holds across hosts for the lock file; a folder cannot be locked
that way, so there only the lock file and its identity check guard the workdir (a second
run that deletes the lock file is then seen within :data:`CHECK_EVERY_S` and one of the two
stops). On older NFS, CIFS without byte-range locks, or a FUSE mount without lock support
a lock may be local to one host, or refused (then the run stops with a one-line error
saying so rather than run unguarded). The workdir is always a local or mounted folder: an
object store (``s3://``) can only be the snapshot store (``snapshot.store``), which this
lock does not cover; the job identity in every snapshot
(:mod:`~rollpoint.store.job_identity`) keeps two jobs apart there.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rollpoint.protocol.errors import ConfigError, WorkdirBusyError

LOCK_NAME = ".rollpoint.lock"
CHECK_EVERY_S = 0.5
"""How often a running job checks that its lock file is still the file it locked."""
_TAKE_TRIES = 5

log = logging.getLogger(__name__)

_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


@dataclass
class WorkdirLock:
    """A held lock: its file and descriptors (closing them releases it). ``fd`` changes
    when :func:`check_lock` takes a deleted or replaced lock file again."""

    workdir: Path
    path: Path
    fd: int
    dir_fd: int | None
    """The folder's locked descriptor; None where the filesystem cannot lock a folder."""


_held: dict[Path, WorkdirLock] = {}
_guard = threading.Lock()


def lock_workdir(workdir: Path) -> WorkdirLock:
    """Lock ``workdir`` for this process (creating it if needed), or refuse naming the holder."""
    key = workdir.resolve()
    with _guard:
        held = _held.get(key)
        if held is not None:
            return held
        path = workdir / LOCK_NAME
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"workdir {workdir} is not writable: {exc.strerror} (creating {LOCK_NAME})"
            ) from None
        dir_fd = _lock_folder(workdir, path)
        try:
            fd = _lock_file(workdir, path)
        except BaseException:
            if dir_fd is not None:
                os.close(dir_fd)
            raise
        _write_holder(fd)
        lock = WorkdirLock(workdir=key, path=path, fd=fd, dir_fd=dir_fd)
        _held[key] = lock
        return lock


def _lock_folder(workdir: Path, path: Path) -> int | None:
    """The folder's lock: what a deleted lock file cannot free. None when unsupported."""
    try:
        dir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(dir_fd)
        if exc.errno in _BUSY:
            raise WorkdirBusyError(
                f"workdir {workdir} is in use by {_holder_of(path)} (lock {path}); "
                "wait for it to end or stop it, then run again"
            ) from None
        return None  # a filesystem that cannot lock a folder: the lock file still guards
    return dir_fd


def _lock_file(workdir: Path, path: Path) -> int:
    """Lock the file ``path`` names: retried when it is swapped between open and lock."""
    for _ in range(_TAKE_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            # The lock file is the first thing a run writes: the same words as the
            # start check's (rollpoint.job.start_checks) for a workdir that cannot be written.
            raise ConfigError(
                f"workdir {workdir} is not writable: {exc.strerror} (creating {LOCK_NAME})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno in _BUSY:
                raise WorkdirBusyError(
                    f"workdir {workdir} is in use by {holder} (lock {path}); "
                    "wait for it to end or stop it, then run again"
                ) from None
            raise ConfigError(
                f"workdir {workdir}: cannot lock {path} ({exc.strerror}): the filesystem does "
                "not support flock; use a local or flock-capable workdir"
            ) from None
        if _names(path, fd):
            return fd
        os.close(fd)  # deleted or replaced while we locked it: the lock guards nothing
    raise WorkdirBusyError(
        f"workdir {workdir}: the lock file {path} kept changing while it was being locked; "
        "another process is deleting or replacing it"
    )


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd`` (same inode and device)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (named.st_ino, named.st_dev) == (held.st_ino, held.st_dev)


def _write_holder(fd: int) -> None:
    # Who holds it, for the refusal of a second process: pid first, host for shared mounts.
    # Written over the old holder's line, then cut to length: a reader sees the old line
    # or the new one, never an empty file.
    line = f"{os.getpid()} {socket.gethostname()}\n".encode()
    os.pwrite(fd, line, 0)
    os.ftruncate(fd, len(line))


def check_lock(workdir: Path) -> None:
    """Make sure this process's lock on ``workdir`` still guards it.

    The lock file deleted or replaced: it is taken again (one warning) when no other
    process holds the file the path names now; otherwise :class:`WorkdirBusyError`, and
    the caller stops the run. A workdir folder moved or replaced: the same error."""
    with _guard:
        lock = _held.get(workdir.resolve())
        if lock is None or _names(lock.path, lock.fd):
            if lock is not None and lock.dir_fd is not None:
                _check_folder(lock)
            return
        what = "deleted" if not os.path.lexists(lock.path) else "replaced"
        if lock.dir_fd is not None:
            _check_folder(lock)
        try:
            fd = _lock_file(lock.workdir, lock.path)
        except WorkdirBusyError as exc:
            raise WorkdirBusyError(
                f"workdir {lock.workdir}: its lock file {lock.path} was {what} while this run "
                f"(process {os.getpid()}) held it, and {_busy_holder(exc)} holds the new one: "
                "stopping this run so that two runs never share the workdir"
            ) from None
        _write_holder(fd)
        os.close(lock.fd)
        lock.fd = fd
    log.warning(
        "workdir %s: its lock file %s was %s while this run held it: taken again "
        "(never delete the lock file of a live run; a dead run holds no lock)",
        lock.workdir,
        lock.path,
        what,
    )


def _check_folder(lock: WorkdirLock) -> None:
    assert lock.dir_fd is not None
    if not _names(lock.workdir, lock.dir_fd):
        raise WorkdirBusyError(
            f"workdir {lock.workdir} was moved or replaced while this run (process "
            f"{os.getpid()}) held it: stopping this run"
        )


def _busy_holder(exc: WorkdirBusyError) -> str:
    words = exc.message.split(" is in use by ", 1)
    return words[1].split(" (lock ", 1)[0] if len(words) == 2 else "another process"


def release_workdir(workdir: Path) -> None:
    """Give the lock up before the process ends (tests; a normal exit needs no call)."""
    with _guard:
        lock = _held.pop(workdir.resolve(), None)
    if lock is not None:
        os.close(lock.fd)
        if lock.dir_fd is not None:
            os.close(lock.dir_fd)


HOLDER_WAIT_S = 1.0 + CHECK_EVERY_S
"""How long a refused process waits for the holder to write its pid: the lock is taken
before the pid is written, so one that asks in between reads the last holder's line (a
process now dead) or nothing. Two reruns started together by a scheduler meet exactly this,
and so does a run refused by the folder's lock while the holder takes a deleted lock file
again (within :data:`CHECK_EVERY_S`)."""


def _holder_of(path: Path) -> str:
    """The holder named in the lock file at ``path``, opened read-only (never created)."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            if time.monotonic() >= deadline:
                return "another process"
            time.sleep(0.01)
            continue
        try:
            return _holder(fd, deadline)
        finally:
            os.close(fd)


def _holder(fd: int, deadline: float | None = None) -> str:
    deadline = time.monotonic() + HOLDER_WAIT_S if deadline is None else deadline
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
