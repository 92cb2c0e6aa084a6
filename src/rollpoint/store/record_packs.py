"""Records files and the parts of them a participant's state names: written once, then referenced.

Owns the records files (one JSON object per line, named after the sha256 of their lines'
digests, so a named file is immutable), how a write lays a participant's records out as
:class:`~rollpoint.protocol.manifest.RecordsPart` s of them, and :class:`PackIndex`, where a
participant's last write put each record. The parts are read back and verified by
:mod:`rollpoint.store.pack_reads`.

A snapshot writes what changed since the previous one, not everything held. With a store
root, records files sit in the root's shared ``objects/`` folder::

    <root>/objects/records-<first 16 hex of the sha256 of its lines' digests>.jsonl

and each write puts only its new records into one new file (a *pack*), referencing the
others where an earlier write put them: a record is unchanged when it is the very object
the previous write was handed (participants hand out a record they never change
afterwards, and the same one again while its state does not change: the state images of
:mod:`rollpoint.participant.state_image`), or, failing that, when its encoded line has the
sha256 of a line already written. Consecutive records that sit one after the other in one
file make one part, so a steady run's manifest holds a few parts per write, not one per
record. A part's digest covers its lines' digests (see ``RecordsPart.digest``), so a run cut
out of an earlier part keeps a digest without its bytes being read again; a read hashes
every line it decodes and refuses a part whose digest differs, naming the file.

Compaction: a pack less than :data:`COMPACT_BELOW` referenced (by bytes) by a write is not
referenced by the next one: its live records are written again into that write's pack, so
what a participant's kept snapshots hold on disk stays within about twice what they
reference. Retention deletes a records file once no kept snapshot names it
(:mod:`rollpoint.store.snapshot_store`).

Safety: a write references only files its index saw written (by this process, under this
root) and that still exist when it starts; publication checks every file a snapshot names
is there, and a restore verifies every part it reads. A crash between writing a pack and
publishing leaves an unnamed file a later restore never reads and retention deletes. After
a restart the index is empty: the first write writes everything.

Without a store root (a folder written on its own), every write writes one file of all its
records in the participant's folder and references nothing.

Records are encoded with orjson: non-finite floats are written as ``null``; a
:class:`ValueMadeOnWrite` anywhere in a record is made here, in the writer's thread, and
written as its value (:class:`~rollpoint.tuning.deferred_value.DeferredValue` is one).

It does not know what a record means (each participant does), nor the manifests around the
parts (:mod:`rollpoint.store.participant_state`, :mod:`rollpoint.store.trainer_records`)
beyond what they share (:class:`~rollpoint.protocol.manifest.RecordsManifest`: the parts and
totals a write fills in, the identity a read checks), nor which snapshots are kept. Nor the
interpreter: a caller that decodes a large state pauses the garbage collector around the
read itself (:mod:`rollpoint.tuning.collector_pause`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import orjson

from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.manifest import RecordsManifest, RecordsPart
from rollpoint.store.filesystem import Filesystem
from rollpoint.store.pack_reads import read_blocks

__all__ = [
    "COMPACT_BELOW",
    "OBJECTS_DIR",
    "PackIndex",
    "PackedRecords",
    "ValueMadeOnWrite",
    "hash_records",
    "pack_records",
    "records_file_name",
]

log = logging.getLogger("rollpoint.store")

OBJECTS_DIR = "objects"
"""The store root's folder of records files shared by snapshots."""
COMPACT_BELOW = 0.5
"""A pack referenced for less than this share of its bytes is rewritten by the next write."""
_TARGET_CHUNK_BYTES = 8 << 20
"""New records are written in chunks of about this size: one join, one write each."""


def records_file_name(sha256: str) -> str:
    return f"records-{sha256[:16]}.jsonl"


_RECORDS_NAME = re.compile(r"records-[0-9a-f]{16}\.jsonl")
_RECORDS_TEMP_NAME = re.compile(r"\.records-[0-9a-f]{32}\.tmp")


