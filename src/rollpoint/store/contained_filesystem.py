"""A local folder whose every open is checked inside its root at the moment it happens.

Owns :class:`ContainedFilesystem`, the :class:`~rollpoint.store.filesystem.Filesystem` a
participant reads and writes its state through (commit, confirm and restore alike) and the
snapshot store works through on a local root (the trainer's files and records files,
publication, retention's pruning and sweep, leftovers: issue 33), and
:func:`filesystem_within`, which picks it for a local root (an fsspec root has no
symlinks: its own filesystem serves it, as before).

:func:`~rollpoint.store.filesystem.resolve_inside` checks a path when a request names it;
a symlink put in the store after that check (say, between a commit and its confirm) would
still be followed by a plain ``open``. Here every operation walks from the root one
component at a time with ``openat``-style calls (``dir_fd``) and ``O_NOFOLLOW``, so no
component below the root may be a symlink at the moment the file is opened, created,
renamed or removed: such a path is refused with :class:`BadRequestError` naming it, and
nothing is written outside. rollpoint never makes symlinks inside a store; the root itself
may be reached through one (an operator's choice).

It does not decide where a participant's folder is (:mod:`rollpoint.participant.state_folders`) nor the
file format (:mod:`rollpoint.store.participant_state`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from rollpoint.protocol.errors import BadRequestError
from rollpoint.store.filesystem import (
    Filesystem,
    LocalFilesystem,
    filesystem_for,
    is_url,
    normalize_location,
)

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | os.O_CLOEXEC


def filesystem_within(root: str, location: str) -> Filesystem:
    """The filesystem for ``location``, a path under ``root``: contained for a local root."""
    if is_url(root) or is_url(location):
        return filesystem_for(location)
    return ContainedFilesystem(root)


class ContainedFilesystem(LocalFilesystem):
    """A local folder under ``root``; paths in and out are absolute, as for LocalFilesystem."""

    def __init__(self, root: str) -> None:
        self.root = normalize_location(root)

    # --- the walk ------------------------------------------------------------------------

    def _parts(self, path: str) -> list[str]:
        """``path`` relative to the root, as components; refused when it is not under it."""
        normal = os.path.normpath(path)
        if normal == self.root:
            return []
        prefix = self.root.rstrip("/") + "/"
        if not normal.startswith(prefix):
            raise BadRequestError(f"path {path!r} is not inside the store {self.root}")
        return normal[len(prefix) :].split("/")

    def _refused(self, path: str, component: str) -> BadRequestError:
        return BadRequestError(
            f"path {path!r} goes through a symlink at {component!r} inside the store "
            f"{self.root}; refused (a store holds no symlinks)"
        )

    def _open_dir(self, path: str, parts: list[str], *, create: bool) -> int:
        """A file descriptor of the folder ``parts`` below the root, walked without
        following a symlink; missing folders are made when ``create``."""
        if create:
            os.makedirs(self.root, exist_ok=True)  # the root itself may follow symlinks
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
        try:
            for part in parts:
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                    child = self._open_child_dir(path, part, fd)
                except OSError as exc:
                    raise self._classified(exc, path, part, fd) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_child_dir(self, path: str, part: str, fd: int) -> int:
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise self._classified(exc, path, part, fd) from None

    def _classified(self, exc: OSError, path: str, part: str, fd: int) -> OSError:
        """A symlink component as :class:`BadRequestError`; any other error as it was."""
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise self._refused(path, part) from None
        return exc

    @contextlib.contextmanager
    def _parent(self, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """``(fd of the folder holding path, path's last component)``."""
        parts = self._parts(path)
        if not parts:
            raise BadRequestError(f"path {path!r} is the store's root, not a file in it")
        fd = self._open_dir(path, parts[:-1], create=create)
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _open_file(self, path: str, flags: int) -> int:
        with self._parent(path) as (fd, name):
            try:
                return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
            except OSError as exc:
                raise self._classified(exc, path, name, fd) from None

    # --- the operations participant state uses -------------------------------------------

    def makedirs(self, path: str) -> None:
        os.close(self._open_dir(path, self._parts(path), create=True))

    def exists(self, path: str) -> bool:
        try:
            with self._parent(path) as (fd, name):
                os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def isdir(self, path: str) -> bool:
        try:
            os.close(self._open_dir(path, self._parts(path), create=False))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def size(self, path: str) -> int:
        fd = self._open_file(path, os.O_RDONLY)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as stream:
            return stream.read()

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with os.fdopen(self._open_file(path, os.O_RDONLY), "rb") as stream:
            yield stream

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        fd = self._open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())

    def publish_bytes(self, path: str, data: bytes) -> None:
        folder, name = os.path.split(path)
        temp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            self.write_bytes(temp, data)
            self.rename(temp, path, replace=True)
        except BaseException:
            self.remove_file(temp)
            raise
        self.sync_dir(folder)

    def rename(self, src: str, dst: str, *, replace: bool = False) -> None:
        with self._parent(src) as (src_fd, src_name), self._parent(dst) as (dst_fd, dst_name):
            # A rename moves the entry itself, never what a symlink points to.
            move = os.replace if replace else os.rename
            move(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError), self._parent(path) as (fd, name):
            os.unlink(name, dir_fd=fd)

    # --- the operations the snapshot store adds (retention, leftovers) ------------------

    def listdir(self, path: str) -> list[str]:
        try:
            fd = self._open_dir(path, self._parts(path), create=False)
        except FileNotFoundError:
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def modified(self, path: str) -> float | None:
        """As :meth:`LocalFilesystem.modified`, walking a folder without following links."""
        with self._parent(path) as (fd, name):
            entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
            newest = entry.st_mtime
            if not stat.S_ISDIR(entry.st_mode):
                return newest
            for _, dirs, files, folder_fd in os.fwalk(name, dir_fd=fd):
                for child in (*dirs, *files):
                    with contextlib.suppress(FileNotFoundError):
                        child_stat = os.stat(child, dir_fd=folder_fd, follow_symlinks=False)
                        newest = max(newest, child_stat.st_mtime)
            return newest

    def remove_tree(self, path: str) -> None:
        """Remove the folder ``path`` and what is in it, never following a symlink: one
        inside is removed as a link; ``path`` itself a symlink is refused."""
        with contextlib.suppress(FileNotFoundError), self._parent(path) as (fd, name):
            try:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                return
            if stat.S_ISLNK(mode):
                raise self._refused(path, name)
            # rmtree with dir_fd walks with openat and O_NOFOLLOW (symlink-attack safe).
            shutil.rmtree(name, dir_fd=fd)

    def sync_dir(self, path: str) -> None:
        fd = self._open_dir(path, self._parts(path), create=False)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
