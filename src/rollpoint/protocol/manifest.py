"""The on-disk documents of a snapshot, their schema versions and their migrations.

Owns the shape of every JSON document rollpoint writes to a snapshot store and reads
back after a crash, possibly with a newer rollpoint:

- :class:`ParticipantManifest` (schema 3): one participant's exported state, written
  last into the participant's folder after the records files it names: a list of
  :class:`RecordsPart` s, each a run of consecutive records (lines) in one records file.
  Schema history: **1** named one records file in the participant's folder, with the
  sha256 of its bytes; **2** names parts, so a snapshot references the records
  an earlier one wrote instead of writing them again (the records files shared by
  snapshots sit in the store's ``objects/`` folder: :mod:`rollpoint.store.record_packs`);
  **3** (current) adds ``journal``: the participant's journal position when the cut
  opened (:class:`JournalMark`, docs/journal.md), null for a participant that does not
  journal. Migration 1 → 2 makes the one file one part of its whole bytes, digested as
  bytes: exact. Migration 2 → 3 sets ``journal`` to null: exact, no older writer journaled
  into a snapshot.
- :class:`TrainerFileManifest` (schema 1): a trainer file (the ledger, the finished queue) kept as
  records, as a participant's state is: the parts of shared records files that hold them,
  so a snapshot writes the ledger's and the finished queue's records that changed since the previous one.
- :class:`SnapshotManifest` (schema 6): one published snapshot, written last into the
  snapshot folder; its presence is what makes the snapshot exist. It is sealed
  (:func:`seal_manifest`): ``seal`` holds the sha256 of every other top-level field, so a
  field changed after publication (a flipped digit in ``train_step``) is refused naming
  the field, and every file it names carries its digest (trainer files and each
  participant's manifest).
- :class:`LatestPointer` (schema 1): the ``latest`` file naming the newest snapshot.

Every document carries ``schema_version``, and :func:`load_versioned` is the one way to
read any of them: it checks the version before any other field, migrates older
documents step by step, and refuses newer or unknown ones with a message that says what
to do. It does not know about files or paths (that is :mod:`rollpoint.store`).

Schema history of :class:`SnapshotManifest`:

- **1**: the pause was recorded as ``pause_ms`` (an integer number of milliseconds) and
  there was no ``restarts`` list, because a version-1 writer refused to snapshot a
  deployment holding restart-only episodes. Migration 1 → 2 converts ``pause_ms`` to
  ``pause_seconds`` and adds an empty ``restarts`` list, which is exact rather than a
  guess. A version-1 document that already carries ``pause_seconds`` or ``restarts``
  was not written by a version-1 writer and is refused.
- **2**: adds ``restarts`` and ``pause_seconds``.
- **3**: adds ``finished``: the in-flight episodes whose finished reply an agent held at
  the cut (the no-drain save). Migration 2 → 3 adds an empty list, which is exact: a
  version-2 writer drained on-wire replies before the cut, so it never saved one.
- **4**: adds ``seal`` (the sha256 of every other field), ``committed_step`` (the finished queue's
  committed train step at the cut: what retention and the restore compose with) and each
  participant entry's ``sha256`` and ``bytes`` (of its participant manifest file). A
  version-4 document must carry all of them and its seal must match, or it is refused.
  Reading rule for older ones: migration 3 → 4 sets them to ``null`` (nothing is invented:
  an older snapshot was never sealed); it loads unsealed, its participant manifests are
  checked by their own records digests as before, and the restore still cross-checks its
  train step and policy version against its digest-checked ``trainer.json``.
- **5**: each file entry says its ``format``: ``document`` (the file is the JSON
  document itself, as every file of an older snapshot) or ``records`` (the file is a
  :class:`TrainerFileManifest` naming the records that make the document). Migration
  4 → 5 sets ``document`` on every entry: exact, an older writer wrote nothing else.
- **6**: current. Adds ``journaled``: the in-flight tries of a journal-mode snapshot
  (``snapshot.mode: journal``, issue 37), which saves no episode state: each is sent again
  under its own rollout id and attempt, pinned to its replica, whose journals bring it to
  its last journaled turn. Migration 5 → 6 adds an empty list: exact, every older writer
  took the cut, which sorts each try into saved, restarts or finished.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, Field, JsonValue, StringConstraints, ValidationError

from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import CheckpointId, Identifier
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind

ModelT = TypeVar("ModelT", bound=BaseModel)
Migration = Callable[[dict[str, Any]], dict[str, Any]]
"""Turns a document of version N into one of version N + 1 (without setting the version)."""

Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
RecordsFileName = Annotated[str, StringConstraints(pattern=r"^records-[0-9a-f]{16}\.jsonl$")]
"""``records-<first 16 hex of the records sha256>.jsonl``: never a path, so never a traversal."""
NonNegativeInt = Annotated[int, Field(ge=0)]

PARTICIPANT_MANIFEST_VERSION = 3
TRAINER_FILE_MANIFEST_VERSION = 1
SNAPSHOT_MANIFEST_VERSION = 6
LATEST_POINTER_VERSION = 1


# --- participant state -----------------------------------------------------------------


class RecordsPart(StrictModel):
    """A run of ``count`` consecutive records: bytes ``[offset, offset + length)`` of one
    records file, each record one line ending in a newline."""

    file: RecordsFileName
    shared: bool
    """True: the file sits in the store's ``objects/`` folder, shared by the snapshots
    that reference it; False: in the participant's own folder (schema 1, or a write
    given no store root)."""
    offset: NonNegativeInt
    length: NonNegativeInt
    count: NonNegativeInt
    digest: Literal["lines", "bytes"]
    """What ``sha256`` covers. ``lines``: the sha256 of the concatenated sha256 digests
    (32 bytes each) of the part's lines, each without its newline, so a run cut out of an
    earlier part keeps a digest without its bytes being read again. ``bytes``: the sha256
    of the part's bytes (schema 1's one file)."""
    sha256: Sha256Hex


class RecordsManifest(StrictModel):
    """Records saved as parts of records files: what a participant's state and a trainer
    file kept as records have in common."""

    parts: list[RecordsPart]
    """In record order: the records are the parts' lines, one part after the other."""
    count: NonNegativeInt
    """Number of records: the parts' counts added up."""
    bytes: NonNegativeInt
    """Size of the records: the parts' lengths added up."""
    written: NonNegativeInt
    """Bytes of records files this write added to the store; the rest it referenced."""
    sha256: Sha256Hex | None
    """sha256 of every record's line digest in order (as a ``lines`` part's), None for a
    migrated schema-1 manifest: what tells a retried commit from another one."""
    written_at: float
    """Unix time the manifest was written."""


