"""One participant's exported state on disk: a records file, then its manifest.

Owns the participant state folder (a local path or an fsspec URL, one per participant
per snapshot)::

    <directory>/records-<first 16 hex of its sha256>.jsonl   one JSON object per line
    <directory>/manifest.json                                ParticipantManifest, written last

The records file is written first (to a temp name, hashed while written, then renamed
after its digest, so a named records file is immutable) and the manifest last: a folder
without its manifest holds no state. Readers check the manifest's kind, instance and
checkpoint id, the records file's size, digest and record count before returning
anything; every failure is an :class:`InvalidCheckpointStateError` naming the file and
what differs.

Given the store's ``root``, a local folder is read and written through
:class:`~rollpoint.store.contained_filesystem.ContainedFilesystem`: each file is opened
inside the root at the moment it is opened, never through a symlink.

It does not know what a record means (each participant does) nor where the folder sits
in a snapshot (:mod:`rollpoint.store.snapshot_store`). Records are encoded with orjson:
non-finite floats are written as ``null``; a
:class:`~rollpoint.store.deferred_value.DeferredValue` anywhere in a record is made here,
in the writer's thread, and written as its value (a participant defers work its snapshot
pause need not pay for). Decoding runs with the cyclic garbage collector paused
(:mod:`rollpoint.store.collector_pause`): decoded JSON holds no reference cycles, but each
of its millions of containers counts toward the collector's thresholds, and the collections
that triggered over a growing heap took three quarters of a restore's time.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, BinaryIO, NamedTuple

import orjson

from rollpoint.protocol.errors import (
    BadRequestError,
    CheckpointConflictError,
    InvalidCheckpointStateError,
    SnapshotError,
)
from rollpoint.protocol.ids import is_identifier
from rollpoint.protocol.manifest import (
    ParticipantManifest,
    decode_document,
    encode_document,
    load_participant_manifest,
)
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.collector_pause import collector_paused
from rollpoint.store.contained_filesystem import filesystem_within
from rollpoint.store.deferred_value import DeferredValue
from rollpoint.store.digest import iter_blocks
from rollpoint.store.filesystem import Filesystem, filesystem_for

MANIFEST_NAME = "manifest.json"
_TARGET_CHUNK_BYTES = 8 << 20
"""Records are encoded and written in chunks of about this size: one join, one write each."""
_FIRST_CHUNK_RECORDS = 256


class _Written(NamedTuple):
    sha256: str
    records: int
    size: int


def records_file_name(sha256: str) -> str:
    return f"records-{sha256[:16]}.jsonl"


def write_participant_state(
    directory: str,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Sequence[Mapping[str, Any]],
    root: str | None = None,
) -> ParticipantManifest:
    """Write ``records`` and then their manifest into ``directory``; return the manifest.

    Writing the same state again (a retried commit) returns the existing manifest; any
    other state already published in ``directory`` is a :class:`CheckpointConflictError`.
    With ``root`` (the store's root, ``directory`` inside it), every file is opened inside
    it without following a symlink (:func:`_filesystem`).
    """
    participant_kind = _check_identity(kind, instance, checkpoint_id)
    fs = _filesystem(directory, root)
    manifest_path = fs.join(directory, MANIFEST_NAME)
    existing = _existing_manifest(fs, manifest_path)
    if existing is not None:
        return _confirm_retry(
            existing, manifest_path, participant_kind, instance, checkpoint_id, records
        )
    try:
        fs.makedirs(directory)
        written = _write_records(fs, directory, records)
        manifest = ParticipantManifest(
            kind=participant_kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            records_file=records_file_name(written.sha256),
            sha256=written.sha256,
            count=written.records,
            bytes=written.size,
            written_at=time.time(),
        )
        fs.publish_bytes(manifest_path, encode_document(manifest))
    except OSError as exc:
        raise SnapshotError(f"cannot write participant state in {directory}: {exc}") from None
    return manifest


def read_participant_state(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str | None = None
) -> tuple[ParticipantManifest, list[dict[str, Any]]]:
    """The verified manifest and records of one participant's state in ``directory``
    (inside ``root`` when given, as :func:`write_participant_state`)."""
    fs = _filesystem(directory, root)
    manifest = _read_manifest(fs, directory, kind, instance, checkpoint_id)
    records: list[dict[str, Any]] = []
    _scan_records(fs, directory, manifest, records)
    return manifest, records


def verify_participant_state(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str | None = None
) -> ParticipantManifest:
    """Check the state in ``directory`` as :func:`read_participant_state` does, decoding nothing."""
    fs = _filesystem(directory, root)
    manifest = _read_manifest(fs, directory, kind, instance, checkpoint_id)
    _scan_records(fs, directory, manifest, None)
    return manifest


def _filesystem(directory: str, root: str | None) -> Filesystem:
    """Without ``root``: ``directory``'s own filesystem. With it: for a local root, one
    that checks each open inside the root at the moment it happens, so a symlink put in
    the store after the request was checked (between a commit and its confirm) is refused
    rather than followed out of it."""
    return filesystem_for(directory) if root is None else filesystem_within(root, directory)


# --- writing ---------------------------------------------------------------------------


def _check_identity(kind: str, instance: str, checkpoint_id: str) -> ParticipantKind:
    try:
        participant_kind = ParticipantKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in ParticipantKind)
        raise BadRequestError(f"unknown participant kind {kind!r} (expected {known})") from None
    for label, value in (("instance", instance), ("checkpoint id", checkpoint_id)):
        if not is_identifier(value):
            raise BadRequestError(f"{label} {value!r} is not a valid identifier")
    return participant_kind


def _existing_manifest(fs: Filesystem, manifest_path: str) -> ParticipantManifest | None:
    try:
        data = fs.read_bytes(manifest_path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidCheckpointStateError(f"cannot read {manifest_path}: {exc}") from None
    what = f"participant manifest {manifest_path}"
    return load_participant_manifest(decode_document(data, what), what)


def _confirm_retry(
    existing: ParticipantManifest,
    manifest_path: str,
    kind: ParticipantKind,
    instance: str,
    checkpoint_id: str,
    records: Sequence[Mapping[str, Any]],
) -> ParticipantManifest:
    same = (existing.kind, existing.instance, existing.checkpoint_id) == (
        kind,
        instance,
        checkpoint_id,
    )
    if same:
        # Hash only: a retry must not touch the published files.
        hasher = hashlib.sha256()
        count = 0
        for chunk, chunk_count in _encode_chunks(records):
            hasher.update(chunk)
            count += chunk_count
        same = (existing.sha256, existing.count) == (hasher.hexdigest(), count)
    if not same:
        raise CheckpointConflictError(
            f"{manifest_path} already holds a different commit ({existing.kind} "
            f"{existing.instance}, checkpoint {existing.checkpoint_id}, {existing.count} records)"
        )
    return existing


def _write_records(
    fs: Filesystem, directory: str, records: Sequence[Mapping[str, Any]]
) -> _Written:
    temp = fs.join(directory, f".records-{uuid.uuid4().hex}.tmp")
    hasher = hashlib.sha256()
    count = size = 0
    try:
        with (
            fs.open_write(temp) as stream,
            ThreadPoolExecutor(1, thread_name_prefix="rollpoint-hash") as hashing,
            ThreadPoolExecutor(1, thread_name_prefix="rollpoint-write") as writing,
        ):
            # Three stages: this thread encodes the next chunk (orjson holds the GIL) while
            # one thread hashes the last one and another writes it (both release the GIL).
            # Agent sessions' exports, 254 MiB, 2 cores, 6 runs alternated: 0.56-1.04 s with
            # hashing and writing in one thread, 0.62-0.74 s apart (before sessions kept
            # their transcripts encoded, encoding dominated and a third stage did not pay).
            # At most one chunk waits beyond the one being encoded.
            pending: list[Future[Any]] = []
            for chunk, chunk_count in _encode_chunks(records):
                _wait_all(pending)
                pending = [
                    hashing.submit(hasher.update, chunk),
                    writing.submit(stream.write, chunk),
                ]
                count += chunk_count
                size += len(chunk)
            _wait_all(pending)
        digest = hasher.hexdigest()
        fs.rename(temp, fs.join(directory, records_file_name(digest)))
    except BaseException:
        fs.remove_file(temp)
        raise
    fs.sync_dir(directory)
    return _Written(digest, count, size)


def _wait_all(pending: list[Future[Any]]) -> None:
    """Wait for a chunk's hash and write; the first failure raises, after both ended (the
    stream must not be closed under a write still running)."""
    wait(pending)
    for future in pending:
        future.result()


def _encode_chunks(records: Sequence[Mapping[str, Any]]) -> Iterator[tuple[bytes, int]]:
    """``(bytes, record count)`` chunks of newline-terminated JSON lines, ~8 MiB each.

    Chunks bound memory to two chunks beyond the records themselves (one being written,
    one being encoded); the chunk size adapts to the records' average encoded size.
    """
    start, step = 0, _FIRST_CHUNK_RECORDS
    while start < len(records):
        batch = records[start : start + step]
        try:
            lines = [orjson.dumps(record, default=_encode_other) for record in batch]
        except (TypeError, orjson.JSONEncodeError):
            raise _unencodable(batch, start) from None
        lines.append(b"")  # one join then ends the chunk with a newline, without a copy
        chunk = b"\n".join(lines)
        yield chunk, len(batch)
        start += len(batch)
        step = max(1, min(65536, _TARGET_CHUNK_BYTES * len(batch) // len(chunk)))


def _encode_other(value: object) -> object:
    """orjson's ``default``: called for every value it cannot encode itself."""
    if isinstance(value, DeferredValue):
        return value.value()
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def _unencodable(batch: Sequence[Mapping[str, Any]], start: int) -> InvalidCheckpointStateError:
    for offset, record in enumerate(batch):
        if not isinstance(record, Mapping):
            return InvalidCheckpointStateError(
                f"record {start + offset} is a {type(record).__name__}, not a mapping"
            )
        try:
            orjson.dumps(record, default=_encode_other)
        except (TypeError, orjson.JSONEncodeError) as exc:
            # orjson reports what ``default`` raised only as the cause of its own
            # "Type is not JSON serializable": the cause says what went wrong.
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            return InvalidCheckpointStateError(
                f"record {start + offset} cannot be encoded: {cause}"
            )
    return InvalidCheckpointStateError(
        f"records {start}..{start + len(batch) - 1} cannot be encoded"
    )


