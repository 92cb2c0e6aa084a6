"""The snapshot store: staging, atomic publication, retention and verified reads.

Owns the layout of a run's snapshot root (a local folder or an fsspec URL)::

    <root>/staging/<snapshot_id>/            being written (local roots only)
    <root>/snapshots/<snapshot_id>/          published once manifest.json is in it
        manifest.json                        SnapshotManifest, written last and sealed
        <files>                              trainer files (FileEntry digests in the manifest)
        trainer/<name>                       a trainer file kept as records (trainer_records)
        participants/<kind>/<instance>/      one participant's state (participant_state)
    <root>/objects/records-<hex>.jsonl       records files shared by snapshots (record_packs)
    <root>/latest                            LatestPointer to the newest published snapshot
    <root>/journal/<kind>/<instance>/        participants' journals (docs/journal.md): the
                                             segments no kept snapshot needs are deleted
                                             with the snapshots (:mod:`.journal_retention`)

Publication: on a local root, :meth:`SnapshotStore.publish` renames the staging folder
into ``snapshots/`` (atomic) and then writes the manifest (temp file + rename); on an
fsspec URL there is no cheap folder rename, so the snapshot is written in its final
folder from the start (copy-free) and the manifest, one object put, is the publication
point. Either way a folder without a manifest was never published and is never listed
as valid. The manifest is sealed at publication (:func:`seal_manifest`): it carries the
digest of every file it names (the trainer's files and each participant's manifest) and
of each of its own fields, so a reader refuses a manifest edited after the fact, naming
the field. ``latest`` is moved after the manifest and is advisory: readers choose the
newest snapshot that verifies, so a crash between the two loses nothing.

Records files in ``objects/`` are named by the participant manifests and trainer file
manifests of the snapshots that reference them: publication refuses a snapshot naming one
that is not there (:mod:`.snapshot_checks`, with the digest checks of every read), and
retention deletes one once no snapshot folder left, published or being written, names it
(:mod:`.shared_records`). That holds because the store has one writer at a time (the
workdir lock) and the coordinator takes one snapshot at a time.

It does not know what the trainer's files or the participants' records mean, nor when a
snapshot is taken (the coordinator does). Every method does blocking I/O: call it from a
worker thread in async code.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollpoint.protocol.errors import (
    BadRequestError,
    CheckpointConflictError,
    ConfigError,
    InvalidCheckpointStateError,
    NotFoundError,
    RollpointError,
    SnapshotError,
)
from rollpoint.protocol.ids import is_identifier
from rollpoint.protocol.manifest import (
    FileEntry,
    LatestPointer,
    SnapshotManifest,
    decode_document,
    encode_document,
    load_snapshot_manifest,
    sealed_document,
)
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store import retention
from rollpoint.store.contained_filesystem import filesystem_within
from rollpoint.store.filesystem import (
    normalize_location,
    resolve_inside,
)
from rollpoint.store.job_identity import FINGERPRINT_KEY as JOB_KEY
from rollpoint.store.journal_retention import JournalRetention
from rollpoint.store.participant_state import MANIFEST_NAME
from rollpoint.store.record_packs import (
    PackIndex,
)
from rollpoint.store.retention import Span
from rollpoint.store.shared_records import SharedRecords
from rollpoint.store.snapshot_checks import (
    SnapshotSummary,
    check_publishable,
    inside,
    read_checked,
    summary_of,
    verify_contents,
)
from rollpoint.store.staging import (
    PARTICIPANTS_DIR,
    SNAPSHOTS_DIR,
    STAGING_DIR,
    TRAINER_DIR,
    Staging,
    StagingAction,
    StagingRegistry,
    participant_subdir,
    remove_leftovers,
    trainer_file_path,
)
from rollpoint.store.trainer_records import (
    read_trainer_records,
    write_trainer_records,
)

__all__ = [
    "LATEST_NAME",
    "PARTICIPANTS_DIR",
    "SNAPSHOTS_DIR",
    "STAGING_DIR",
    "SnapshotStore",
    "SnapshotSummary",
    "Staging",
    "participant_subdir",
    "resolve_inside",
]

log = logging.getLogger("rollpoint.store")

LATEST_NAME = "latest"


@dataclass(frozen=True)
class _Candidate:
    """A snapshot folder with a manifest file, loadable or not, for ordering."""

    snapshot_id: str
    order_time: float
    span: Span | None
    """What it composes with; None when its manifest does not load."""
    error: str | None


class SnapshotStore:
    """Snapshots of one run under ``root`` (a local path or an fsspec URL)."""

    def __init__(self, root: str, keep: int = 3, *, clean_leftovers: bool = True) -> None:
        """Open the store; ``clean_leftovers=False`` for read-only tools on a live run."""
        if keep < 1:
            raise ConfigError(f"snapshot retention must keep at least 1 snapshot, got {keep}")
        self.root = normalize_location(root)
        self.keep = keep
        # Contained on a local root: no write, prune or sweep follows a symlink put in the
        # store (objects/ swapped for a link once sent the trainer's records and the sweep's
        # deletes into the folder it named: issue 33).
        self._fs = filesystem_within(self.root, self.root)
        self._stagings = StagingRegistry()
        self._pins: Counter[str] = Counter()
        self._kept_fallback: str | None = None
        """The fallback the last prune kept (:meth:`_fallback`)."""
        self._loaded: dict[str, tuple[float, Span]] = {}
        """Publication time and span of manifests already loaded, for ordering and
        retention (a manifest never changes once published; a manifest of 100k episodes
        is tens of MB of objects, so only these are kept; :meth:`verify` and :meth:`load`
        always read afresh)."""
        self._shared = SharedRecords(self._fs, self.root)
        """Which shared records files each snapshot names (:mod:`.shared_records`)."""
        self._journals = JournalRetention(self._fs, self.root)
        """The journal segments the published snapshots need (:mod:`.journal_retention`)."""
        self.job_id: str | None = None
        """The job this store serves (:mod:`~rollpoint.store.job_identity`): retention
        never prunes a snapshot another job took. None: every snapshot is this job's."""
        self._left_alone: set[str] = set()
        self._jobs: dict[str, str | None] = {}
        """The job each loaded manifest names in its config fingerprint (None: older)."""
        self.checkpoint_steps: Callable[[], list[int]] | None = None
        """The durable train checkpoint steps present, when the trainer keeps any: retention
        then never prunes the last snapshot that composes with one (:mod:`.retention`)."""
        if clean_leftovers:
            remove_leftovers(self._fs, self.root)

    # --- retention pins ----------------------------------------------------------------

    def pin(self, snapshot_id: str) -> None:
        """Keep ``snapshot_id`` through retention until as many :meth:`unpin` calls: a lost
        replica's held tries are restored from it, however many snapshots publish first."""
        self._pins[snapshot_id] += 1

    def unpin(self, snapshot_id: str) -> None:
        """Undo one :meth:`pin`; the next publication prunes the snapshot if it is old."""
        if self._pins[snapshot_id] <= 1:
            self._pins.pop(snapshot_id, None)
        else:
            self._pins[snapshot_id] -= 1

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(self._pins)

    @property
    def kept_fallback(self) -> frozenset[str]:
        """The fallback snapshot the last publication kept beyond the ``keep`` newest (one
        sharing no records file with the newest; empty when there is none): the train
        checkpoint it composes with must be kept too, or the fallback cannot be restored
        (chaos ``pack_damage``: it was pruned, and the damage took the run down)."""
        return frozenset() if self._kept_fallback is None else frozenset({self._kept_fallback})

    # --- writing -----------------------------------------------------------------------

    def begin(self, snapshot_id: str) -> Staging:
        """Create the folder a new snapshot is written into."""
        final = self.snapshot_dir(snapshot_id)
        relative = f"{STAGING_DIR if self._fs.local else SNAPSHOTS_DIR}/{snapshot_id}"
        path = self._fs.join(self.root, relative)
        self._stagings.open(snapshot_id)
        try:
            if self._fs.exists(final) or self._fs.exists(path):
                raise CheckpointConflictError(
                    f"snapshot {snapshot_id} already exists or is being written in {self.root}"
                )
            self._fs.makedirs(path)
        except OSError as exc:
            self._stagings.forget(snapshot_id)
            raise SnapshotError(f"cannot create {path}: {exc}") from None
        except BaseException:
            self._stagings.forget(snapshot_id)
            raise
        return Staging(snapshot_id=snapshot_id, relative_dir=relative, path=path)

    def write_file(self, staging: Staging, name: str, data: bytes | Iterable[bytes]) -> FileEntry:
        """Write one trainer file (ledger, the finished queue) into the staging folder; return its entry.

        ``data`` may come in parts (written and hashed one after the other, never joined),
        so a large file need not exist as one buffer.
        """
        self._stagings.advance(staging, StagingAction.WRITE)
        relative = trainer_file_path(name)
        path = resolve_inside(staging.path, relative)
        hasher = hashlib.sha256()
        size = 0
        try:
            self._fs.makedirs(path.rsplit("/", 1)[0])
            with self._fs.open_write(path) as stream:
                for part in (data,) if isinstance(data, bytes) else data:
                    hasher.update(part)
                    stream.write(part)
                    size += len(part)
        except OSError as exc:
            raise SnapshotError(f"cannot write {path}: {exc}") from None
        return FileEntry(path=relative, sha256=hasher.hexdigest(), bytes=size)

    def write_records(
        self, staging: Staging, name: str, records: Sequence[Mapping[str, Any]], index: PackIndex
    ) -> FileEntry:
        """Write one trainer file kept as records (``trainer/<name>``, naming parts of the
        shared records files); return its entry. Only what ``index`` (the file's, kept
        between snapshots) does not hold is written; ``index`` becomes this write's."""
        self._stagings.advance(staging, StagingAction.WRITE)
        relative = f"{TRAINER_DIR}/{trainer_file_path(name)}"
        return write_trainer_records(
            self._fs,
            self.root,
            resolve_inside(staging.path, relative),
            name=name,
            relative=relative,
            snapshot_id=staging.snapshot_id,
            records=records,
            index=index,
        )

    def publish(self, staging: Staging, manifest: SnapshotManifest) -> SnapshotManifest:
        """Publish the staged snapshot with ``manifest`` (stamped with ``published_at``).

        A refused manifest leaves the staging open; a failed write removes it (as abort).
        """
        self._stagings.advance(staging, StagingAction.BEGIN_PUBLISH)
        try:
            participants, references = check_publishable(self._fs, self.root, staging, manifest)
        except BaseException:
            self._stagings.advance(staging, StagingAction.REFUSE)
            raise
        published, encoded = sealed_document(
            manifest.model_copy(update={"published_at": time.time(), "participants": participants})
        )
        final = self.snapshot_dir(staging.snapshot_id)
        moved = staging.path == final
        try:
            if not moved:
                self._fs.makedirs(self._snapshots_root())
                self._fs.rename(staging.path, final)
                moved = True
                self._fs.sync_dir(self._snapshots_root())
            self._fs.publish_bytes(self._fs.join(final, MANIFEST_NAME), encoded)
        except OSError as exc:
            self._stagings.advance(staging, StagingAction.FAIL)
            leftover = final if moved else staging.path
            try:
                self._fs.remove_tree(leftover)
            except OSError as cleanup:
                # The store that refused the write may refuse the removal too (a full or
                # failing disk). The folder has no manifest, so nothing trusts it; the
                # next start removes it as unpublished (chaos run, trials 90, 532, 829).
                log.warning("could not remove unpublished folder %s: %s", leftover, cleanup)
            raise SnapshotError(f"cannot publish snapshot {staging.snapshot_id}: {exc}") from None
        self._stagings.advance(staging, StagingAction.FINISH)
        # Retention orders snapshots by what their manifests say: this one's is in hand, so
        # it is not read back and validated again (at 100k in flight that validation of its
        # episode list took half of every publish: snapshot_growth_100k, session 13).
        self._loaded[published.snapshot_id] = (published.published_at, _span(published))
        job = published.config_fingerprint.get(JOB_KEY)
        self._jobs[published.snapshot_id] = job if isinstance(job, str) else None
        # And the records files it names were just read for the checks: the sweep need
        # not read its manifests again (snapshot_growth_100k, session 14).
        self._shared.remember(published.snapshot_id, references)
        log.info("published snapshot %s at %s", published.snapshot_id, final)
        self._write_latest(published)
        self._prune(protect=published.snapshot_id)
        return published

    def abort(self, staging: Staging) -> None:
        """Remove a staging folder that will not be published (idempotent)."""
        self._stagings.advance(staging, StagingAction.ABORT)
        try:
            self._fs.remove_tree(staging.path)
        except OSError as exc:
            log.warning("could not remove aborted staging folder %s: %s", staging.path, exc)

    # --- reading -----------------------------------------------------------------------

    def snapshot_dir(self, snapshot_id: str) -> str:
        if not is_identifier(snapshot_id):
            raise BadRequestError(f"snapshot id {snapshot_id!r} is not a valid identifier")
        return self._fs.join(self.root, SNAPSHOTS_DIR, snapshot_id)

    def load(self, snapshot_id: str) -> SnapshotManifest:
        """The manifest of a published snapshot (its files are not verified: see verify)."""
        path = self._fs.join(self.snapshot_dir(snapshot_id), MANIFEST_NAME)
        try:
            data = self._fs.read_bytes(path)
        except FileNotFoundError:
            raise NotFoundError(
                f"snapshot {snapshot_id} is not published in {self.root} (no {path})"
            ) from None
        except OSError as exc:
            raise InvalidCheckpointStateError(f"cannot read {path}: {exc}") from None
        what = f"snapshot manifest {path}"
        manifest = load_snapshot_manifest(decode_document(data, what), what)
        if manifest.snapshot_id != snapshot_id:
            raise InvalidCheckpointStateError(
                f"{what} names snapshot {manifest.snapshot_id}, but lives in folder {snapshot_id}"
            )
        return manifest

    def verify(self, snapshot_id: str) -> SnapshotManifest:
        """The manifest, once every file and participant state it names checks out."""
        manifest = self.load(snapshot_id)
        verify_contents(self._fs, self.root, self.snapshot_dir(manifest.snapshot_id), manifest)
        return manifest

    def read_file(self, snapshot_id: str, name: str) -> bytes:
        """The bytes of one trainer file of a snapshot, checked against its digest."""
        manifest = self.load(snapshot_id)
        entry = self._file_entry(manifest, name)
        return read_checked(self._fs, self.snapshot_dir(snapshot_id), entry)

    def file_format(self, snapshot_id: str, name: str) -> str:
        """How trainer file ``name`` of a snapshot is kept: ``document`` or ``records``."""
        return self._file_entry(self.load(snapshot_id), name).format

    def read_records(self, snapshot_id: str, name: str) -> list[dict[str, Any]]:
        """The records of a trainer file kept as records, every part verified."""
        manifest = self.load(snapshot_id)
        entry = self._file_entry(manifest, name)
        if entry.format != "records":
            raise InvalidCheckpointStateError(
                f"snapshot {snapshot_id}: file {name!r} is a {entry.format}, not records"
            )
        folder = self.snapshot_dir(snapshot_id)
        data = read_checked(self._fs, folder, entry)
        return read_trainer_records(
            self._fs,
            self.root,
            inside(folder, entry.path),
            data,
            name=name,
            snapshot_id=manifest.snapshot_id,
        )

    def _file_entry(self, manifest: SnapshotManifest, name: str) -> FileEntry:
        entry = manifest.files.get(name)
        if entry is None:
            known = ", ".join(sorted(manifest.files)) or "none"
            raise NotFoundError(
                f"snapshot {manifest.snapshot_id} has no file {name!r} (it has: {known})"
            )
        return entry

    def participant_dir(self, snapshot_id: str, kind: ParticipantKind | str, instance: str) -> str:
        """The state folder of one participant of a published snapshot."""
        manifest = self.load(snapshot_id)
        for participant in manifest.participants:
            if participant.kind == kind and participant.instance == instance:
                path = inside(self.snapshot_dir(snapshot_id), participant.manifest_path)
                return path.rpartition("/")[0]
        known = ", ".join(f"{p.kind}/{p.instance}" for p in manifest.participants) or "none"
        raise NotFoundError(
            f"snapshot {snapshot_id} has no participant {kind}/{instance} (it has: {known})"
        )

    def list_snapshots(self, *, include_invalid: bool = False) -> list[SnapshotSummary]:
        """Published snapshots that verify, newest first; with the others and why if asked."""
        summaries = [self._summarize(name) for name in self._fs.listdir(self._snapshots_root())]
        if not include_invalid:
            summaries = [summary for summary in summaries if summary.valid]
        summaries.sort(key=lambda s: (self._order_time(s), s.snapshot_id), reverse=True)
        return summaries

    def _order_time(self, summary: SnapshotSummary) -> float:
        """When it was published; for a manifest that does not load (tampered), the time
        its file was written, so it is listed (and skipped, with its reason) in its place
        rather than last."""
        if summary.published_at is not None:
            return summary.published_at
        manifest_path = self._fs.join(self._snapshots_root(), summary.snapshot_id, MANIFEST_NAME)
        try:
            modified = self._fs.modified(manifest_path) if self._fs.exists(manifest_path) else None
        except OSError:
            modified = None
        return modified if modified is not None else float("-inf")

    def spans(self) -> list[Span]:
        """Every loadable published snapshot's composing span, newest first (for retention)."""
        return [c.span for c in self._candidates() if c.span is not None]

    def latest(self) -> SnapshotManifest | None:
        """The newest snapshot that verifies; a broken newer one is skipped with a warning."""
        for candidate in self._candidates():
            reason = candidate.error
            if reason is None:
                try:
                    return self.verify(candidate.snapshot_id)
                except RollpointError as exc:
                    reason = exc.message
            log.warning(
                "snapshot %s in %s is unusable, falling back to the previous one: %s",
                candidate.snapshot_id,
                self.root,
                reason,
            )
        return None

    # --- internals ---------------------------------------------------------------------

    def _snapshots_root(self) -> str:
        return self._fs.join(self.root, SNAPSHOTS_DIR)

    def _summarize(self, name: str) -> SnapshotSummary:
        path = self._fs.join(self._snapshots_root(), name)
        manifest: SnapshotManifest | None = None
        try:
            manifest = self.load(name)
            verify_contents(self._fs, self.root, self.snapshot_dir(manifest.snapshot_id), manifest)
        except RollpointError as exc:
            return summary_of(name, path, manifest, exc.message)
        return summary_of(name, path, manifest, None)

    def _candidates(self) -> list[_Candidate]:
        """Folders holding a manifest file, newest first (published_at, else the file's time)."""
        out: list[_Candidate] = []
        for name in self._fs.listdir(self._snapshots_root()):
            manifest_path = self._fs.join(self._snapshots_root(), name, MANIFEST_NAME)
            if not self._fs.exists(manifest_path):
                continue
            brief = self._loaded.get(name)
            if brief is None:
                try:
                    manifest = self.load(name)
                except RollpointError as exc:
                    when = self._fs.modified(manifest_path) or 0.0
                    out.append(_Candidate(name, when, None, exc.message))
                    continue
                brief = self._loaded[name] = (manifest.published_at, _span(manifest))
                job = manifest.config_fingerprint.get(JOB_KEY)
                self._jobs[name] = job if isinstance(job, str) else None
            out.append(_Candidate(name, brief[0], brief[1], None))
        out.sort(key=lambda c: (c.order_time, c.snapshot_id), reverse=True)
        return out

    def _write_latest(self, manifest: SnapshotManifest) -> None:
        pointer = LatestPointer(
            snapshot_id=manifest.snapshot_id, published_at=manifest.published_at
        )
        try:
            self._fs.publish_bytes(self._fs.join(self.root, LATEST_NAME), encode_document(pointer))
        except OSError as exc:
            # The manifest is the publication point; the pointer only helps operators.
            log.warning(
                "could not move %s to snapshot %s: %s", LATEST_NAME, manifest.snapshot_id, exc
            )

    def _prune(self, protect: str) -> None:
        """Keep the ``keep`` newest loadable snapshots and the broken ones newer than them,
        and (with train checkpoints) the newest one that composes with one of them.

        Digests are not checked here: that would read every byte at every publication.
        """
        every = self._candidates()
        candidates = [c for c in every if not self._other_jobs(c.snapshot_id)]
        loadable = [c for c in candidates if c.span is not None]
        # A pin is set and cleared on the event loop while this runs in the publish
        # thread: a frozenset of the counter is one step under the GIL.
        kept = {c.snapshot_id for c in loadable[: self.keep]} | {protect} | self.pinned
        if self.checkpoint_steps is not None:
            decided = retention.plan(
                [c.span for c in loadable if c.span is not None],
                self.checkpoint_steps(),
                keep_snapshots=self.keep,
                keep_checkpoints=0,
                protect=kept,
            )
            kept = set(decided.snapshots)
        fallback = self._kept_fallback = self._fallback(protect, loadable)
        if fallback is not None:
            kept.add(fallback)
        oldest_kept = min(
            (c.order_time for c in loadable if c.snapshot_id in kept), default=float("-inf")
        )
        pruned: set[str] = set()
        for candidate in candidates:
            if candidate.snapshot_id in kept:
                continue
            if candidate.span is None and candidate.order_time >= oldest_kept:
                continue
            path = self._fs.join(self._snapshots_root(), candidate.snapshot_id)
            try:
                self._fs.remove_tree(path)
                self._loaded.pop(candidate.snapshot_id, None)
                self._shared.forget(candidate.snapshot_id)
                self._journals.forget(candidate.snapshot_id)
                pruned.add(candidate.snapshot_id)
                # Every per-snapshot memo goes with the folder: kept, one entry a snapshot
                # (one a train step) grew the trainer with rows trained (issue 33).
                self._jobs.pop(candidate.snapshot_id, None)
                log.info("pruned snapshot %s", candidate.snapshot_id)
            except OSError as exc:
                log.warning("could not prune snapshot %s (skipped): %s", path, exc)
        self._shared.sweep()
        # Every snapshot left counts, another job's too: its marks keep their segments.
        left = [c.snapshot_id for c in every if c.snapshot_id not in pruned]
        self._journals.sweep(self._snapshots_root(), left)

    def _fallback(self, newest: str, loadable: Sequence[_Candidate]) -> str | None:
        """The newest snapshot older than ``newest`` that names no records file
        ``newest`` names: one damaged shared file then costs no more than the snapshots
        naming it, and a restore falls back to this one (issue 33). None before the
        first rebase (the second write: :data:`~rollpoint.store.record_packs.FIRST_REBASE`)."""
        try:
            named = self._shared.named_by(newest)
            if not named:
                return None  # it shares nothing: no file of it can take another down
            for candidate in loadable:
                if candidate.snapshot_id == newest:
                    continue
                if not named & self._shared.named_by(candidate.snapshot_id):
                    return candidate.snapshot_id
        except (OSError, RollpointError) as exc:
            log.warning("no fallback snapshot chosen in %s: %s", self.root, exc)
        return None

    def other_jobs(self) -> dict[str, str]:
        """Snapshot id → the other job that took it, for every loadable snapshot here that
        names a job but not :attr:`job_id` (empty when ``job_id`` is None)."""
        self._candidates()  # loads the manifests not loaded yet
        return {
            sid: job
            for sid, job in sorted(self._jobs.items())
            if job is not None and self.job_id is not None and job != self.job_id
        }

    def _other_jobs(self, snapshot_id: str) -> bool:
        """Whether another job took this snapshot: never pruned from here."""
        job = self._jobs.get(snapshot_id)
        if job is not None and self.job_id is not None and job != self.job_id:
            if snapshot_id in self._left_alone:
                return True
            self._left_alone.add(snapshot_id)
            log.warning(
                "snapshot %s in %s belongs to job %s, not to this job %s: left alone",
                snapshot_id,
                self.root,
                job,
                self.job_id,
            )
            return True
        return False

    def clean_leftovers(self) -> None:
        """Remove unpublished folders an earlier process left behind when it crashed (done
        at opening unless ``clean_leftovers=False``: then once the store is known to be
        this job's, see :mod:`~rollpoint.store.job_identity`)."""
        remove_leftovers(self._fs, self.root)


def _span(manifest: SnapshotManifest) -> Span:
    return Span(manifest.snapshot_id, manifest.committed_step or 0, manifest.train_step)