JournalFolder = Annotated[
    str, StringConstraints(pattern=r"^journal/[a-z]+/[A-Za-z0-9][A-Za-z0-9._:-]*$")
]
"""``journal/<kind>/<instance>``, relative to the snapshot root: never ``..``, never absolute."""


class JournalMark(StrictModel):
    """Where a participant's journal stood when a cut opened: the snapshot covers every
    record up to here, and a restore from it replays the records after it."""

    folder: JournalFolder
    segment: Annotated[int, Field(ge=1, le=2**32 - 1)]
    """A segment's number is a u32 in its header."""
    offset: Annotated[int, Field(ge=0, le=2**63 - 1)]
    """The end of the last durable record in ``segment`` (a segment's header is 28 bytes)."""


class ParticipantManifest(RecordsManifest):
    """One participant's exported state: the records it saved, as parts of records files."""

    schema_version: int = PARTICIPANT_MANIFEST_VERSION
    kind: ParticipantKind
    instance: Identifier
    """The participant instance, e.g. ``model-replica-0``."""
    checkpoint_id: CheckpointId
    journal: JournalMark | None = None
    """The participant's journal position when the cut opened (None: it does not journal)."""


class TrainerFileManifest(RecordsManifest):
    """A trainer file of a snapshot kept as records (``FileEntry.format`` ``records``)."""

    schema_version: int = TRAINER_FILE_MANIFEST_VERSION
    name: str
    """The trainer file the records make (``ledger.json``, ``tq.json``)."""
    snapshot_id: Identifier


# --- snapshot --------------------------------------------------------------------------


class ParticipantEntry(StrictModel):
    """A participant that committed into the snapshot; a restore needs every one live."""

    kind: ParticipantKind
    name: Identifier
    replica: Identifier
    mode: CheckpointMode
    instance: Identifier
    manifest_path: str
    """Path of its :class:`ParticipantManifest`, relative to the snapshot folder."""
    sha256: Sha256Hex | None = None
    """sha256 of that manifest file, stamped by the store at publication (None: a
    manifest older than schema 4, or an entry not published yet)."""
    bytes: NonNegativeInt | None = None
    """Size of that manifest file (None as for ``sha256``)."""


class RestartEpisode(StrictModel):
    """An in-flight episode no participant could capture: it starts over on restore."""

    rollout_id: Identifier
    attempt: NonNegativeInt
    replica: Identifier
    group_id: Identifier
    row: NonNegativeInt


