"""One participant's exported state on disk: the records files it names, then its manifest.

Owns the participant state folder (a local path or an fsspec URL, one per participant
per snapshot)::

    <directory>/manifest.json          ParticipantManifest, written last

The records are lines of records files (:mod:`rollpoint.store.record_packs`): given the
store's ``root``, files shared by snapshots in ``<root>/objects/``, of which a write adds
one holding what changed since the participant's previous write (its
:class:`~rollpoint.store.record_packs.PackIndex`) and references the rest; without a root,
one file of every record in ``<directory>``. The manifest is written last: a folder without
its manifest holds no state. Readers check the manifest's kind, instance and checkpoint id,
then every part's size, digest and record count before returning anything; every failure is
an :class:`InvalidCheckpointStateError` naming the file and what differs.

Given the store's ``root``, a local folder is read and written through
:class:`~rollpoint.store.contained_filesystem.ContainedFilesystem`: each file is opened
inside the root at the moment it is opened, never through a symlink.

It does not know what a record means (each participant does) nor where the folder sits
in a snapshot (:mod:`rollpoint.store.snapshot_store`), nor the interpreter: a caller that
decodes a large state (the fence's restore) pauses the cyclic garbage collector around
:func:`read_participant_state` itself (:mod:`rollpoint.tuning.collector_pause`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollpoint.protocol.errors import (
    BadRequestError,
    CheckpointConflictError,
    InvalidCheckpointStateError,
    SnapshotError,
)
from rollpoint.protocol.ids import is_identifier
from rollpoint.protocol.manifest import (
    JournalMark,
    ParticipantManifest,
    decode_document,
    encode_document,
    load_participant_manifest,
)
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.contained_filesystem import filesystem_within
from rollpoint.store.filesystem import Filesystem, filesystem_for
from rollpoint.store.pack_reads import check_identity, check_totals, read_parts
from rollpoint.store.record_packs import (
    OBJECTS_DIR,
    PackIndex,
    hash_records,
    pack_records,
    records_file_name,
    records_manifest,
)

__all__ = [
    "MANIFEST_NAME",
    "read_participant_state",
    "records_files",
    "verify_participant_state",
    "write_participant_state",
]

MANIFEST_NAME = "manifest.json"


def write_participant_state(
    directory: str,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Sequence[Mapping[str, Any]],
    root: str | None = None,
    index: PackIndex | None = None,
    journal: JournalMark | None = None,
) -> ParticipantManifest:
    """Write ``records`` and then their manifest into ``directory``; return the manifest.

    Writing the same state again (a retried commit) returns the existing manifest; any
    other state already published in ``directory`` is a :class:`CheckpointConflictError`.
    With ``root`` (the store's root, ``directory`` inside it), every file is opened inside
    it without following a symlink (:func:`_filesystem`), the records go to the root's
    shared records files, and with ``index`` (the participant's, kept between its writes)
    only what its previous write did not hold is written; ``index`` becomes this write's
    once the manifest is written. ``journal``: the participant's journal position when
    the cut opened, saved in the manifest.
    """
    participant_kind = _check_identity(kind, instance, checkpoint_id)
    fs = _filesystem(directory, root)
    manifest_path = fs.join(directory, MANIFEST_NAME)
    existing = _existing_manifest(fs, manifest_path)
    if existing is not None:
        return _confirm_retry(
            existing, manifest_path, participant_kind, instance, checkpoint_id, records
        )
    folder = directory if root is None else fs.join(root, OBJECTS_DIR)
    try:
        fs.makedirs(directory)
        packed = pack_records(fs, folder, records, index, shared=root is not None)
        manifest = records_manifest(
            ParticipantManifest,
            packed,
            kind=participant_kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            journal=journal,
        )
        fs.publish_bytes(manifest_path, encode_document(manifest))
    except OSError as exc:
        raise SnapshotError(f"cannot write participant state in {directory}: {exc}") from None
    if index is not None:
        index.replace(packed.index)
    return manifest


def read_participant_state(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str | None = None
) -> tuple[ParticipantManifest, list[dict[str, Any]]]:
    """The verified manifest and records of one participant's state in ``directory``
    (inside ``root`` when given, as :func:`write_participant_state`)."""
    fs = _filesystem(directory, root)
    manifest = _read_manifest(fs, directory, kind, instance, checkpoint_id)
    records: list[dict[str, Any]] = []
    read_parts(fs, manifest.parts, directory=directory, objects=_objects(fs, root), into=records)
    return manifest, records


def verify_participant_state(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str | None = None
) -> ParticipantManifest:
    """Check the state in ``directory`` as :func:`read_participant_state` does, decoding nothing."""
    fs = _filesystem(directory, root)
    manifest = _read_manifest(fs, directory, kind, instance, checkpoint_id)
    read_parts(fs, manifest.parts, directory=directory, objects=_objects(fs, root), into=None)
    return manifest


def records_files(
    directory: str, manifest: ParticipantManifest, root: str | None = None
) -> list[str]:
    """The paths of the records files ``manifest`` names, each once, in first-use order."""
    fs = _filesystem(directory, root)
    objects = _objects(fs, root)
    paths = [
        fs.join(objects if p.shared and objects is not None else directory, p.file)
        for p in manifest.parts
    ]
    return list(dict.fromkeys(paths))


def _filesystem(directory: str, root: str | None) -> Filesystem:
    """Without ``root``: ``directory``'s own filesystem. With it: for a local root, one
    that checks each open inside the root at the moment it happens, so a symlink put in
    the store after the request was checked (between a commit and its confirm) is refused
    rather than followed out of it."""
    return filesystem_for(directory) if root is None else filesystem_within(root, directory)


def _objects(fs: Filesystem, root: str | None) -> str | None:
    """The shared records files' folder (None without a root: see read_parts)."""
    return fs.join(root, OBJECTS_DIR) if root is not None else None


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
        same = (existing.sha256, existing.count) == hash_records(records)
    if not same:
        raise CheckpointConflictError(
            f"{manifest_path} already holds a different commit ({existing.kind} "
            f"{existing.instance}, checkpoint {existing.checkpoint_id}, {existing.count} records)"
        )
    return existing


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
    check_identity(manifest_path, found, expected)
    for part in manifest.parts:
        if part.digest == "bytes" and part.file != records_file_name(part.sha256):
            raise InvalidCheckpointStateError(
                f"{manifest_path}: names records file {part.file!r}, but its digest "
                f"makes it {records_file_name(part.sha256)!r}"
            )
    check_totals(manifest, manifest_path)
    return manifest