# --- reading ---------------------------------------------------------------------------


def _read_manifest(
    fs: Filesystem, directory: str, kind: str, instance: str, checkpoint_id: str
) -> ParticipantManifest:
    manifest_path = fs.join(directory, MANIFEST_NAME)
    manifest = _existing_manifest(fs, manifest_path)
    if manifest is None:
        raise InvalidCheckpointStateError(
            f"no participant state in {directory}: {MANIFEST_NAME} is missing "
            "(a folder without its manifest holds no state)"
        )
    expected = {"kind": kind, "instance": instance, "checkpoint_id": checkpoint_id}
    found = {
        "kind": manifest.kind.value,
        "instance": manifest.instance,
        "checkpoint_id": manifest.checkpoint_id,
    }
    differences = [
        f"{field} is {found[field]!r}, expected {want!r}"
        for field, want in expected.items()
        if found[field] != want
    ]
    if differences:
        raise InvalidCheckpointStateError(f"{manifest_path}: " + "; ".join(differences))
    if manifest.records_file != records_file_name(manifest.sha256):
        raise InvalidCheckpointStateError(
            f"{manifest_path}: names records file {manifest.records_file!r}, but its digest "
            f"makes it {records_file_name(manifest.sha256)!r}"
        )
    return manifest


def _scan_records(
    fs: Filesystem,
    directory: str,
    manifest: ParticipantManifest,
    into: list[dict[str, Any]] | None,
) -> None:
    """Hash and count the records file; decode each line into ``into`` when given."""
    path = fs.join(directory, manifest.records_file)
    try:
        size = fs.size(path)
        if size != manifest.bytes:
            raise InvalidCheckpointStateError(
                f"records file {path} is {size} bytes, its manifest says {manifest.bytes}: "
                "truncated or tampered"
            )
        with fs.open_read(path) as stream:
            sha256, count, bad_line = _hash_and_decode(stream, into)
    except FileNotFoundError:
        raise InvalidCheckpointStateError(
            f"records file {path} named by its manifest is missing"
        ) from None
    except OSError as exc:
        raise InvalidCheckpointStateError(f"cannot read records file {path}: {exc}") from None
    if sha256 != manifest.sha256:
        raise InvalidCheckpointStateError(
            f"records file {path} does not match its manifest's digest (tampered or corrupt): "
            f"sha256 {sha256[:16]}…, expected {manifest.sha256[:16]}…"
        )
    if count != manifest.count:
        raise InvalidCheckpointStateError(
            f"records file {path} holds {count} records, its manifest says {manifest.count}"
        )
    if bad_line is not None:
        raise InvalidCheckpointStateError(f"records file {path}: {bad_line}")