class SavedEpisode(RestartEpisode):
    """An in-flight episode captured at a turn boundary: it continues as ``attempt + 1``."""

    turns_completed: NonNegativeInt


class FileEntry(StrictModel):
    """A file the trainer wrote into the snapshot (ledger, the finished queue), with its digest."""

    path: str
    """Relative to the snapshot folder."""
    sha256: Sha256Hex
    bytes: NonNegativeInt
    format: Literal["document", "records"] = "document"
    """``document``: the file is the JSON document; ``records``: it is a
    :class:`TrainerFileManifest` naming the records the document is made of."""


class SnapshotManifest(StrictModel):
    """One published snapshot. Written last: a snapshot folder without it does not exist."""

    schema_version: int = SNAPSHOT_MANIFEST_VERSION
    snapshot_id: Identifier
    checkpoint_id: CheckpointId
    created_at: float
    """Unix time the save started (the barrier closed)."""
    published_at: float = 0.0
    """Unix time of publication; stamped by the snapshot store when it publishes."""
    train_step: NonNegativeInt
    policy_version: NonNegativeInt
    committed_step: NonNegativeInt | None = 0
    """The finished queue's committed train step at the cut: the snapshot composes with a durable train
    checkpoint at a step between this and ``train_step`` (None: older than schema 4)."""
    pause_seconds: Annotated[float, Field(ge=0)]
    """How long the data plane was paused for the cut."""
    topology_fingerprint: Sha256Hex
    """:func:`topology_fingerprint` of the deployment that committed."""
    participants: list[ParticipantEntry]
    episodes: list[SavedEpisode]
    restarts: list[RestartEpisode]
    finished: list[RestartEpisode]
    """In-flight episodes whose finished reply an agent held at the cut (on the wire, or
    not acknowledged yet): the reply is in the agent's state; on restore it is adopted when
    the saved ledger has not sealed it, so it is neither lost nor run again."""
    journaled: list[RestartEpisode] = Field(default_factory=list)
    """In-flight tries of a journal-mode snapshot (no episode state saved, no pause): on
    restore each is sent again under its own rollout id and attempt, pinned to its replica,
    and continues there from the journals (docs/design.md "Pause-free snapshots")."""
    files: dict[str, FileEntry]
    """The trainer's files in the snapshot (ledger, the finished queue), keyed by name."""
    config_fingerprint: dict[str, JsonValue]
    """The config keys a restore must match (environment, group_size, replicas, ...)."""
    seal: dict[str, Sha256Hex] | None = None
    """Field name → sha256 of that field's canonical JSON, for every other field: stamped
    by :func:`seal_manifest` at publication (None: older than schema 4, or not published)."""


class LatestPointer(StrictModel):
    """The ``latest`` file: names the newest published snapshot, for operators and tools."""

    schema_version: int = LATEST_POINTER_VERSION
    snapshot_id: Identifier
    published_at: float


def _snapshot_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    for field in ("pause_seconds", "restarts"):
        if field in doc:
            raise ValueError(f"a version 1 document has no '{field}' field")
    pause_ms = doc.pop("pause_ms", None)
    if not isinstance(pause_ms, int) or isinstance(pause_ms, bool) or pause_ms < 0:
        raise ValueError(f"'pause_ms' must be a non-negative integer, got {pause_ms!r}")
    doc["pause_seconds"] = pause_ms / 1000.0
    doc["restarts"] = []
    return doc


def _snapshot_v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    if "finished" in doc:
        raise ValueError("a version 2 document has no 'finished' field")
    doc["finished"] = []
    return doc


def _snapshot_v3_to_v4(doc: dict[str, Any]) -> dict[str, Any]:
    for field in ("seal", "committed_step"):
        if field in doc:
            raise ValueError(f"a version 3 document has no '{field}' field")
    doc["seal"] = None
    doc["committed_step"] = None
    participants = doc.get("participants")
    if isinstance(participants, list):
        for entry in participants:
            if isinstance(entry, dict):
                if "sha256" in entry or "bytes" in entry:
                    raise ValueError("a version 3 participant entry has no digest")
                entry["sha256"] = None
                entry["bytes"] = None
    return doc


def _snapshot_v4_to_v5(doc: dict[str, Any]) -> dict[str, Any]:
    files = doc.get("files")
    if isinstance(files, dict):
        for entry in files.values():
            if isinstance(entry, dict):
                if "format" in entry:
                    raise ValueError("a version 4 file entry has no 'format' field")
                entry["format"] = "document"
    return doc


