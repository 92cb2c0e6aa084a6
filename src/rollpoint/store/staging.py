"""A snapshot being written: its handle, its folder layout and its lifecycle.

Owns :class:`Staging` (what the coordinator writes through and hands to participants),
where a participant's state goes inside a snapshot folder (:func:`participant_subdir`),
and the one transition table of a staging's life::

    open ──write──▶ open
    open ──begin_publish──▶ publishing ──finish──▶ published
                            publishing ──refuse──▶ open      (manifest refused, nothing moved)
                            publishing ──fail────▶ aborted   (I/O failed, folder removed)
    open ──abort──▶ aborted ──abort──▶ aborted

Also reads what that layout holds once written: the participants' manifests of a snapshot
folder (:func:`participant_manifests`, for retention's and the fallback's walks), and
removes the unpublished folders a crashed process left (:func:`remove_leftovers`). It writes
no file: :mod:`rollpoint.store.snapshot_store` does, asking :class:`StagingRegistry` first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from rollpoint.protocol.errors import BadRequestError, CheckpointConflictError, InvalidPhaseError
from rollpoint.protocol.ids import is_identifier
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.filesystem import Filesystem, normalize_relative
from rollpoint.store.participant_state import MANIFEST_NAME

STAGING_DIR = "staging"
"""Where a snapshot is written before it is published (local roots only)."""
SNAPSHOTS_DIR = "snapshots"
"""Where published snapshots live, one folder each."""
TRAINER_DIR = "trainer"
"""A snapshot folder's trainer files kept as records."""
PARTICIPANTS_DIR = "participants"

log = logging.getLogger("rollpoint.store")

_PROCESS_STARTED_AT = time.time()
"""Folders last touched before this were left by an earlier process (a crash)."""


def participant_manifests(fs: Filesystem, folder: str) -> Iterator[tuple[str, str, str, bytes]]:
    """Each participant manifest written in the snapshot ``folder``: ``(kind, instance,
    path, bytes)``; a participant that never wrote its manifest has none (skipped)."""
    participants = fs.join(folder, PARTICIPANTS_DIR)
    if not fs.isdir(participants):
        return
    for kind in fs.listdir(participants):
        for instance in fs.listdir(fs.join(participants, kind)):
            path = fs.join(participants, kind, instance, MANIFEST_NAME)
            try:
                data = fs.read_bytes(path)
            except FileNotFoundError:
                continue
            yield kind, instance, path, data


def participant_subdir(kind: ParticipantKind | str, instance: str) -> str:
    """A participant's state folder relative to its snapshot folder: ``participants/<kind>/<instance>``."""
    try:
        participant_kind = ParticipantKind(kind)
    except ValueError:
        raise BadRequestError(f"unknown participant kind {kind!r}") from None
    if not is_identifier(instance):
        raise BadRequestError(f"instance {instance!r} is not a valid identifier")
    return f"{PARTICIPANTS_DIR}/{participant_kind.value}/{instance}"


@dataclass(frozen=True)
class Staging:
    """A snapshot being written; hand ``relative_dir`` to the participants."""

    snapshot_id: str
    relative_dir: str
    """The staging folder relative to the store root (``staging/<id>`` or ``snapshots/<id>``)."""
    path: str
    """The staging folder as a local path or URL."""

    @property
    def participants_relative_dir(self) -> str:
        """The ``dir`` of a commit: each participant writes into ``<it>/<kind>/<instance>``."""
        return f"{self.relative_dir}/{PARTICIPANTS_DIR}"

    def participant_dir(self, kind: ParticipantKind | str, instance: str) -> str:
        """Where one participant writes its state for this snapshot (path or URL)."""
        return f"{self.path}/{participant_subdir(kind, instance)}"


class StagingState(StrEnum):
    OPEN = "open"
    """Being written: files and participant states may be added."""
    PUBLISHING = "publishing"
    """Its manifest is being checked and written; nothing else may touch it."""
    PUBLISHED = "published"
    """Its manifest is written: it is a snapshot now."""
    ABORTED = "aborted"
    """Removed; it will never be published."""


class StagingAction(StrEnum):
    WRITE = "write"
    BEGIN_PUBLISH = "publish"
    REFUSE = "refuse"
    FINISH = "finish"
    FAIL = "fail"
    ABORT = "abort"


_TRANSITIONS: dict[tuple[StagingState, StagingAction], StagingState] = {
    (StagingState.OPEN, StagingAction.WRITE): StagingState.OPEN,
    (StagingState.OPEN, StagingAction.BEGIN_PUBLISH): StagingState.PUBLISHING,
    (StagingState.PUBLISHING, StagingAction.REFUSE): StagingState.OPEN,
    (StagingState.PUBLISHING, StagingAction.FINISH): StagingState.PUBLISHED,
    (StagingState.PUBLISHING, StagingAction.FAIL): StagingState.ABORTED,
    (StagingState.OPEN, StagingAction.ABORT): StagingState.ABORTED,
    (StagingState.ABORTED, StagingAction.ABORT): StagingState.ABORTED,
}


class StagingRegistry:
    """The state of every staging one store opened; thread-safe."""

    def __init__(self) -> None:
        self._states: dict[str, StagingState] = {}
        self._lock = threading.Lock()

    def open(self, snapshot_id: str) -> None:
        with self._lock:
            if snapshot_id in self._states:
                raise CheckpointConflictError(
                    f"snapshot {snapshot_id} already exists or is being written "
                    f"(this store opened it before: {self._states[snapshot_id].value})"
                )
            self._states[snapshot_id] = StagingState.OPEN

    def forget(self, snapshot_id: str) -> None:
        """Undo :meth:`open` when the folder could not be created."""
        with self._lock:
            self._states.pop(snapshot_id, None)

    def advance(self, staging: Staging, action: StagingAction) -> StagingState:
        """Apply ``action``, or refuse it with :class:`InvalidPhaseError` naming the state."""
        with self._lock:
            state = self._states.get(staging.snapshot_id)
            new = None if state is None else _TRANSITIONS.get((state, action))
            if new is None:
                where = state.value if state is not None else "not open in this store"
                raise InvalidPhaseError(
                    f"cannot {action.value} staging {staging.snapshot_id}: it is {where}"
                )
            self._states[staging.snapshot_id] = new
            return new


def remove_leftovers(fs: Filesystem, root: str) -> None:
    """Remove unpublished folders an earlier process left behind when it crashed."""
    snapshots = fs.join(root, SNAPSHOTS_DIR)
    folders = [fs.join(root, STAGING_DIR, name) for name in fs.listdir(fs.join(root, STAGING_DIR))]
    folders += [
        fs.join(snapshots, name)
        for name in fs.listdir(snapshots)
        if not fs.exists(fs.join(snapshots, name, MANIFEST_NAME))
    ]
    for folder in folders:
        try:
            modified = fs.modified(folder)
            if modified is None or modified >= _PROCESS_STARTED_AT:
                continue
            fs.remove_tree(folder)
            log.warning("removed unpublished folder %s left by an earlier process", folder)
        except OSError as exc:
            log.warning("could not remove leftover folder %s (skipped): %s", folder, exc)


def trainer_file_path(name: str) -> str:
    """Where trainer file ``name`` goes in a snapshot folder; a name the layout reserves
    for itself (the manifest, the participants' and the records folders) is refused."""
    relative = normalize_relative(name)
    reserved = (f"{PARTICIPANTS_DIR}/", f"{TRAINER_DIR}/")
    if relative == MANIFEST_NAME or relative.startswith(reserved):
        raise BadRequestError(f"file name {name!r} is reserved by the snapshot layout")
    return relative