def is_records_name(name: str) -> bool:
    """Whether ``name`` is one this module gives a records file: retention's sweep deletes
    nothing else (a file put in ``objects/`` by anyone else is not the store's)."""
    return _RECORDS_NAME.fullmatch(name) is not None


def is_records_temp_name(name: str) -> bool:
    """Whether ``name`` is the temp name of a records file being written."""
    return _RECORDS_TEMP_NAME.fullmatch(name) is not None


@dataclass(slots=True)
class _Placement:
    """Where one record's line sits: ``file`` ("" while its pack is being written)."""

    file: str
    offset: int
    length: int
    """Of the line, without its newline."""
    digest: bytes
    """sha256 of the line, without its newline."""


class PackIndex:
    """Where each record of a participant's last write sits, by record identity and by
    the digest of its line, and how much of each file that write referenced.

    One per participant and store root; a write reads it and :meth:`replace` s it once
    its manifest is written. Not thread-safe: a participant writes one state at a time
    (:mod:`rollpoint.participant.checkpoint_write` awaits the previous write).
    """

    __slots__ = ("_by_digest", "_by_id", "_checked", "_live", "_sizes", "_writes", "damaged")

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[object, _Placement]] = {}
        """id(record) → (the record, kept so its id is not reused, and its placement)."""
        self._by_digest: dict[bytes, _Placement] = {}
        self._sizes: dict[str, int] = {}
        self._live: dict[str, int] = {}
        self._checked: dict[str, float] = {}
        """File → when (monotonic) its bytes were last found whole (or written)."""
        self.damaged = 0
        """Records files found damaged and so written again from memory (a metric)."""
        self._writes = 0
        """Writes made with this index: every :data:`REBASE_EVERY` th references nothing."""

    def __len__(self) -> int:
        return len(self._by_id)

    def replace(self, other: PackIndex) -> None:
        """Become ``other`` (what a write made, once its manifest is written)."""
        self._by_id, self._by_digest = other._by_id, other._by_digest
        self._sizes, self._live = other._sizes, other._live
        self._checked = other._checked
        self.damaged += other.damaged
        self._writes += 1

    def clear(self) -> None:
        self.replace(PackIndex())

    def _usable(self, fs: Filesystem, folder: str) -> tuple[set[str], int]:
        """The files a new write may reference: referenced enough, and whole (of the size
        written, every time; re-hashed when last found whole :data:`REVERIFY_S` ago, or
        every time when at most :data:`REHASH_BELOW_BYTES`);
        with how many were found damaged. A damaged file is never referenced again: the
        records it held are written again, from memory, into the new pack."""
        usable = set()
        damaged = 0
        now = time.monotonic()
        for name, size in self._sizes.items():
            if self._live.get(name, 0) < COMPACT_BELOW * size:
                continue
            path = fs.join(folder, name)
            due = now - self._checked.get(name, 0) >= REVERIFY_S
            why = _damage(fs, path, name, size, rehash=due or size <= REHASH_BELOW_BYTES)
            if why is not None:
                damaged += 1
                log.warning(
                    "records file %s is damaged (%s): not referenced again; the records it "
                    "held are written again from memory",
                    path,
                    why,
                )
                continue
            self._checked.setdefault(name, now)
            usable.add(name)
        return usable, damaged


@dataclass(frozen=True, slots=True)
class PackedRecords:
    """What a write laid out: its parts, totals, and the index it makes."""

    parts: list[RecordsPart]
    count: int
    bytes: int
    written: int
    """Bytes of the new pack (0: nothing new was written)."""
    sha256: str
    """Of every line digest in record order (``ParticipantManifest.sha256``)."""
    index: PackIndex