def _snapshot_v5_to_v6(doc: dict[str, Any]) -> dict[str, Any]:
    if "journaled" in doc:
        raise ValueError("a version 5 document has no 'journaled' field")
    doc["journaled"] = []
    return doc


SNAPSHOT_MANIFEST_MIGRATIONS: dict[int, Migration] = {
    1: _snapshot_v1_to_v2,
    2: _snapshot_v2_to_v3,
    3: _snapshot_v3_to_v4,
    4: _snapshot_v4_to_v5,
    5: _snapshot_v5_to_v6,
}


def _participant_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    for field in ("parts", "written"):
        if field in doc:
            raise ValueError(f"a version 1 document has no '{field}' field")
    doc["parts"] = [
        {
            "file": doc.pop("records_file", None),
            "shared": False,
            "offset": 0,
            "length": doc.get("bytes"),
            "count": doc.get("count"),
            "digest": "bytes",
            "sha256": doc.get("sha256"),
        }
    ]
    doc["written"] = doc.get("bytes")
    doc["sha256"] = None
    return doc


def _participant_v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    if "journal" in doc:
        raise ValueError("a version 2 document has no 'journal' field")
    doc["journal"] = None
    return doc


PARTICIPANT_MANIFEST_MIGRATIONS: dict[int, Migration] = {
    1: _participant_v1_to_v2,
    2: _participant_v2_to_v3,
}
TRAINER_FILE_MANIFEST_MIGRATIONS: dict[int, Migration] = {}
LATEST_POINTER_MIGRATIONS: dict[int, Migration] = {}


# --- loading ---------------------------------------------------------------------------


