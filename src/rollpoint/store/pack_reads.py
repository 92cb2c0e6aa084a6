"""Reading the parts of records files a manifest names: every byte verified as it is read.

Owns :func:`read_parts` (each part's size, digest and line count checked, its lines decoded
when asked, the first problem one :class:`InvalidCheckpointStateError` naming the file) and
the checks of a records manifest itself (:func:`check_totals`: its parts add up to what it
states; :func:`check_identity`: it is whose, and of which checkpoint, it should be). The
files are written by :mod:`rollpoint.store.record_packs`; a part's digest covers its lines'
digests (``RecordsPart.digest``), and decoding stops at the first bad line while hashing
never does: a tampered file is reported as tampered, not as whatever its first broken line
looks like.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import orjson

from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.manifest import RecordsManifest, RecordsPart
from rollpoint.store.digest import BLOCK_BYTES
from rollpoint.store.filesystem import Filesystem

__all__ = ["check_identity", "check_totals", "read_parts"]


def check_identity(path: str, found: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Refuse the manifest at ``path`` unless each identity field ``found`` in it is the
    one ``expected``; the error names every field that differs."""
    differences = [
        f"{field} is {found[field]!r}, expected {want!r}"
        for field, want in expected.items()
        if found[field] != want
    ]
    if differences:
        raise InvalidCheckpointStateError(f"{path}: " + "; ".join(differences))


def check_totals(manifest: RecordsManifest, path: str) -> None:
    """Refuse a manifest whose parts do not add up to the count and size it states."""
    totals = (sum(p.count for p in manifest.parts), sum(p.length for p in manifest.parts))
    if totals != (manifest.count, manifest.bytes):
        raise InvalidCheckpointStateError(
            f"{path}: its parts hold {totals[0]} records in {totals[1]} bytes, "
            f"it says {manifest.count} in {manifest.bytes}"
        )


def read_parts(
    fs: Filesystem,
    parts: Sequence[RecordsPart],
    *,
    directory: str,
    objects: str | None,
    into: list[dict[str, Any]] | None,
) -> None:
    """Verify every part (size, digest, line count) and decode its lines into ``into``
    when given; the first problem is an :class:`InvalidCheckpointStateError` naming the
    file. ``directory``: the participant's folder (unshared parts); ``objects``: the
    shared records files' folder (None: a shared part is refused, naming what is missing)."""
    if objects is None and any(part.shared for part in parts):
        raise InvalidCheckpointStateError(
            f"the state in {directory} names records files shared by snapshots: "
            "read it with the store's root"
        )
    _read_all(fs, parts, directory, objects, into)


def _read_all(
    fs: Filesystem,
    parts: Sequence[RecordsPart],
    directory: str,
    objects: str | None,
    into: list[dict[str, Any]] | None,
) -> None:
    number = 0
    with contextlib.ExitStack() as files:
        opened: dict[str, tuple[BinaryIO, int]] = {}
        for part in parts:
            folder = objects if part.shared and objects is not None else directory
            path = fs.join(folder, part.file)
            try:
                if path not in opened:
                    size = fs.size(path)
                    opened[path] = (files.enter_context(fs.open_read(path)), size)
                stream, size = opened[path]
                if part.offset + part.length > size:
                    raise InvalidCheckpointStateError(
                        f"records file {path} is {size} bytes, its manifest names bytes up "
                        f"to {part.offset + part.length}: truncated or tampered"
                    )
                if stream.tell() != part.offset:
                    stream.seek(part.offset)
                number = _read_part(stream, path, part, number, into)
            except FileNotFoundError:
                raise InvalidCheckpointStateError(
                    f"records file {path} named by its manifest is missing"
                ) from None
            except OSError as exc:
                raise InvalidCheckpointStateError(
                    f"cannot read records file {path}: {exc}"
                ) from None


def _read_part(
    stream: BinaryIO,
    path: str,
    part: RecordsPart,
    number: int,
    into: list[dict[str, Any]] | None,
) -> int:
    """Hash (and decode) one part's lines; return the number of the last record read.

    Decoding stops at the first bad line, hashing never does: a tampered file must be
    reported as tampered, not as whatever its first broken line looks like."""
    by_lines = part.digest == "lines"
    whole = hashlib.sha256()
    lines_seen = 0
    problem: str | None = None
    tail = b""
    remaining = part.length
    for block in read_blocks(stream, remaining):
        if not by_lines:
            whole.update(block)
        lines = (tail + block).split(b"\n")
        tail = lines.pop()
        for line in lines:
            lines_seen += 1
            if by_lines:
                whole.update(hashlib.sha256(line).digest())
            if into is not None and problem is None:
                problem = _decode_line(line, number + lines_seen, into)
    if tail:
        # The part does not end with a newline: its last line counts, and is refused below.
        lines_seen += 1
        if by_lines:
            whole.update(hashlib.sha256(tail).digest())
    if whole.hexdigest() != part.sha256:
        raise InvalidCheckpointStateError(
            f"records file {path} does not match its manifest's digest at bytes "
            f"{part.offset}..{part.offset + part.length} (tampered or corrupt)"
        )
    if lines_seen != part.count:
        raise InvalidCheckpointStateError(
            f"records file {path} holds {lines_seen} records at bytes {part.offset}.."
            f"{part.offset + part.length}, its manifest says {part.count}"
        )
    if tail:
        raise InvalidCheckpointStateError(f"records file {path}: its last line has no newline")
    if problem is not None:
        raise InvalidCheckpointStateError(f"records file {path}: {problem}")
    return number + lines_seen


def read_blocks(stream: BinaryIO, length: int) -> Iterator[bytes]:
    """The next ``length`` bytes of ``stream`` in blocks (fewer if it ends first)."""
    while length > 0:
        block = stream.read(min(BLOCK_BYTES, length))
        if not block:
            return
        length -= len(block)
        yield block


def _decode_line(line: bytes, number: int, into: list[dict[str, Any]]) -> str | None:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        return f"line {number} is not valid JSON: {exc}"
    if not isinstance(record, dict):
        return f"line {number} is a JSON {type(record).__name__}, not an object"
    into.append(record)
    return None
