"""An append-only sequence kept as immutable chunks, so a capture of it costs O(1) copies.

Owns :class:`AppendLog` and :class:`LogChunk`: what the recovery ledger keeps its
ever-growing parts in (tasks, groups, group failures, final tries). Items are only ever
appended; every ``CHUNK`` of them are frozen into a tuple that never changes again, so
:meth:`AppendLog.capture` hands out the full chunks themselves plus a copy of the open
tail. A capture therefore costs one reference per full chunk and at most ``CHUNK`` item
copies, however long the run has been, and stays valid (unchanged) while the log goes on
growing — which is what lets a snapshot capture the ledger while rollouts are paused and
encode it after they resume.

Each full chunk also remembers its JSON encoding once it was asked for it
(:meth:`LogChunk.encoded`), and the snapshot record made of it (:meth:`LogChunk.record`), so
a chunk is encoded once per run rather than once per snapshot, and a snapshot's writer finds
the very record it wrote before (:mod:`rollpoint.store.record_packs`) and references it. It
does not know what the items mean; the encoder is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

CHUNK = 4096


class LogChunk(Generic[T]):
    """Up to ``CHUNK`` items, immutable once full; remembers its encoding."""

    __slots__ = ("_encoded", "_record", "items")

    def __init__(self, items: tuple[T, ...]) -> None:
        self.items = items
        self._encoded: bytes | None = None
        self._record: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def encoded(self, encode: Callable[[tuple[T, ...]], bytes]) -> bytes:
        """``encode(items)``, computed the first time only: the items never change.

        Two threads racing here both compute the same bytes; either result is kept.
        """
        if self._encoded is None:
            self._encoded = encode(self.items)
        return self._encoded

    def record(self, make: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """``make(self)``, made the first time only and the same object afterwards.

        Two threads racing here both make an equal record; either one is kept.
        """
        if self._record is None:
            self._record = make(self)
        return self._record


class AppendLog(Generic[T]):
    """Append-only items, frozen in chunks of ``CHUNK``."""

    def __init__(self, chunk: int = CHUNK) -> None:
        if chunk < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk}")
        self._chunk = chunk
        self._full: list[LogChunk[T]] = []
        self._open: list[T] = []
        self._tail: LogChunk[T] | None = None
        """The open tail's last capture, while nothing was appended since."""
        self._count = 0

    def append(self, item: T) -> None:
        self._tail = None
        self._open.append(item)
        self._count += 1
        if len(self._open) == self._chunk:
            self._full.append(LogChunk(tuple(self._open)))
            self._open = []

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[T]:
        for chunk in self._full:
            yield from chunk.items
        yield from self._open

    def capture(self) -> tuple[LogChunk[T], ...]:
        """Every item so far, as chunks: the full ones shared, the open tail copied.

        The tail is copied again only once something was appended to it: a log that did
        not grow between two captures (the task list of a run, loaded at its start) hands
        out the same tail chunk, whose record and encoding are then made once, not every
        snapshot (~0.4 s of the trainer's write at 100k in flight: ``snapshot_growth_100k``).
        """
        if self._tail is None:
            self._tail = LogChunk(tuple(self._open))
        return (*self._full, self._tail)
