"""The on-disk documents of a snapshot, their schema versions and their migrations.

Owns the shape of every JSON document rollpoint writes to a snapshot store and reads
back after a crash, possibly with a newer rollpoint:

- :class:`ParticipantManifest` (schema 1): one participant's exported state, written
  last into the participant's folder after its records file.
- :class:`SnapshotManifest` (schema 2): one published snapshot, written last into the
  snapshot folder; its presence is what makes the snapshot exist.
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
- **3**: current. Adds ``finished``: the in-flight episodes whose finished reply an agent
  held at the cut (the no-drain save). Migration 2 → 3 adds an empty list, which is exact:
  a version-2 writer drained on-wire replies before the cut, so it never saved one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

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

PARTICIPANT_MANIFEST_VERSION = 1
SNAPSHOT_MANIFEST_VERSION = 3
LATEST_POINTER_VERSION = 1


# --- participant state -----------------------------------------------------------------


class ParticipantManifest(StrictModel):
    """One participant's exported state: the records file it names and that file's digest."""

    schema_version: int = PARTICIPANT_MANIFEST_VERSION
    kind: ParticipantKind
    instance: Identifier
    """The participant instance, e.g. ``model-replica-0``."""
    checkpoint_id: CheckpointId
    records_file: RecordsFileName
    sha256: Sha256Hex
    """sha256 of the whole records file."""
    count: NonNegativeInt
    """Number of records (lines) in the records file."""
    bytes: NonNegativeInt
    """Size of the records file."""
    written_at: float
    """Unix time the manifest was written."""


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
    """A file the trainer wrote into the snapshot (ledger, TQ), with its digest."""

    path: str
    """Relative to the snapshot folder."""
    sha256: Sha256Hex
    bytes: NonNegativeInt


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
    files: dict[str, FileEntry]
    """The trainer's files in the snapshot (ledger, TQ), keyed by name."""
    config_fingerprint: dict[str, JsonValue]
    """The config keys a restore must match (environment, group_size, replicas, ...)."""


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


SNAPSHOT_MANIFEST_MIGRATIONS: dict[int, Migration] = {1: _snapshot_v1_to_v2, 2: _snapshot_v2_to_v3}
PARTICIPANT_MANIFEST_MIGRATIONS: dict[int, Migration] = {}
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


def load_snapshot_manifest(doc: Mapping[str, Any], what: str) -> SnapshotManifest:
    return load_versioned(
        doc, SnapshotManifest, SNAPSHOT_MANIFEST_MIGRATIONS, SNAPSHOT_MANIFEST_VERSION, what
    )


def load_latest_pointer(doc: Mapping[str, Any], what: str) -> LatestPointer:
    return load_versioned(
        doc, LatestPointer, LATEST_POINTER_MIGRATIONS, LATEST_POINTER_VERSION, what
    )


def encode_document(model: BaseModel) -> bytes:
    """The bytes written for an on-disk document: sorted keys, indented, newline-terminated."""
    return orjson.dumps(
        model.model_dump(mode="json"),
        option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE,
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
