"""Damage to a participant's journal between a crash and its rerun, as a disk or a kill
leaves it: what ``rollpoint chaos``'s journal faults do (docs/journal.md, "Reading back,
and damage").

Owns choosing the journal of one participant kind in a local store (the one written last:
its newest segment is the newest of that kind) and damaging it one :class:`JournalDamage`
way. What the journal promises for each: a torn tail or a corrupt record is cut at the
last whole record before it, with a warning naming the file and offset; a lost segment
cuts the journal where the segment before it ends, with a warning naming the lost file;
nothing after the damage is trusted (later segments are set aside as ``*.untrusted``).
The rerun must then go on with every row trained once. It reads the journal's folders
directly (the layout of :mod:`rollpoint.store.journal`) and judges nothing: the
invariants do.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from rollpoint.store.journal_format import HEADER, Damage, Frame, scan_frames, segment_number
from rollpoint.store.journal_retention import JOURNAL_DIR


class JournalDamage(StrEnum):
    TORN_TAIL = "torn_tail"
    """Half of a copy of the newest segment's last record appended to it: a record cut
    short by a kill (or a power cut) while it was written, never acknowledged."""
    CORRUPT_RECORD = "corrupt_record"
    """One byte flipped in the newest segment's last record: its checksum fails, so the
    journal is cut before it and its call is done again (as one in flight)."""
    LOST_SEGMENT = "lost_segment"
    """The segment before the newest one deleted (when one is before it too): every record
    after it is not trusted."""


class NothingToDamage(Exception):
    """The store holds no journal the fault can damage that way; the message says why."""


def _segments(folder: Path) -> list[tuple[int, Path]]:
    return sorted(
        (number, p) for p in folder.iterdir() if (number := segment_number(p.name)) is not None
    )


def _frames(path: Path) -> list[Frame]:
    data = path.read_bytes()
    found = []
    for frame in scan_frames(data, HEADER, len(data)):
        if isinstance(frame, Damage):
            break
        found.append(frame)
    return found


def newest_journal(store: Path, kind: str) -> Path:
    """The journal folder of ``kind`` (``model``, ``resources``, ``agent``) written last."""
    base = store / JOURNAL_DIR / kind
    folders = [f for f in sorted(base.iterdir()) if f.is_dir()] if base.is_dir() else []
    written = [(max(p.stat().st_mtime for _, p in s), f) for f in folders if (s := _segments(f))]
    if not written:
        raise NothingToDamage(f"no {kind} journal in {store}")
    return max(written)[1]


def damage_journal(store: Path, how: JournalDamage, kind: str) -> str:
    """Damage the ``kind`` journal written last in ``store``; say what was done."""
    folder = newest_journal(store, kind)
    segments = _segments(folder)
    if how is JournalDamage.LOST_SEGMENT:
        # One between two: a journal's oldest segment gone reads as retention's work (see
        # docs/journal.md on what a restore does not check), so it would test nothing.
        if len(segments) < 3:
            raise NothingToDamage(
                f"journal {folder} has {len(segments)} segment(s): none between two others"
            )
        _, lost = segments[-2]
        lost.unlink()
        return f"journal {lost}: deleted (a lost segment)"
    with_records = [(path, frames) for _, path in segments if (frames := _frames(path))]
    if not with_records:
        raise NothingToDamage(f"journal {folder} holds no record")
    path, frames = with_records[-1]
    last = frames[-1]
    data = bytearray(path.read_bytes())
    if how is JournalDamage.TORN_TAIL:
        # At the end of the newest segment (maybe empty: just started), where a writer was.
        whole = bytes(data[last.offset : last.end])
        torn = whole[: max(1, len(whole) // 2)]
        _, tail = segments[-1]
        at = tail.stat().st_size
        with tail.open("ab") as segment:
            segment.write(torn)
        return f"journal {tail}: a record torn at offset {at} ({len(torn)} of {len(whole)} bytes)"
    data[(last.offset + last.end) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return f"journal {path}: a byte flipped in the record at offset {last.offset}"