def pack_records(
    fs: Filesystem,
    folder: str,
    records: Sequence[Mapping[str, Any]],
    index: PackIndex | None,
    *,
    shared: bool,
) -> PackedRecords:
    """Lay ``records`` out as parts of records files in ``folder``, writing a new pack of
    what ``index`` does not place; the returned index is the caller's to keep once the
    manifest naming the parts is written (``index`` itself is left as it was)."""
    previous = index if index is not None else PackIndex()
    usable, damaged = previous._usable(fs, folder) if previous._sizes else (set(), 0)
    if rebases(previous._writes):
        # A rebase: this write references no earlier file, so the snapshots before it share
        # none with those after, and retention keeps one of them as the fallback.
        usable = set()
    by_id, by_digest = previous._by_id, previous._by_digest
    placements: list[_Placement] = []
    kept: list[object] = []
    fresh: list[_Placement] = []
    by_content = bool(by_digest) and bool(usable)
    with _PackWriter(fs, folder) as writer:
        for number, record in enumerate(records):
            found = by_id.get(id(record))
            if found is not None and found[0] is record and found[1].file in usable:
                placement = found[1]
            else:
                line = _encode(record, number)
                # Every new line is hashed here, in the encoding thread: a later write may
                # reference any run of it, and a run's digest is made of its lines' ones.
                # (Hashed in a second thread instead, the per-line calls fought this one for
                # the GIL: 0.50 s against 0.33 s for 138 MiB of sessions. A whole write costs
                # ~0.1 s per 138 MiB more than one hashed as a file: snapshot_io.)
                digest = hashlib.sha256(line).digest()
                earlier = by_digest.get(digest) if by_content else None
                if earlier is not None and earlier.file in usable:
                    placement = earlier  # the same line, already in a file
                else:
                    placement = _Placement("", writer.size, len(line), digest)
                    writer.add(line, digest)
                    fresh.append(placement)
            placements.append(placement)
            kept.append(record)
        name = writer.finish()
    for placement in fresh:
        placement.file = name
    packed = _lay_out(placements, kept, previous, name, writer.size, shared)
    packed.index.damaged = damaged
    return packed


def _lay_out(
    placements: list[_Placement],
    records: list[object],
    previous: PackIndex,
    new_file: str,
    new_size: int,
    shared: bool,
) -> PackedRecords:
    parts: list[RecordsPart] = []
    total = hashlib.sha256()
    made = PackIndex()
    run: list[_Placement] = []
    length = 0
    for record, placement in zip(records, placements, strict=True):
        total.update(placement.digest)
        made._by_id[id(record)] = (record, placement)
        made._by_digest[placement.digest] = placement
        made._live[placement.file] = made._live.get(placement.file, 0) + placement.length + 1
        last = run[-1] if run else None
        if last is not None and (
            last.file != placement.file or last.offset + last.length + 1 != placement.offset
        ):
            parts.append(_part(run, shared))
            run = []
        run.append(placement)
        length += placement.length + 1
    if run:
        parts.append(_part(run, shared))
    now = time.monotonic()
    for name in made._live:
        made._sizes[name] = new_size if name == new_file else previous._sizes[name]
        # A file just written is whole; an older one keeps when it was last found so.
        made._checked[name] = now if name == new_file else previous._checked.get(name, now)
    return PackedRecords(parts, len(placements), length, new_size, total.hexdigest(), made)


def _part(run: list[_Placement], shared: bool) -> RecordsPart:
    first, last = run[0], run[-1]
    return RecordsPart(
        file=first.file,
        shared=shared,
        offset=first.offset,
        length=last.offset + last.length + 1 - first.offset,
        count=len(run),
        digest="lines",
        sha256=hashlib.sha256(b"".join(p.digest for p in run)).hexdigest(),
    )


