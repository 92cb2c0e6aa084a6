"""A snapshot store whose disk fails on cue: the ``faultyfile://`` fsspec protocol.

Owns :class:`FaultyFileSystem`, fsspec's local filesystem with every write (a file opened
for writing, a folder made, a move, a copy, a removal) raising ``OSError`` while a flag
file beside the store's root exists, and :func:`fail_writes` / :func:`heal` to set and
clear it. Every process that writes the store meets the fault at once, as on a real full
disk: the trainer and each participant server resolve the protocol through the
``fsspec.specs`` entry point rollpoint declares. Reads always work.

A store named ``faultyfile:///runs/t/snapshots`` is the local folder ``/runs/t/snapshots``;
its flag is ``/runs/t/snapshots.fail`` and holds the errno to raise (``ENOSPC``, ``EIO``).
``rollpoint chaos`` uses it for its ``store_full`` fault. It does not decide when the disk
fills: the trial does.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faultyfile"
_FLAG_SUFFIX = ".fail"
ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


def store_url(folder: Path) -> str:
    """The ``faultyfile://`` URL of a local folder."""
    return f"{PROTOCOL}://{folder.resolve()}"


def _flag(folder: Path) -> Path:
    return folder.with_name(folder.name + _FLAG_SUFFIX)


def fail_writes(folder: Path, name: str = "ENOSPC") -> None:
    """From now on every write under ``folder`` (a store's root) fails with ``name``."""
    _flag(folder).write_text(str(ERRNOS[name]))


def heal(folder: Path) -> None:
    _flag(folder).unlink(missing_ok=True)


class FaultyFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """Local files; writes fail while a flag beside an ancestor folder says so."""

    protocol = (PROTOCOL,)

    def _check(self, *paths: str) -> None:
        for path in paths:
            here = Path(self._strip_protocol(path))
            for folder in (here, *here.parents):
                flag = _flag(folder) if folder.name else None
                if flag is None or not flag.exists():
                    continue
                try:
                    code = int(flag.read_text() or errno.ENOSPC)
                except (OSError, ValueError):
                    code = errno.ENOSPC
                raise OSError(code, os.strerror(code), path)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+"):
            self._check(path)
        return super()._open(path, mode=mode, block_size=block_size, **kwargs)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._check(path)
        super().mkdir(path, create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._check(path)
        super().makedirs(path, exist_ok=exist_ok)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._check(path2)
        super().cp_file(path1, path2, **kwargs)

    def mv(self, path1: str, path2: str, recursive: bool = True, **kwargs: Any) -> None:
        self._check(path1, path2)
        super().mv(path1, path2, recursive=recursive, **kwargs)

    def rm_file(self, path: str) -> None:
        self._check(path)
        super().rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._check(*([path] if isinstance(path, str) else path))
        super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        self._check(path)
        super().touch(path, truncate=truncate, **kwargs)
