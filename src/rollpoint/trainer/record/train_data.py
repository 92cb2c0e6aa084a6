"""``train_data.jsonl``: what the built-in trainer trained on, and what a checkpoint covers of it.

Owns the file: :class:`TrainData` appends each step's rows (fsync'd) while keeping a running
sha256, line count and byte length in memory, so a train checkpoint records its
:class:`Coverage` of the file in O(1), however long the run. On a rerun,
:meth:`TrainData.verify` reads the file's first ``coverage.bytes`` bytes once and accepts
them only if they hash to ``coverage.sha256``, hold exactly ``coverage.lines`` lines and end
at a line boundary; :meth:`TrainData.cut_back` then truncates the rows trained after the
checkpoint (they are back in the finished queue). Anything else — a file shorter than the checkpoint says
(truncated), a prefix with another digest (an edited line, even of the same size), a
boundary inside a line (torn) — is a :class:`~rollpoint.protocol.errors.RestoreError`
naming the file, and nothing is changed. A checkpoint written before the digest existed
(schema 1) is checked for its length and line boundary only.

It does not know what a row means (the trainer loop encodes them) nor when checkpoints are
written. A write that fails (disk full) raises
:class:`~rollpoint.protocol.errors.StorageError` naming the file; the rows of that step are
then past the last checkpoint, so a rerun cuts them away.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollpoint.protocol.errors import RestoreError, StorageError

if TYPE_CHECKING:
    from hashlib import _Hash

_BLOCK = 1 << 20
EMPTY_SHA256 = hashlib.sha256().hexdigest()


@dataclass(frozen=True)
class Coverage:
    """The first ``bytes`` bytes of the file: ``lines`` whole lines hashing to ``sha256``
    (None: recorded before digests existed; only length and boundary are checked)."""

    bytes: int
    lines: int | None
    sha256: str | None


class TrainData:
    """The train data file, positioned at its verified end."""

    def __init__(self, path: Path, hasher: _Hash, size: int, lines: int) -> None:
        self.path = path
        self._hasher = hasher
        self._size = size
        self._lines = lines

    @classmethod
    def open(cls, path: Path) -> TrainData:
        """The file as it is (a fresh run: absent or empty), hashed to its end."""
        if not path.exists():
            return cls(path, hashlib.sha256(), 0, 0)
        size = _size(path)
        return cls.verify(path, Coverage(bytes=size, lines=None, sha256=None))

    @classmethod
    def verify(cls, path: Path, coverage: Coverage) -> TrainData:
        """The file's first ``coverage.bytes`` bytes, checked against ``coverage``; the
        tail past them is left in place until :meth:`cut_back`."""
        if not path.exists():
            if coverage.bytes:
                raise RestoreError(
                    f"{path} is missing, but the train checkpoint says it held {coverage.bytes} "
                    "bytes; restore it, or start over with --fresh --force"
                )
            return cls(path, hashlib.sha256(), 0, 0)
        actual = _size(path)
        if actual < coverage.bytes:
            raise RestoreError(
                f"{path} holds {actual} bytes but the train checkpoint covers {coverage.bytes}: "
                "it was truncated; restore it, or start over with --fresh --force (nothing was changed)"
            )
        hasher = hashlib.sha256()
        lines = 0
        last = b"\n"
        try:
            with path.open("rb") as stream:
                left = coverage.bytes
                while left:
                    block = stream.read(min(_BLOCK, left))
                    if not block:
                        break
                    hasher.update(block)
                    lines += block.count(b"\n")
                    last = block[-1:]
                    left -= len(block)
        except OSError as exc:
            raise RestoreError(f"{path}: cannot read: {exc.strerror}") from None
        problem = None
        if coverage.sha256 is not None and hasher.hexdigest() != coverage.sha256:
            problem = (
                "its first {n} bytes do not match the train checkpoint's digest: a line was edited"
            )
        elif coverage.lines is not None and lines != coverage.lines:
            problem = f"its first {{n}} bytes hold {lines} lines, the train checkpoint says {coverage.lines}"
        elif last != b"\n":
            problem = "byte {n} (the train checkpoint's end) is inside a line: it would tear it"
        if problem is not None:
            raise RestoreError(
                f"{path}: {problem.format(n=coverage.bytes)}; restore the file, or start over "
                "with --fresh --force (nothing was changed)"
            )
        return cls(path, hasher, coverage.bytes, lines)

    def coverage(self) -> Coverage:
        return Coverage(bytes=self._size, lines=self._lines, sha256=self._hasher.hexdigest())

    def cut_back(self) -> int:
        """Truncate what lies past the verified end (rows trained after the checkpoint);
        return how many bytes went."""
        if not self.path.exists():
            return 0
        extra = _size(self.path) - self._size
        if extra > 0:
            with self.path.open("r+b") as out:
                out.truncate(self._size)
                out.flush()
                os.fsync(out.fileno())
        return max(extra, 0)

    def append(self, data: bytes) -> None:
        """Append whole lines, durably (fsync), and extend the running digest."""
        if data and not data.endswith(b"\n"):
            raise ValueError("train data is appended in whole lines")
        try:
            with self.path.open("ab") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            raise StorageError(
                f"cannot append to {self.path}: {exc.strerror}; free space there and rerun "
                "(the run resumes from its last snapshot)"
            ) from None
        self._hasher.update(data)
        self._size += len(data)
        self._lines += data.count(b"\n")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise RestoreError(f"{path}: cannot read: {exc.strerror}") from None
