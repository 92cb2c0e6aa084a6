"""The journal's on-disk format: segment headers, record frames, and the scan that trusts them.

Owns the bytes of one journal segment and nothing above them (which segments exist, group
commit, the index: :mod:`rollpoint.store.journal`). A segment is one file::

    header   28 bytes, little-endian
             magic       8   b"RPJRNL\\x00\\x01"
             version     u16 FORMAT_VERSION (2 bytes)
             flags       u16 0 (reserved; a reader refuses bits it does not know)
             segment     u32 this segment's number (its file name says it too)
             prev_end    u64 where the previous segment's trusted records end (0: none)
             crc         u32 crc32c of the 24 bytes before it
    record*  one frame per record, back to back:
             length      u32 of the body
             crc         u32 crc32c of the length's 4 bytes, then the body
             body        flags u8 | kind_len u8 | key_len u16 | kind | key | payload

``prev_end`` is how a writer that found a torn tail says where it cut, without truncating
anything: a reader reads segment *n* only up to segment *n + 1*'s ``prev_end``.

Checksums are CRC-32C (Castagnoli), the checksum of ext4 metadata, iSCSI, LevelDB and
Kafka, computed by the ``crc32c`` package with the CPU's CRC instruction where it has one
(3.6x zlib.crc32's speed on a 9 KB record on the dev machine). A CRC detects every burst
of up to 32 flipped bits; xxhash, the other candidate, is a fast hash with no such bound.

A version this reader does not know is refused with :class:`JournalFormatError` naming the
file (:data:`MIGRATIONS` is where a reader of version *n + 1* says how to read *n*).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from rollpoint.protocol.errors import BadRequestError, JournalFormatError
from rollpoint.protocol.ids import is_identifier

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "MIGRATIONS",
    "Damage",
    "Frame",
    "SegmentHeader",
    "decode_header",
    "encode_header",
    "encode_record",
    "journal_key",
    "scan_frames",
    "segment_name",
    "segment_number",
]

MAGIC = b"RPJRNL\x00\x01"
FORMAT_VERSION = 1
Checksum = Callable[[bytes | memoryview, int], int]


@functools.cache
def _crc32c() -> Checksum:
    """The ``crc32c`` package's function, imported on first use: the package's own import
    loads its command line (argparse) and reads its metadata, ~25 ms of CPU in every
    process that imports the store, which most never append to a journal."""
    from crc32c import crc32c

    return crc32c


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing ``value``."""
    return _crc32c()(data, value)


_HEADER = struct.Struct("<8sHHIQ")
_CRC = struct.Struct("<I")
HEADER = _HEADER.size + _CRC.size
"""Bytes of a segment header (28)."""
_FRAME = struct.Struct("<II")
_BODY = struct.Struct("<BBH")
FLAG_JSON = 0x01
"""The payload is orjson-encoded (``append_json``); readers decode it on request."""
_KNOWN_FLAGS = FLAG_JSON
MAX_RECORD_BYTES = 256 << 20
"""A length above this is damage, not a record: it bounds what a corrupt length makes us read."""
SUFFIX = ".rpj"

MIGRATIONS: dict[int, Callable[[bytes], bytes]] = {}
"""Older format version → a function turning such a segment's bytes into the current
version's. Empty: version 1 is the first. A version neither current nor here is refused."""


def journal_key(
    participant: str, rollout_id: str, attempt: int, turn: int, call: int | None = None
) -> str:
    """The one stable string a unit of work is journaled under (and, in issue 36, the
    idempotency key a tool sees): ``model|r7f3a|a0|t3|c1``; an agent's turn has no call index
    (``agent|r7f3a|a0|t3``). Refused (:class:`BadRequestError`, naming it) when a part could
    make two keys equal: a rollout id that is not an identifier, a negative number, a
    participant kind with ``|`` in it."""
    if not is_identifier(rollout_id):
        raise BadRequestError(f"journal key: rollout id {rollout_id!r} is not an identifier")
    if not participant or "|" in participant:
        raise BadRequestError(f"journal key: participant kind {participant!r} is empty or has '|'")
    numbers = {"attempt": attempt, "turn": turn, "call": 0 if call is None else call}
    for name, value in numbers.items():
        if value < 0:
            raise BadRequestError(f"journal key of {rollout_id}: {name} {value} is negative")
    key = f"{participant}|{rollout_id}|a{attempt}|t{turn}"
    return key if call is None else f"{key}|c{call}"


def segment_name(number: int) -> str:
    return f"segment-{number:010d}{SUFFIX}"


def segment_number(name: str) -> int | None:
    """The number in a segment's file name; None for any other file."""
    if not (name.startswith("segment-") and name.endswith(SUFFIX)):
        return None
    digits = name[len("segment-") : -len(SUFFIX)]
    return int(digits) if digits.isdigit() and len(digits) == 10 else None


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    segment: int
    prev_end: int
    version: int = FORMAT_VERSION