REBASE_EVERY = 8
"""Every this many writes of one index, a write references no earlier records file (it
writes all its records): the store then always holds, once the first rebase is published,
a snapshot sharing no records file with the newest, which retention keeps as the fallback
one damaged file falls back to (:meth:`SnapshotStore._prune
<rollpoint.store.snapshot_store.SnapshotStore>`; issue 33). Costs one full write in eight."""
FIRST_REBASE = 1
"""The index's second write is a rebase too, so the fallback is there from the second
snapshot on, not from the eighth: a file damaged before then (found by a re-hash only
:data:`REVERIFY_S` later) took every snapshot down with it (two chaos trials lost their
run). A rebase of records unchanged since the write before makes the same file again."""


def rebases(writes: int) -> bool:
    """Whether the write after ``writes`` earlier ones with an index references no file."""
    return writes == FIRST_REBASE or writes % REBASE_EVERY == REBASE_EVERY - 1


REVERIFY_S = 30.0
"""A records file a new write references is re-hashed when it was last found whole this
long ago (its size is checked every time): the cost is bounded to reading each referenced
file once per this interval, and damage at rest is found within it (issue 33)."""
REHASH_BELOW_BYTES = 1 << 20
"""A records file this small is re-hashed before every write that would reference it (a
trainer's ledger pack: tens of KB). Found within :data:`REVERIFY_S` only, a byte flipped
in the ledger pack while the run lived was named by the next snapshot 0.4 s later, which
became the fallback; a second flip, at rest, of the file the newer snapshots shared then
left no snapshot to restore (chaos, the journal-mode campaign's trial 249)."""


def _damage(fs: Filesystem, path: str, name: str, size: int, *, rehash: bool) -> str | None:
    """Why the records file ``name`` at ``path`` is not the one written, or None."""
    try:
        actual = fs.size(path)
    except FileNotFoundError:
        return "deleted"
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if actual != size:
        return f"{actual} bytes, written as {size}"
    if not rehash:
        return None
    digests = hashlib.sha256()
    try:
        with fs.open_read(path) as stream:
            rest = b""
            for block in read_blocks(stream, size):
                lines = (rest + block).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    digests.update(hashlib.sha256(line).digest())
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if rest or records_file_name(digests.hexdigest()) != name:
        return "its bytes do not hash to its name"
    return None


def hash_records(records: Sequence[Mapping[str, Any]]) -> tuple[str, int]:
    """``(sha256 of the line digests, count)`` of ``records`` as a write would encode them."""
    total = hashlib.sha256()
    for number, record in enumerate(records):
        total.update(hashlib.sha256(_encode(record, number)).digest())
    return total.hexdigest(), len(records)


# --- writing a pack ----------------------------------------------------------------------


