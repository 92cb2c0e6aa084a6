"""A snapshot store whose disk is full while a flag file exists, for ``rollpoint run`` as a process.

Owns two ways to fill the disk under ``WORKDIR/snapshots`` for a test that drives the real
command (``tests/support/run_process.py``):

- :class:`TmpfsDisk`: a small tmpfs mounted there (needs root and ``mount``): every writer,
  the trainer and each participant server, meets a real ``ENOSPC`` once a filler file takes
  the free space, and writes again once it is removed;
- :class:`InjectedDisk`: where no tmpfs can be mounted, the run is started through this
  module (``python -m tests.support.full_disk FLAG run CONFIG``), which makes the trainer's
  store writes (``LocalFilesystem``: folders, files, renames, the manifest) raise
  ``OSError(ENOSPC)`` while ``FLAG`` exists, then runs the CLI. The participants' own
  writes still succeed: the save fails on the trainer's side, as it does on a full disk.

It does not judge the run (the test does).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

FILLER = "filler.bin"


class FullDisk(Protocol):
    launcher: tuple[str, ...]
    """How to start ``python <launcher> run CONFIG``."""

    def fill(self) -> None: ...
    def free(self) -> None: ...


class InjectedDisk:
    def __init__(self, tmp_path: Path) -> None:
        self.flag = tmp_path / f"disk-full-{uuid.uuid4().hex[:8]}"
        self.launcher = ("-m", "tests.support.full_disk", str(self.flag))

    def fill(self) -> None:
        self.flag.touch()

    def free(self) -> None:
        self.flag.unlink(missing_ok=True)


class TmpfsDisk:
    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.launcher = ("-m", "rollpoint")
        self._stop = threading.Event()
        self._filler: threading.Thread | None = None

    def fill(self) -> None:
        """Take every free block (the next write anywhere on the mount gets ENOSPC), and
        keep taking what is freed until :meth:`free`: the run's own retention deletes old
        snapshots there, and a disk full for a while stays full, as a shared one does."""
        self._stop.clear()
        self._take()
        self._filler = threading.Thread(target=self._keep_full, daemon=True)
        self._filler.start()

    def free(self) -> None:
        self._stop.set()
        if self._filler is not None:
            self._filler.join()
        (self.mountpoint / FILLER).unlink(missing_ok=True)

    def _take(self) -> None:
        with contextlib.suppress(OSError), (self.mountpoint / FILLER).open("ab") as out:
            block = b"\0" * (1 << 12)
            while True:
                out.write(block)
                out.flush()

    def _keep_full(self) -> None:
        while not self._stop.wait(0.005):
            self._take()


@contextlib.contextmanager
def tmpfs_at(mountpoint: Path, size_mb: int = 64) -> Iterator[TmpfsDisk | None]:
    """A tmpfs mounted at ``mountpoint`` for the block, or None where mounting is refused."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        yield None
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mountpoint)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield TmpfsDisk(mountpoint)
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


def _failing(flag: Path, write: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(self: object, path: str, *args: Any) -> Any:
        if flag.exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return write(self, path, *args)

    return wrapped


def main(argv: list[str]) -> None:
    flag = Path(argv[0])
    from rollpoint.store.filesystem import LocalFilesystem

    for name in ("makedirs", "open_write", "write_bytes", "publish_bytes", "rename"):
        setattr(LocalFilesystem, name, _failing(flag, getattr(LocalFilesystem, name)))
    from rollpoint.app.cli import main as cli

    sys.argv = ["rollpoint", *argv[1:]]
    cli()


if __name__ == "__main__":
    main(sys.argv[1:])
