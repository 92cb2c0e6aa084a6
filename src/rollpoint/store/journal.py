"""One participant's journal: durable appends in group commits, read back, indexed by key.

Owns a journal folder (a local path; :mod:`rollpoint.store.journal_shipping` copies it to an
fsspec URL) of numbered segments in the format of :mod:`rollpoint.store.journal_format`::

    <folder>/segment-0000000001.rpj     closed: every byte of it was made durable
    <folder>/segment-0000000002.rpj     the active segment, appended to by this process
    <folder>/segment-0000000003.rpj.untrusted   set aside: it came after a damaged record

Group commit: :meth:`Journal.append` encodes its record in the caller, queues it and waits.
One flusher takes every record queued within ``window_s`` of the oldest one (up to
``batch_bytes``: then at once), writes them with one ``write`` and makes them durable with
one fsync on one writer thread, then resolves every waiting append: an append returns only when
its record is durable, and N concurrent appends cost one fsync, not N. Records queued while a
batch is being written wait for the next one (at most ``window_s`` after they arrived). When
the last commit held a single record nobody else is appending: the next one is written at
once instead of waiting out the window for company.

Opening a journal scans it once (:func:`~rollpoint.store.journal_scan.scan`): every whole record is indexed by key (the
last record of a key answers it: :meth:`Journal.lookup` is one dict look-up and one
``pread``), and at the first record that is cut short or fails its checksum the journal is
cut, with a warning naming the file and offset. Nothing after it is trusted: later segments
are renamed ``*.untrusted`` (never deleted), and the writer starts a new segment whose
header says where the previous one's trusted records end, so no byte is truncated either.
A writer never appends to a segment it did not create.

Positions: a :class:`Position` ``(segment, offset)`` is the end of a record; a snapshot
that names one covers every record before it; :meth:`Journal.records_after` reads from
there and :meth:`Journal.drop_before` deletes the closed segments no such position needs.

It does not know what a key or a record means (each participant does), nor which
snapshots are kept. The segment files are written with the journal's own file descriptor
(the project's :class:`~rollpoint.store.filesystem.Filesystem` writes whole files only);
listing, reading whole segments, renaming and removing go through that layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from rollpoint.protocol.errors import JournalFormatError, StorageError
from rollpoint.store.filesystem import Filesystem, LocalFilesystem
from rollpoint.store.journal_format import (
    HEADER,
    Damage,
    SegmentHeader,
    encode_header,
    encode_record,
    scan_frames,
    segment_name,
)
from rollpoint.store.journal_scan import JournalScan, Placement, Position, scan

__all__ = ["Journal", "JournalMetrics", "JournalRecord", "Position"]

log = logging.getLogger(__name__)

UNTRUSTED = ".untrusted"
_O_APPEND_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW


@dataclass(frozen=True, slots=True)
class JournalRecord:
    key: str
    kind: str
    payload: bytes
    json: bool
    start: Position
    end: Position

    def value(self) -> Any:
        """The payload decoded (a record appended with :meth:`Journal.append_json`)."""
        return orjson.loads(self.payload) if self.json else self.payload


@dataclass(slots=True)
class JournalMetrics:
    records: int = 0
    bytes: int = 0
    fsyncs: int = 0
    """Every fsync the journal made: group commits, new segments' headers and folder."""
    commits: int = 0
    """Group commits (each one write and one fsync)."""

    @property
    def records_per_fsync(self) -> float:
        return self.records / self.fsyncs if self.fsyncs else 0.0


@dataclass(slots=True)
class _Pending:
    frame: bytes
    key: str
    future: asyncio.Future[Position]