def encode_header(header: SegmentHeader) -> bytes:
    head = _HEADER.pack(MAGIC, header.version, 0, header.segment, header.prev_end)
    return head + _CRC.pack(crc32c(head))


def decode_header(data: bytes, file: str) -> SegmentHeader:
    """The header at the start of ``data``; refused (one line naming ``file``) unless whole,
    of a known version and unchanged since written."""
    if len(data) < HEADER:
        raise JournalFormatError(
            f"journal segment {file}: {len(data)} bytes, shorter than its {HEADER}-byte header"
        )
    magic, version, flags, segment, prev_end = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise JournalFormatError(f"journal segment {file}: not a rollpoint journal (bad magic)")
    (crc,) = _CRC.unpack_from(data, _HEADER.size)
    if crc != crc32c(data[: _HEADER.size]):
        raise JournalFormatError(f"journal segment {file}: header checksum mismatch")
    if version != FORMAT_VERSION and version not in MIGRATIONS:
        raise JournalFormatError(
            f"journal segment {file}: format version {version}, this rollpoint reads "
            f"{FORMAT_VERSION}{''.join(f', {v}' for v in sorted(MIGRATIONS))}; "
            "upgrade rollpoint to read it"
        )
    if flags:
        raise JournalFormatError(f"journal segment {file}: unknown header flags {flags:#x}")
    return SegmentHeader(segment=segment, prev_end=prev_end, version=version)


def encode_record(key: str, kind: str, payload: bytes, *, json: bool = False) -> bytes:
    """One record's frame, ready to append."""
    key_bytes = key.encode()
    kind_bytes = kind.encode()
    if len(kind_bytes) > 0xFF:
        raise JournalFormatError(f"journal record kind {kind[:40]!r}…: longer than 255 bytes")
    if len(key_bytes) > 0xFFFF:
        raise JournalFormatError(f"journal record key {key[:40]!r}…: longer than 65535 bytes")
    # The frame is joined once: the checksum runs over the parts, so the payload (most of
    # the record) is copied once, into the frame.
    fields = _BODY.pack(FLAG_JSON if json else 0, len(kind_bytes), len(key_bytes))
    fields += kind_bytes + key_bytes
    size = len(fields) + len(payload)
    if size > MAX_RECORD_BYTES:
        raise JournalFormatError(f"journal record {key!r}: {size} bytes, over the maximum")
    length = _CRC.pack(size)
    crc32c = _crc32c()
    crc = crc32c(payload, crc32c(fields, crc32c(length, 0)))
    return b"".join((length, _CRC.pack(crc), fields, payload))


class Frame(NamedTuple):
    """One whole record as read: where it starts and ends in its segment, and its fields."""

    offset: int
    end: int
    key: str
    kind: str
    payload: bytes
    json: bool


@dataclass(frozen=True, slots=True)
class Damage:
    """Where a scan stopped trusting a segment, and why."""

    offset: int
    reason: str


def scan_frames(data: bytes, start: int, limit: int) -> Iterator[Frame | Damage]:
    """Every whole frame of a segment's ``data`` from ``start`` up to ``limit``, in order;
    at the first frame that is cut short or fails its checksum, one :class:`Damage` and
    nothing after it (a later frame that looks whole is not trusted either)."""
    view = memoryview(data)
    crc32c = _crc32c()
    offset = start
    while offset < limit:
        if limit - offset < _FRAME.size:
            yield Damage(offset, f"{limit - offset} bytes, shorter than a record's frame")
            return
        length, crc = _FRAME.unpack_from(data, offset)
        body_at = offset + _FRAME.size
        if length < _BODY.size or length > MAX_RECORD_BYTES:
            yield Damage(offset, f"impossible record length {length}")
            return
        end = body_at + length
        if end > limit:
            yield Damage(offset, f"record of {length} bytes cut short at {limit}")
            return
        if crc != crc32c(view[body_at:end], crc32c(view[offset : offset + 4], 0)):
            yield Damage(offset, "record checksum mismatch")
            return
        flags, kind_len, key_len = _BODY.unpack_from(data, body_at)
        fields_at = body_at + _BODY.size
        payload_at = fields_at + kind_len + key_len
        if flags & ~_KNOWN_FLAGS or payload_at > end:
            yield Damage(offset, f"record fields do not fit (flags {flags:#x})")
            return
        try:
            kind = bytes(view[fields_at : fields_at + kind_len]).decode()
            key = bytes(view[fields_at + kind_len : payload_at]).decode()
        except UnicodeDecodeError:
            yield Damage(offset, "record key or kind is not UTF-8")
            return
        yield Frame(offset, end, key, kind, bytes(view[payload_at:end]), bool(flags & FLAG_JSON))
        offset = end
