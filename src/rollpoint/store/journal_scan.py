"""What a journal folder holds and how far it is trusted: the scan a journal is opened with.

Owns :func:`scan` (every segment read once, in order: the trusted extent of each, where
each key's last record sits, and where the first damage cuts the journal), the warning a
cut gives (file, offset, reason), and the migration of a segment written in an older
format version (:data:`~rollpoint.store.journal_format.MIGRATIONS`): its bytes are rewritten
in the current version, atomically, and the original is kept beside it as
``<name>.v<version>``. It changes nothing else: setting aside what follows a cut is the
journal's (:mod:`rollpoint.store.journal`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from rollpoint.protocol.errors import JournalFormatError
from rollpoint.store.filesystem import Filesystem
from rollpoint.store.journal_format import (
    FORMAT_VERSION,
    HEADER,
    MIGRATIONS,
    Damage,
    SegmentHeader,
    decode_header,
    scan_frames,
    segment_name,
    segment_number,
)

__all__ = ["JournalScan", "Placement", "Position", "scan"]

log = logging.getLogger("rollpoint.store.journal")
"""The journal's logger: a cut is the journal's news, whichever module finds it."""


class Position(NamedTuple):
    """A place in a journal: the end of a record (or of a segment's header)."""

    segment: int
    offset: int


class Placement(NamedTuple):
    """Where one record sits: its segment, and its frame's start and end in it."""

    segment: int
    offset: int
    end: int


@dataclass
class JournalScan:
    """What a scan found: the trusted extent of each segment and every record's place."""

    limits: dict[int, int] = field(default_factory=dict)
    """Segment number → where its trusted records end."""
    index: dict[str, Placement] = field(default_factory=dict)
    cut: Position | None = None
    """Where the first damage was; nothing from there on is trusted."""
    untrusted: list[str] = field(default_factory=list)
    """Segment files after the cut (names)."""
    records: int = 0


def scan(fs: Filesystem, folder: str) -> JournalScan:
    """Read every segment of ``folder`` once; warn (file and offset) at the first damage.
    A segment of an older format version is migrated first (:func:`_migrate`)."""
    found = sorted(
        (number, name)
        for name in fs.listdir(folder)
        if (number := segment_number(name)) is not None
    )
    result = JournalScan()
    datas: list[tuple[int, str, bytes, SegmentHeader | None]] = []
    for number, name in found:
        path = fs.join(folder, name)
        data = fs.read_bytes(path)
        header: SegmentHeader | None = None
        try:
            header = decode_header(data, path)
        except JournalFormatError as exc:
            # A segment too short or unreadable is damage (a crash while creating it);
            # a version we do not know is refused: its records may be fine.
            if "format version" in exc.message or "flags" in exc.message:
                raise
        if header is not None and header.segment != number:
            raise JournalFormatError(f"journal segment {path}: its header says {header.segment}")
        if header is not None and header.version != FORMAT_VERSION:
            data, header = _migrate(fs, path, data, header)
        datas.append((number, path, data, header))
    for i, (number, path, data, header) in enumerate(datas):
        if result.cut is not None:
            result.untrusted.append(path.rsplit("/", 1)[-1])
            continue
        if header is None:
            _warn_cut(path, 0, "header missing or damaged", len(data))
            result.cut = Position(number, 0)
            result.untrusted.append(path.rsplit("/", 1)[-1])
            continue
        # Segments are numbered without gaps (a writer's next segment is the last one's
        # number plus one, a cut's new segment takes the number after the cut, retention
        # deletes only the oldest): a number missing between two segments is a segment
        # lost, and nothing after it is trusted, the next segment's prev_end included.
        lost = i + 1 < len(datas) and datas[i + 1][0] != number + 1
        follower = datas[i + 1][3] if i + 1 < len(datas) and not lost else None
        limit = follower.prev_end if follower is not None else len(data)
        if limit > len(data):
            _warn_cut(path, len(data), f"segment ends before {limit}, where the next begins", 0)
            limit = len(data)
            result.cut = Position(number, limit)
        for frame in scan_frames(data, HEADER, limit):
            if isinstance(frame, Damage):
                _warn_cut(path, frame.offset, frame.reason, limit - frame.offset)
                result.cut = Position(number, frame.offset)
                limit = frame.offset
                break
            result.index[frame.key] = Placement(number, frame.offset, frame.end)
            result.records += 1
        result.limits[number] = limit
        if lost and result.cut is None:
            missing = fs.join(folder, segment_name(number + 1))
            later = sum(len(d[2]) for d in datas[i + 1 :])
            _warn_cut(missing, 0, "segment missing (lost)", later)
            result.cut = Position(number, limit)
    return result


def _warn_cut(path: str, offset: int, reason: str, dropped: int) -> None:
    log.warning(
        "journal %s: %s at offset %d; cut there (%d bytes and every later record not trusted)",
        path,
        reason,
        offset,
        dropped,
    )


def _migrate(
    fs: Filesystem, path: str, data: bytes, header: SegmentHeader
) -> tuple[bytes, SegmentHeader]:
    """``data`` (a segment of an older version) in the current version, written in its
    place; the original is kept as ``<path>.v<version>``."""
    migrated = MIGRATIONS[header.version](data)
    new_header = decode_header(migrated, path)
    if new_header.version != FORMAT_VERSION:
        raise JournalFormatError(
            f"journal segment {path}: the migration from version {header.version} "
            f"gave version {new_header.version}, not {FORMAT_VERSION}"
        )
    backup = f"{path}.v{header.version}"
    if not fs.exists(backup):
        fs.write_bytes(backup, data)
    fs.publish_bytes(path, migrated)
    log.warning(
        "journal %s: migrated from format version %d to %d (original kept as %s)",
        path,
        header.version,
        FORMAT_VERSION,
        backup,
    )
    return migrated, new_header


@dataclass
class JournalSummary:
    """What ``rollpoint inspect`` shows of one journal folder (read-only: nothing migrated,
    cut or renamed)."""

    records: int = 0
    bytes: int = 0
    """Of the trusted records' frames."""
    segments: int = 0
    last_key: str | None = None
    last_kind: str | None = None
    last_position: Position | None = None
    """The end of the last durable record (what a cut opening now would name)."""
    damage: str | None = None
    """The first damage met, as ``file at offset: reason`` (nothing after it is trusted)."""

    def as_json(self) -> dict[str, object]:
        return {
            "records": self.records,
            "bytes": self.bytes,
            "segments": self.segments,
            "last_key": self.last_key,
            "last_kind": self.last_kind,
            "last_position": None if self.last_position is None else list(self.last_position),
            "damage": self.damage,
        }


def summarize(fs: Filesystem, folder: str) -> JournalSummary:
    """Count the trusted records of ``folder`` and find the last one, reading each segment
    once and changing nothing (a live server may be appending: what it appends after the
    read is not counted)."""
    found = sorted(
        (number, name)
        for name in fs.listdir(folder)
        if (number := segment_number(name)) is not None
    )
    out = JournalSummary(segments=len(found))
    datas = [(number, fs.join(folder, name)) for number, name in found]
    loaded = [(number, path, fs.read_bytes(path)) for number, path in datas]
    for i, (number, path, data) in enumerate(loaded):
        try:
            header = decode_header(data, path)
        except JournalFormatError as exc:
            out.damage = exc.message
            return out
        if header.version != FORMAT_VERSION:
            out.damage = f"{path}: format version {header.version} (migrated when opened)"
            return out
        follower = None
        if i + 1 < len(loaded):
            with contextlib.suppress(JournalFormatError):
                follower = decode_header(loaded[i + 1][2], loaded[i + 1][1])
        limit = min(len(data), follower.prev_end) if follower is not None else len(data)
        for frame in scan_frames(data, HEADER, limit):
            if isinstance(frame, Damage):
                out.damage = f"{path} at offset {frame.offset}: {frame.reason}"
                return out
            out.records += 1
            out.bytes += frame.end - frame.offset
            out.last_key, out.last_kind = frame.key, frame.kind
            out.last_position = Position(number, frame.end)
    return out