class Journal:
    """A participant's journal in ``folder``; open with :meth:`open`, append from one event loop."""

    def __init__(
        self,
        folder: str,
        scanned: JournalScan,
        *,
        fs: Filesystem,
        window_s: float,
        batch_bytes: int,
        segment_bytes: int,
        fsync: Callable[[int], None],
    ) -> None:
        self.folder = folder
        self.read_back_s = 0.0
        """How long :meth:`open` took: reading back what earlier processes journaled (the
        scan, every record's checksum, the index), a restart's share of a restore."""
        self.window_s = window_s
        self.batch_bytes = batch_bytes
        self.segment_bytes = segment_bytes
        self.metrics = JournalMetrics()
        self._fs = fs
        self._fsync = fsync
        self._limits = dict(scanned.limits)
        self._index = dict(scanned.index)
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._oldest = 0.0
        self._last_batch = 0
        self._flusher: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self._closed = False
        self._rotating: asyncio.Task[None] | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="journal-writer")
        self._readers: dict[int, int] = {}
        self._fd = -1
        self._active = 0
        last = max(self._limits, default=0)
        if scanned.cut is not None:
            last = scanned.cut.segment if scanned.cut.offset else scanned.cut.segment - 1
        self._new_segment(last + 1, self._limits.get(last, 0))

    @classmethod
    def open(
        cls,
        folder: str,
        *,
        fs: Filesystem | None = None,
        window_s: float = 0.002,
        batch_bytes: int = 4 << 20,
        segment_bytes: int = 64 << 20,
        fsync: Callable[[int], None] = os.fsync,
    ) -> Journal:
        """Scan ``folder`` (made if missing), set aside what follows a damaged record, and
        start a new segment. Blocking I/O: call it from a worker thread in async code."""
        started = time.perf_counter()
        fs = fs or LocalFilesystem()
        fs.makedirs(folder)
        scanned = scan(fs, folder)
        for name in scanned.untrusted:
            path = fs.join(folder, name)
            fs.rename(path, path + UNTRUSTED)
        journal = cls(
            folder,
            scanned,
            fs=fs,
            window_s=window_s,
            batch_bytes=batch_bytes,
            segment_bytes=segment_bytes,
            fsync=fsync,
        )
        journal.read_back_s = time.perf_counter() - started
        return journal

    @property
    def read_back_ms(self) -> int:
        """:attr:`read_back_s` in whole milliseconds (a status count)."""
        return round(self.read_back_s * 1000)

    # --- appending -----------------------------------------------------------------------

    @property
    def position(self) -> Position:
        """The end of the last durable record (what a snapshot taken now can say it covers)."""
        return Position(self._active, self._limits[self._active])

    async def append(self, key: str, kind: str, payload: bytes, *, json: bool = False) -> Position:
        """Append one record; returns its end once it is durable (:class:`StorageError` if
        the write failed: then every later append fails too, the journal is broken)."""
        return await self.append_soon(key, kind, payload, json=json)

    def append_soon(
        self, key: str, kind: str, payload: bytes, *, json: bool = False
    ) -> asyncio.Future[Position]:
        """Queue one record and return at once: the future resolves to its end once it is
        durable (or fails with :class:`StorageError`). Records are made durable in the order
        they were queued, so when a later record of this journal is durable, this one is
        too: a caller that must not wait on this record (it only speeds a resume up) still
        has it durable before anything it awaits afterwards. Raises at once when the
        journal is closed or broken."""
        if self._failed is not None:
            raise StorageError(f"journal {self.folder}: an earlier write failed: {self._failed}")
        if self._closed:
            raise StorageError(f"journal {self.folder}: closed; append refused")
        frame = encode_record(key, kind, payload, json=json)
        loop = asyncio.get_running_loop()
        pending = _Pending(frame, key, loop.create_future())
        if not self._pending:
            self._oldest = time.monotonic()
        self._pending.append(pending)
        self._pending_bytes += len(frame)
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush())
        return pending.future

    async def append_json(self, key: str, kind: str, value: Any) -> Position:
        return await self.append(key, kind, orjson.dumps(value), json=True)

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                # A lone appender (the last commit held one record) is not kept waiting
                # for company that is not coming: PostgreSQL's commit_siblings rule.
                wait = self._oldest + self.window_s - time.monotonic()
                if wait > 0 and self._last_batch > 1 and self._pending_bytes < self.batch_bytes:
                    await asyncio.sleep(wait)
                batch = self._take_batch()
                try:
                    ends = await loop.run_in_executor(
                        self._writer, self._write_batch, [p.frame for p in batch]
                    )
                except Exception as exc:  # OSError mostly; any other must not strand appends
                    self._failed = exc
                    error = StorageError(f"journal {self.folder}: write failed: {exc}")
                    for p in (*batch, *self._pending):
                        if not p.future.done():
                            p.future.set_exception(error)
                    self._pending = []
                    return
                self._last_batch = len(batch)
                for p, (segment, start, end) in zip(batch, ends, strict=True):
                    self._index[p.key] = Placement(segment, start, end)
                    if not p.future.done():  # a cancelled caller: its record is durable anyway
                        p.future.set_result(Position(segment, end))
        finally:
            self._flusher = None

    def _take_batch(self) -> list[_Pending]:
        """The oldest pending records up to ``batch_bytes`` (at least one): a burst of
        appends is written in bounded commits, so the first of them wait for one commit's
        write, not for everyone's."""
        take, size = 0, 0
        for pending in self._pending:
            if take and size + len(pending.frame) > self.batch_bytes:
                break
            take, size = take + 1, size + len(pending.frame)
        batch, self._pending = self._pending[:take], self._pending[take:]
        self._pending_bytes -= size
        return batch

    def _write_batch(self, frames: list[bytes]) -> list[tuple[int, int, int]]:
        """On the writer thread: one write and one fsync for the whole batch."""
        size = sum(map(len, frames))
        offset = self._limits[self._active]
        if offset > HEADER and offset + size > self.segment_bytes:
            self._new_segment(self._active + 1, offset)
            offset = HEADER
        ends = []
        for frame in frames:
            ends.append((self._active, offset, offset + len(frame)))
            offset += len(frame)
        _write_all(self._fd, b"".join(frames))
        self._fsync(self._fd)
        self._limits[self._active] = offset
        self.metrics.records += len(frames)
        self.metrics.bytes += size
        self.metrics.fsyncs += 1
        self.metrics.commits += 1
        return ends

    def _new_segment(self, number: int, prev_end: int) -> None:
        """Create segment ``number``, its header and its folder entry durable before any
        record is acknowledged in it; the previous one (already durable) is closed."""
        path = self._fs.join(self.folder, segment_name(number))
        fd = os.open(path, _O_APPEND_NEW, 0o644)
        try:
            _write_all(fd, encode_header(SegmentHeader(segment=number, prev_end=prev_end)))
            self._fsync(fd)
            dir_fd = os.open(self.folder, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            os.close(fd)
            raise
        self.metrics.fsyncs += 2
        if self._fd >= 0:
            os.close(self._fd)
        self._limits[number] = HEADER  # before _active: `position` reads both from the loop
        self._fd, self._active = fd, number

    async def rotate(self) -> None:
        """Close the active segment (if it holds records) and start the next; after pending
        appends, on the writer thread. The shipper calls it to ship what was appended."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, self._rotate)

    def _rotate(self) -> None:
        if self._limits[self._active] > HEADER:
            self._new_segment(self._active + 1, self._limits[self._active])

    def checkpoint(self) -> Position:
        """The position a cut opening now names (:attr:`position`), and the active segment
        closed in the background (when it holds records): the records after this position
        then start a new segment, so retention can delete every segment before it once no
        kept snapshot names an earlier position. Call on the event loop; no waiting."""
        position = self.position
        busy = self._rotating is not None and not self._rotating.done()
        if not busy and not self._closed and self._failed is None and position.offset > HEADER:
            self._rotating = asyncio.get_running_loop().create_task(self._rotate_quietly())
        return position

    async def _rotate_quietly(self) -> None:
        try:
            await self.rotate()
        except Exception as exc:  # the next append meets the broken disk, with its error
            log.warning("journal %s: could not close the active segment: %s", self.folder, exc)

    def forget_removed(self) -> list[int]:
        """Forget the closed segments no longer in the folder: retention (the trainer's
        snapshot store) deleted them, since no kept snapshot needs them. Their keys leave
        the index. Returns their numbers (one listing of the folder)."""
        try:
            present = set(self._fs.listdir(self.folder))
        except OSError as exc:
            log.warning("journal %s: cannot list it: %s", self.folder, exc)
            return []
        gone = [n for n in self._limits if n != self._active and segment_name(n) not in present]
        self._forget(gone)
        return gone

    def _forget(self, numbers: list[int]) -> None:
        for number in numbers:
            with contextlib.suppress(KeyError, OSError):
                os.close(self._readers.pop(number))
            self._limits.pop(number, None)
        if numbers:
            self._index = {k: v for k, v in self._index.items() if v.segment in self._limits}

    # --- reading -------------------------------------------------------------------------

    def lookup(self, key: str) -> JournalRecord | None:
        """The last durable record appended under ``key``, or None: a dict look-up and one read."""
        loc = self._index.get(key)
        if loc is None:
            return None
        try:
            return self._read(loc)
        except FileNotFoundError:  # retention deleted its segment: no kept snapshot needs it
            self._forget([loc.segment])
            return None

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def records_after(self, position: Position | None = None) -> Iterator[JournalRecord]:
        """Every durable record that ends after ``position`` (all of them when None), in order."""
        after = position or Position(0, 0)
        for number in sorted(self._limits):
            if number < after.segment or number not in self._limits:
                continue
            path = self._fs.join(self.folder, segment_name(number))
            limit = self._limits.get(number)
            if limit is None:
                continue
            try:
                data = self._pread(number, 0, limit)
            except FileNotFoundError:  # retention deleted it: no kept snapshot needs it
                self._forget([number])
                continue
            start = max(HEADER, after.offset) if number == after.segment else HEADER
            for frame in scan_frames(data, start, limit):
                if isinstance(frame, Damage):
                    raise JournalFormatError(
                        f"journal segment {path}: {frame.reason} at offset {frame.offset}, "
                        "in records already read whole (changed on disk, or not a record boundary)"
                    )
                yield JournalRecord(
                    frame.key,
                    frame.kind,
                    frame.payload,
                    frame.json,
                    Position(number, frame.offset),
                    Position(number, frame.end),
                )

    def _read(self, loc: Placement) -> JournalRecord:
        data = self._pread(loc.segment, loc.offset, loc.end - loc.offset)
        for frame in scan_frames(data, 0, len(data)):
            if isinstance(frame, Damage):
                break
            return JournalRecord(
                frame.key,
                frame.kind,
                frame.payload,
                frame.json,
                Position(loc.segment, loc.offset),
                Position(loc.segment, loc.end),
            )
        path = self._fs.join(self.folder, segment_name(loc.segment))
        raise JournalFormatError(f"journal segment {path}: record at {loc.offset} changed on disk")

    def _pread(self, segment: int, offset: int, length: int) -> bytes:
        fd = self._readers.get(segment)
        if fd is None:
            path = self._fs.join(self.folder, segment_name(segment))
            fd = self._readers[segment] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, length, offset)

    # --- retention and closing -----------------------------------------------------------

    def closed_segments(self) -> list[str]:
        """Names of the segments no append will change again, oldest first."""
        return [segment_name(n) for n in sorted(self._limits) if n != self._active]

    def drop_before(self, position: Position) -> list[str]:
        """Delete the closed segments wholly before ``position`` (the oldest position a kept
        snapshot names): a restore from any kept snapshot never reads them. Returns their names."""
        dropped = []
        for number in sorted(self._limits):
            if number >= position.segment or number == self._active:
                break
            with contextlib.suppress(KeyError):
                os.close(self._readers.pop(number))
            name = segment_name(number)
            self._fs.remove_file(self._fs.join(self.folder, name))
            del self._limits[number]
            dropped.append(name)
        if dropped:
            self._index = {k: v for k, v in self._index.items() if v.segment in self._limits}
        return dropped

    async def close(self) -> None:
        """Wait for pending appends, then release the files (the active segment stays as is)."""
        self._closed = True
        while self._flusher is not None:
            await asyncio.shield(self._flusher)
        if self._rotating is not None:
            await asyncio.shield(self._rotating)
        self._writer.shutdown(wait=True)
        for fd in (self._fd, *self._readers.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fd = -1
        self._readers.clear()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