def _hash_and_decode(
    stream: BinaryIO, into: list[dict[str, Any]] | None
) -> tuple[str, int, str | None]:
    if into is None:
        return _hash_and_decode_lines(stream, None)
    with collector_paused():
        return _hash_and_decode_lines(stream, into)


def _hash_and_decode_lines(
    stream: BinaryIO, into: list[dict[str, Any]] | None
) -> tuple[str, int, str | None]:
    """``(sha256, line count, first decoding problem)`` of a JSON-lines stream, one pass.

    Decoding stops at the first bad line, hashing never does: a tampered file must be
    reported as tampered, not as whatever its first broken line looks like.
    """
    hasher = hashlib.sha256()
    newlines = decoded = 0
    last = b"\n"
    problem: str | None = None
    decoding = into is not None
    tail = b""
    for block in iter_blocks(stream):
        hasher.update(block)
        newlines += block.count(b"\n")
        last = block[-1:]
        if not decoding or into is None:
            continue
        lines = (tail + block).split(b"\n")
        tail = lines.pop()
        for line in lines:
            decoded += 1
            problem = _decode_line(line, decoded, into)
            if problem is not None:
                decoding = False
                break
    count = newlines + (0 if last == b"\n" else 1)
    if decoding and into is not None and tail:
        problem = _decode_line(tail, count, into)
    return hasher.hexdigest(), count, problem


def _decode_line(line: bytes, number: int, into: list[dict[str, Any]]) -> str | None:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        return f"line {number} is not valid JSON: {exc}"
    if not isinstance(record, dict):
        return f"line {number} is a JSON {type(record).__name__}, not an object"
    into.append(record)
    return None
