"""Where snapshot bytes live: a local folder or an fsspec URL, chosen in one place.

Owns the choice between the two (:func:`filesystem_for`), the primitive operations the
store needs on either (durable writes, atomic publication of one small file, rename,
listing, removal) and :func:`resolve_inside`, the one guard that keeps a relative path
inside a root. It does not know the snapshot layout (:mod:`rollpoint.store.snapshot_store`)
nor any file format (:mod:`rollpoint.store.participant_state`).

Locations: anything that starts with ``<scheme>://`` is an fsspec URL (``memory://``,
``s3://``, ``gs://``...), except ``file://``, which is a local path; anything else is a
local path. fsspec is imported only when a URL is used.

Durability differs by backend, and the callers rely on exactly this:

- local: :meth:`Filesystem.write_bytes` and :meth:`Filesystem.open_write` fsync the file;
  :meth:`Filesystem.publish_bytes` writes a temp file, fsyncs it, renames it over the
  target and fsyncs the folder, so a reader sees the old file or the new one, whole.
- fsspec: every write is one object put, which object stores make visible whole; there
  are no folders to sync. A rename is a copy and a delete on most object stores.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, Protocol

from rollpoint.protocol.errors import BadRequestError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class Filesystem(Protocol):
    """The operations the store needs, on a local folder or an fsspec URL."""

    local: bool
    """True for a local folder (renames of folders are atomic, fsync exists)."""

    def join(self, base: str, *parts: str) -> str: ...
    def makedirs(self, path: str) -> None: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of a folder; empty when it does not exist."""
        ...

    def size(self, path: str) -> int: ...
    def modified(self, path: str) -> float | None:
        """Newest modification time (Unix) of a file or of anything in a folder; None if unknown."""
        ...

    def read_bytes(self, path: str) -> bytes: ...
    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def open_write(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A new file, durable once the context exits without error."""
        ...

    def write_bytes(self, path: str, data: bytes) -> None: ...
    def publish_bytes(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` so that readers see the old file or the new one whole."""
        ...

    def rename(self, src: str, dst: str) -> None: ...
    def remove_file(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def sync_dir(self, path: str) -> None:
        """Make the entries of a folder (creations, renames) durable; a no-op on object stores."""
        ...


def is_url(location: str) -> bool:
    """True when ``location`` is an fsspec URL rather than a local path."""
    return _SCHEME.match(location) is not None and not location.startswith("file://")


def normalize_location(location: str) -> str:
    """A canonical form of a root: an absolute local path, or the URL without a trailing /."""
    if "\x00" in location:
        raise BadRequestError(f"location {location!r} contains a NUL byte")
    if location.startswith("file://"):
        location = location[len("file://") :]
    if is_url(location):
        scheme, _, rest = location.partition("://")
        return f"{scheme}://{rest.rstrip('/')}"
    return os.path.abspath(os.path.expanduser(location))


def filesystem_for(location: str) -> Filesystem:
    """The filesystem that serves ``location`` (a local path or an fsspec URL)."""
    if is_url(location):
        return FsspecFilesystem(location)
    return LocalFilesystem()


def normalize_relative(relative: str) -> str:
    """``relative`` as ``a/b/c``, refusing anything that could leave the folder it is under.

    Refused with :class:`BadRequestError` naming the path: NUL bytes, backslashes,
    absolute paths and URLs, any ``..`` component, and a path naming no file or folder.
    """
    if "\x00" in relative:
        raise BadRequestError(f"path {relative!r} contains a NUL byte")
    if "\\" in relative:
        raise BadRequestError(f"path {relative!r} contains a backslash; use '/'")
    if relative.startswith("/") or _SCHEME.match(relative):
        raise BadRequestError(f"path {relative!r} is absolute; expected a relative path")
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise BadRequestError(f"path {relative!r} contains '..', which could escape its root")
    if not parts:
        raise BadRequestError(f"path {relative!r} names no file or folder")
    return "/".join(parts)


def resolve_inside(root: str, relative: str) -> str:
    """``root`` joined with ``relative``; path traversal can never leave ``root``.

    ``relative`` is checked by :func:`normalize_relative`; for a local root, a path that
    leaves it through a symlink is refused too (:class:`BadRequestError`, naming it).
    """
    try:
        parts = normalize_relative(relative)
    except BadRequestError as exc:
        raise BadRequestError(f"{exc.message} (inside {root})") from None
    base = normalize_location(root)
    joined = base.rstrip("/") + "/" + parts
    if not is_url(base):
        real_base = os.path.realpath(base)
        if os.path.commonpath([real_base, os.path.realpath(joined)]) != real_base:
            raise BadRequestError(f"path {relative!r} leaves {root} through a symlink")
    return joined


class LocalFilesystem:
    """A folder on a local or mounted disk."""

    local = True

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def modified(self, path: str) -> float | None:
        newest = os.stat(path).st_mtime
        for folder, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                with contextlib.suppress(FileNotFoundError):
                    newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
        return newest

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as stream:
            return stream.read()

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with open(path, "rb") as stream:
            yield stream

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with open(path, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as stream:
            stream.write(data)

    def publish_bytes(self, path: str, data: bytes) -> None:
        folder, name = os.path.split(path)
        temp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            self.write_bytes(temp, data)
            os.replace(temp, path)
        except BaseException:
            self.remove_file(temp)
            raise
        self.sync_dir(folder)

    def rename(self, src: str, dst: str) -> None:
        # os.rename, not os.replace: renaming a folder onto an existing one must fail.
        os.rename(src, dst)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_tree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(path)
        else:
            self.remove_file(path)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class FsspecFilesystem:
    """Any fsspec URL (object stores, ``memory://``); paths in and out are full URLs."""

    local = False

    def __init__(self, url: str) -> None:
        # Lazy: only URL users pay for importing fsspec and its plugins.
        import fsspec

        self._fs: Any = fsspec.core.url_to_fs(url)[0]

    def join(self, base: str, *parts: str) -> str:
        return "/".join([base.rstrip("/"), *parts])

    def makedirs(self, path: str) -> None:
        self._fs.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return bool(self._fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self._fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        # What is there now: fsspec caches listings per instance (s3fs's dircache), and
        # another process may have written or deleted since (a journal's shipper lists
        # what the trainer's retention deleted).
        self._fs.invalidate_cache(path)
        try:
            entries = self._fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def size(self, path: str) -> int:
        return int(self._fs.size(path))

    def modified(self, path: str) -> float | None:
        files = self._fs.find(path) if self._fs.isdir(path) else [path]
        times = []
        for file in files:
            try:
                times.append(self._fs.modified(file).timestamp())
            except (NotImplementedError, FileNotFoundError):
                return None
        return max(times, default=None)

    def read_bytes(self, path: str) -> bytes:
        return bytes(self._fs.cat_file(path))

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self._fs.open(path, "rb") as stream:
            yield stream

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with self._fs.open(path, "wb") as stream:
            yield stream

    def write_bytes(self, path: str, data: bytes) -> None:
        self._fs.pipe_file(path, data)

    def publish_bytes(self, path: str, data: bytes) -> None:
        # One put: object stores never show a partial object.
        self._fs.pipe_file(path, data)

    def rename(self, src: str, dst: str) -> None:
        self._fs.mv(src, dst, recursive=self._fs.isdir(src))

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(path, recursive=True)

    def sync_dir(self, path: str) -> None:
        return None
