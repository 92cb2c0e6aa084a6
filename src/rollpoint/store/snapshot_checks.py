"""What the store checks of a snapshot: before it publishes one, and as it reads one.

Owns :func:`check_publishable` (a manifest matches its staging folder: its id and schema
version, every file it names written, every shared records file those name present in
``objects/``; it returns the participant entries stamped with their manifests' digests) and
:func:`verify_contents` (every file a published manifest names matches its digest, and
each participant's state verifies), with the digest checks of single files they share with
the store's reads (:func:`read_checked`), and :class:`SnapshotSummary`, one folder's
account as ``inspect`` lists it (what it holds, or why it cannot be used). A check that
fails raises one line naming the snapshot and the file; nothing here writes.
"""

from __future__ import annotations

from rollpoint.protocol.errors import (
    BadRequestError,
    InvalidCheckpointStateError,
    SnapshotError,
)
from rollpoint.protocol.manifest import (
    SNAPSHOT_MANIFEST_VERSION,
    FileEntry,
    ParticipantEntry,
    SnapshotManifest,
)
from rollpoint.protocol.model_base import StrictModel
from rollpoint.store.digest import digest_bytes, digest_file
from rollpoint.store.filesystem import Filesystem, resolve_inside
from rollpoint.store.participant_state import MANIFEST_NAME, verify_participant_state
from rollpoint.store.record_packs import OBJECTS_DIR
from rollpoint.store.shared_records import participant_shared_files
from rollpoint.store.staging import Staging
from rollpoint.store.trainer_records import trainer_shared_files, verify_trainer_records


class SnapshotSummary(StrictModel):
    """One folder under ``snapshots/``: what it holds, or why it cannot be used."""

    snapshot_id: str
    path: str
    valid: bool
    reason: str | None = None
    """Why the snapshot cannot be used (None when valid)."""
    checkpoint_id: str | None = None
    published_at: float | None = None
    train_step: int | None = None
    episodes: int | None = None
    restarts: int | None = None


def summary_of(
    name: str, path: str, manifest: SnapshotManifest | None, reason: str | None
) -> SnapshotSummary:
    if manifest is None:
        return SnapshotSummary(snapshot_id=name, path=path, valid=False, reason=reason)
    return SnapshotSummary(
        snapshot_id=name,
        path=path,
        valid=reason is None,
        reason=reason,
        checkpoint_id=manifest.checkpoint_id,
        published_at=manifest.published_at,
        train_step=manifest.train_step,
        episodes=len(manifest.episodes),
        restarts=len(manifest.restarts),
    )


def inside(folder: str, relative: str) -> str:
    """``relative`` (a path a manifest names) within ``folder``; one that leaves it is a
    manifest that cannot be trusted."""
    try:
        return resolve_inside(folder, relative)
    except BadRequestError as exc:
        raise InvalidCheckpointStateError(f"snapshot manifest: {exc.message}") from None


def check_digest(path: str, sha256: str, size: int, entry: FileEntry) -> None:
    if size != entry.bytes or sha256 != entry.sha256:
        raise InvalidCheckpointStateError(
            f"snapshot file {path} does not match the manifest (tampered or corrupt): "
            f"{size} bytes sha256 {sha256[:16]}…, expected {entry.bytes} bytes "
            f"sha256 {entry.sha256[:16]}…"
        )


def read_checked(fs: Filesystem, folder: str, entry: FileEntry) -> bytes:
    """The bytes of the file ``entry`` names in ``folder``, checked against its digest."""
    path = inside(folder, entry.path)
    try:
        data = fs.read_bytes(path)
    except FileNotFoundError:
        raise InvalidCheckpointStateError(f"snapshot file {path} is missing") from None
    except OSError as exc:
        raise InvalidCheckpointStateError(f"cannot read {path}: {exc}") from None
    check_digest(path, digest_bytes(data).sha256, len(data), entry)
    return data