def decode_document(data: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON document that must be an object; refuse anything else, naming ``what``."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidCheckpointStateError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidCheckpointStateError(f"{what} must be a JSON object, got {type(doc).__name__}")
    return doc


def load_versioned(
    doc: Mapping[str, Any],
    model: type[ModelT],
    migrations: Mapping[int, Migration],
    current: int,
    what: str,
) -> ModelT:
    """Validate ``doc`` as ``model`` at schema ``current``, migrating older versions first.

    The version is read before any other field, so a document of another version is
    refused by its version and never by a field it was not meant to have. Every refusal
    is an :class:`InvalidCheckpointStateError` naming ``what`` (e.g. the file).
    Migrations get a shallow copy of ``doc`` and may change nested values in place, so
    pass a freshly decoded document.
    """
    version = _schema_version(doc, current, what)
    migrated = dict(doc)
    for step in range(version, current):
        migration = migrations.get(step)
        if migration is None:
            raise InvalidCheckpointStateError(
                f"{what}: schema_version {version} is not supported "
                f"(no migration from {step} to {step + 1}; this rollpoint reads {current})"
            )
        try:
            migrated = migration(migrated)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidCheckpointStateError(
                f"{what}: cannot migrate schema_version {step} to {step + 1}: {exc}"
            ) from None
    migrated["schema_version"] = current
    try:
        return model.model_validate(migrated)
    except ValidationError as exc:
        raise InvalidCheckpointStateError(f"{what}: {_describe(exc)}") from None


def _schema_version(doc: Mapping[str, Any], current: int, what: str) -> int:
    if "schema_version" not in doc:
        raise InvalidCheckpointStateError(
            f"{what} has no schema_version: not a rollpoint document, or written before "
            "versioning; refusing to guess its shape"
        )
    version = doc["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidCheckpointStateError(
            f"{what}: schema_version must be a positive integer, got {version!r}"
        )
    if version > current:
        raise InvalidCheckpointStateError(
            f"{what}: schema_version {version} is newer than this rollpoint understands "
            f"(max {current}); upgrade rollpoint"
        )
    return version


def _describe(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    loc = ".".join(str(part) for part in first["loc"]) or "<top level>"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "extra_forbidden":
        return f"unknown field '{loc}'{more}"
    return f"field '{loc}': {first['msg']}{more}"


def load_participant_manifest(doc: Mapping[str, Any], what: str) -> ParticipantManifest:
    return load_versioned(
        doc,
        ParticipantManifest,
        PARTICIPANT_MANIFEST_MIGRATIONS,
        PARTICIPANT_MANIFEST_VERSION,
        what,
    )


def load_trainer_file_manifest(doc: Mapping[str, Any], what: str) -> TrainerFileManifest:
    return load_versioned(
        doc,
        TrainerFileManifest,
        TRAINER_FILE_MANIFEST_MIGRATIONS,
        TRAINER_FILE_MANIFEST_VERSION,
        what,
    )


def load_snapshot_manifest(doc: Mapping[str, Any], what: str) -> SnapshotManifest:
    """A snapshot manifest of any supported version; one of schema 4 or later must be
    sealed, and its seal must match every field (refused naming the first that differs)."""
    version = _schema_version(doc, SNAPSHOT_MANIFEST_VERSION, what)
    if version >= SEALED_SINCE:
        _check_seal(doc, what)
    manifest = load_versioned(
        doc, SnapshotManifest, SNAPSHOT_MANIFEST_MIGRATIONS, SNAPSHOT_MANIFEST_VERSION, what
    )
    if version >= SEALED_SINCE:
        if manifest.committed_step is None:
            raise InvalidCheckpointStateError(
                f"{what}: field 'committed_step' is null, but schema {version} requires it"
            )
        for p in manifest.participants:
            if p.sha256 is None or p.bytes is None:
                raise InvalidCheckpointStateError(
                    f"{what}: field 'participants': {p.instance} has no digest of its "
                    f"manifest, but schema {version} requires one"
                )
    return manifest


SEALED_SINCE = 4
"""The first snapshot manifest schema that carries a seal."""


def field_digests(doc: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of each top-level field but ``seal``, over its canonical JSON (sorted keys)."""
    return {
        name: hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()
        for name, value in doc.items()
        if name != "seal"
    }


def seal_manifest(manifest: SnapshotManifest) -> SnapshotManifest:
    """``manifest`` with its seal: written by the store at publication, after the last
    field (``published_at``, the participants' digests) is set."""
    return manifest.model_copy(update={"seal": field_digests(manifest.model_dump(mode="json"))})


def sealed_document(manifest: SnapshotManifest) -> tuple[SnapshotManifest, bytes]:
    """:func:`seal_manifest` and :func:`encode_document` of the result, from one dump: at
    100k episodes in flight each dump of the episode list is ~0.1 s of a publication
    (``snapshot_growth_100k``)."""
    doc = manifest.model_dump(mode="json")
    seal = field_digests(doc)
    doc["seal"] = seal
    return manifest.model_copy(update={"seal": seal}), _encode(doc)


def _check_seal(doc: Mapping[str, Any], what: str) -> None:
    seal = doc.get("seal")
    if not isinstance(seal, dict):
        raise InvalidCheckpointStateError(
            f"{what}: field 'seal' is missing or not an object: the manifest is not sealed"
        )
    actual = field_digests(doc)
    changed = sorted(name for name in actual.keys() & seal.keys() if actual[name] != seal[name])
    added = sorted(actual.keys() - seal.keys())
    removed = sorted(seal.keys() - actual.keys())
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise InvalidCheckpointStateError(
            f"{what}: field '{changed[0]}'{more} does not match the manifest's seal "
            "(changed after publication: tampered or corrupt)"
        )
    if added or removed:
        name = (added or removed)[0]
        how = "is not covered by" if added else "is missing but listed in"
        raise InvalidCheckpointStateError(f"{what}: field '{name}' {how} the manifest's seal")


def load_latest_pointer(doc: Mapping[str, Any], what: str) -> LatestPointer:
    return load_versioned(
        doc, LatestPointer, LATEST_POINTER_MIGRATIONS, LATEST_POINTER_VERSION, what
    )


def encode_document(model: BaseModel) -> bytes:
    """The bytes written for an on-disk document: sorted keys, indented, newline-terminated."""
    return _encode(model.model_dump(mode="json"))


def _encode(doc: Any) -> bytes:
    return orjson.dumps(
        doc, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE
    )


# --- topology --------------------------------------------------------------------------


def topology_fingerprint(participants: list[dict[str, Any]]) -> str:
    """sha256 of the deployment's participants, order-independent, ignoring ``features``.

    Pass each participant's identity (kind, name, replica, mode, protocol version,
    features): every key but ``features`` counts, so do not pass live fields such as the
    phase or counts. ``features`` is an additive list: a participant that learns a new
    feature must not invalidate the snapshots taken before it did.
    """
    stripped = [{k: v for k, v in p.items() if k != "features"} for p in participants]
    # The canonical bytes break ties, so equal (kind, replica, name) keys cannot make the
    # fingerprint depend on the order participants were listed in.
    stripped.sort(
        key=lambda p: (
            str(p.get("kind", "")),
            str(p.get("replica", "")),
            str(p.get("name", "")),
            orjson.dumps(p, option=orjson.OPT_SORT_KEYS),
        )
    )
    return hashlib.sha256(orjson.dumps(stripped, option=orjson.OPT_SORT_KEYS)).hexdigest()