class _PackWriter:
    """One new records file: lines in, joined into chunks here and written by a thread,
    renamed after its lines' digest by :meth:`finish`; removed if anything fails."""

    def __init__(self, fs: Filesystem, folder: str) -> None:
        self._fs, self._folder = fs, folder
        self.size = 0
        self._chunk: list[bytes] = []
        self._chunk_bytes = 0
        self._temp: str | None = None
        self._stream: BinaryIO | None = None
        self._opened: Any = None
        self._digest = hashlib.sha256()
        """Of the lines' digests, in order: what names the file."""
        self._writing = ThreadPoolExecutor(1, thread_name_prefix="rollpoint-write")
        self._pending: list[Future[Any]] = []

    def __enter__(self) -> _PackWriter:
        return self

    def add(self, line: bytes, digest: bytes) -> None:
        """Append ``line``, whose sha256 is ``digest``."""
        self._chunk.append(line)
        self._digest.update(digest)
        self._chunk_bytes += len(line) + 1
        self.size += len(line) + 1
        if self._chunk_bytes >= _TARGET_CHUNK_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._chunk:
            return
        if self._stream is None:
            self._fs.makedirs(self._folder)
            self._temp = self._fs.join(self._folder, f".records-{uuid.uuid4().hex}.tmp")
            self._opened = self._fs.open_write(self._temp)
            self._stream = self._opened.__enter__()
        self._chunk.append(b"")  # one join then ends the chunk with a newline
        chunk = b"\n".join(self._chunk)
        self._chunk, self._chunk_bytes = [], 0
        # Two stages: this thread encodes (and hashes) the next chunk while another writes
        # the last one (a write releases the GIL). At most one chunk waits beyond the one
        # being encoded.
        _wait_all(self._pending)
        self._pending = [self._writing.submit(self._stream.write, chunk)]

    def finish(self) -> str:
        """The new file's name ("" when nothing was added)."""
        self._flush()
        _wait_all(self._pending)
        self._pending = []
        if self._stream is None:
            return ""
        self._close(None)
        sha256 = self._digest.hexdigest()
        name = records_file_name(sha256)
        assert self._temp is not None
        target = self._fs.join(self._folder, name)
        # The name is the digest of the lines' digests (not of the file's bytes): what
        # _damage re-hashes, with the size.
        if (
            self._fs.exists(target)
            and _damage(self._fs, target, name, self.size, rehash=True) is None
        ):
            # The same bytes are there already (a rebase wrote records that had not
            # changed): keep that file as it is, so no snapshot naming it finds it written
            # after its manifest. A damaged file of that name is replaced.
            self._fs.remove_file(self._temp)
        else:
            self._fs.rename(self._temp, target)
        self._temp = None
        self._fs.sync_dir(self._folder)
        return name

    def _close(self, exc: BaseException | None) -> None:
        opened, self._opened, self._stream = self._opened, None, None
        if opened is not None:
            if exc is None:
                opened.__exit__(None, None, None)
            else:
                opened.__exit__(type(exc), exc, exc.__traceback__)

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is not None:
                wait(self._pending)  # the stream must not be closed under a running write
                with contextlib.suppress(OSError):
                    self._close(exc)
        finally:
            self._writing.shutdown()
            if self._temp is not None:
                self._fs.remove_file(self._temp)


def _wait_all(pending: list[Future[Any]]) -> None:
    """Wait for a chunk's hash and write; the first failure raises, after both ended."""
    wait(pending)
    for future in pending:
        future.result()


class ValueMadeOnWrite:
    """A record value the writer makes when it writes the record, in its thread: the line
    holds what :meth:`value` returns (JSON-ready), not this object. A plain base class, not
    a Protocol: the writer's check runs once per such value on the write path, and an
    ``isinstance`` of a plain class is the cheapest there is."""

    __slots__ = ()

    def value(self) -> object:
        """The value to write; an error raised here fails the write, naming the record."""
        raise NotImplementedError


def encode_record(record: Mapping[str, Any]) -> bytes:
    """``record``'s line (without its newline) as a write encodes it."""
    return _encode(record, 0)


def _encode(record: Mapping[str, Any], number: int) -> bytes:
    try:
        return orjson.dumps(record, default=_encode_other)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise _unencodable(record, number, exc) from None


def _encode_other(value: object) -> object:
    """orjson's ``default``: called for every value it cannot encode itself."""
    if isinstance(value, ValueMadeOnWrite):
        return value.value()
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def _unencodable(record: object, number: int, exc: Exception) -> InvalidCheckpointStateError:
    if not isinstance(record, Mapping):
        return InvalidCheckpointStateError(
            f"record {number} is a {type(record).__name__}, not a mapping"
        )
    # orjson reports what ``default`` raised only as the cause of its own "Type is not
    # JSON serializable": the cause says what went wrong.
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return InvalidCheckpointStateError(f"record {number} cannot be encoded: {cause}")


M = TypeVar("M", bound=RecordsManifest)


def records_manifest(model: type[M], packed: PackedRecords, **identity: Any) -> M:
    """The manifest ``model`` of the parts ``packed`` laid out, with its totals, stamped
    now, naming them by ``identity`` (the fields ``model`` adds: whose records, which
    checkpoint)."""
    return model(
        **identity,
        parts=packed.parts,
        count=packed.count,
        bytes=packed.bytes,
        written=packed.written,
        sha256=packed.sha256,
        written_at=time.time(),
    )