def check_publishable(
    fs: Filesystem, root: str, staging: Staging, manifest: SnapshotManifest
) -> tuple[list[ParticipantEntry], frozenset[str]]:
    """Refuse a manifest its staging folder does not match; return its participant
    entries stamped with the digest of each participant's manifest file, and the
    shared records files the snapshot names (its trainer files' and participants')."""
    if manifest.snapshot_id != staging.snapshot_id:
        raise BadRequestError(
            f"manifest is for snapshot {manifest.snapshot_id}, staging is {staging.snapshot_id}"
        )
    if manifest.schema_version != SNAPSHOT_MANIFEST_VERSION:
        raise BadRequestError(
            f"a new manifest must have schema_version {SNAPSHOT_MANIFEST_VERSION}, "
            f"got {manifest.schema_version}"
        )
    wanted = [entry.path for entry in manifest.files.values()]
    wanted += [participant.manifest_path for participant in manifest.participants]
    missing = [
        relative for relative in wanted if not fs.exists(resolve_inside(staging.path, relative))
    ]
    if missing:
        raise SnapshotError(
            f"snapshot {staging.snapshot_id} names files its staging folder lacks: "
            + ", ".join(missing)
        )
    references: set[str] = set()
    for name, entry in manifest.files.items():
        if entry.format == "records":
            path = resolve_inside(staging.path, entry.path)
            try:
                data = fs.read_bytes(path)
            except OSError as exc:
                raise SnapshotError(f"cannot read {path}: {exc}") from None
            names = trainer_shared_files(data, path)
            _check_objects(fs, root, staging, f"trainer file {name}", names)
            references |= names
    entries = []
    for participant in manifest.participants:
        path = resolve_inside(staging.path, participant.manifest_path)
        try:
            data = fs.read_bytes(path)
        except OSError as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None
        digest = digest_bytes(data)
        names = participant_shared_files(data, path)
        _check_objects(fs, root, staging, f"participant {participant.instance}", names)
        references |= names
        entries.append(
            participant.model_copy(update={"sha256": digest.sha256, "bytes": digest.bytes})
        )
    return entries, frozenset(references)


def _check_objects(fs: Filesystem, root: str, staging: Staging, who: str, names: set[str]) -> None:
    lacking = [name for name in sorted(names) if not fs.exists(fs.join(root, OBJECTS_DIR, name))]
    if lacking:
        raise SnapshotError(
            f"snapshot {staging.snapshot_id}: {who} names records files missing from "
            f"{OBJECTS_DIR}/: " + ", ".join(lacking)
        )


def verify_contents(fs: Filesystem, root: str, folder: str, manifest: SnapshotManifest) -> None:
    """Every file the published ``manifest`` (in ``folder``) names checks out."""
    for name, entry in manifest.files.items():
        if entry.format == "records":
            verify_trainer_records(
                fs,
                root,
                inside(folder, entry.path),
                read_checked(fs, folder, entry),
                name=name,
                snapshot_id=manifest.snapshot_id,
            )
        else:
            _verify_file(fs, folder, name, entry)
    for participant in manifest.participants:
        manifest_path = inside(folder, participant.manifest_path)
        directory, _, file_name = manifest_path.rpartition("/")
        if file_name != MANIFEST_NAME:
            raise InvalidCheckpointStateError(
                f"snapshot {manifest.snapshot_id}: participant {participant.instance} "
                f"manifest path {participant.manifest_path!r} does not end in {MANIFEST_NAME}"
            )
        verify_participant_state(
            directory,
            kind=participant.kind.value,
            instance=participant.instance,
            checkpoint_id=manifest.checkpoint_id,
            root=root,
        )
        if participant.sha256 is not None and participant.bytes is not None:
            # Its records are digest-checked above; this covers the manifest's own fields.
            entry = FileEntry(
                path=participant.manifest_path,
                sha256=participant.sha256,
                bytes=participant.bytes,
            )
            _verify_file(fs, folder, f"{participant.instance} manifest", entry)


def _verify_file(fs: Filesystem, folder: str, name: str, entry: FileEntry) -> None:
    path = inside(folder, entry.path)
    try:
        digest = digest_file(fs, path)
    except FileNotFoundError:
        raise InvalidCheckpointStateError(f"snapshot file {name!r} ({path}) is missing") from None
    except OSError as exc:
        raise InvalidCheckpointStateError(f"cannot read snapshot file {path}: {exc}") from None
    check_digest(path, digest.sha256, digest.bytes, entry)
