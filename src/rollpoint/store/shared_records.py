"""Which shared records files each snapshot names, and the sweep of those none names.

Owns :class:`SharedRecords`: the store's memo of the records files in ``objects/`` each
published snapshot names (read once from its trainer files and participant manifests: a
published snapshot never changes), and :meth:`~SharedRecords.sweep`, which deletes the
files no snapshot or staging folder names any more (and the temp files of writes that
died). A records file is shared by the snapshots that name it, so only this walk over every
folder decides that one is no longer needed. Blocking I/O: called in the publish thread.
"""

from __future__ import annotations

import logging
import time

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.manifest import decode_document, load_participant_manifest
from rollpoint.store.filesystem import Filesystem
from rollpoint.store.participant_state import MANIFEST_NAME
from rollpoint.store.record_packs import OBJECTS_DIR, is_records_name, is_records_temp_name
from rollpoint.store.staging import (
    SNAPSHOTS_DIR,
    STAGING_DIR,
    TRAINER_DIR,
    participant_manifests,
)
from rollpoint.store.trainer_records import trainer_shared_files

log = logging.getLogger("rollpoint.store")

_TEMP_RECORDS_AGE_S = 600.0
"""A records file still under its temp name this long after its last write was left by a
write that died; younger ones may belong to a write still running (one that timed out)."""


def participant_shared_files(data: bytes, path: str) -> set[str]:
    """The shared records files a participant manifest (``data``, read from ``path``) names."""
    manifest = load_participant_manifest(decode_document(data, path), path)
    return {part.file for part in manifest.parts if part.shared}


class SharedRecords:
    """The shared records files of the snapshots under ``root``."""

    def __init__(self, fs: Filesystem, root: str) -> None:
        self._fs = fs
        self._root = root
        self._snapshots_root = fs.join(root, SNAPSHOTS_DIR)
        self._named: dict[str, frozenset[str]] = {}
        """Shared records files named by each published snapshot (never changes)."""

    def remember(self, snapshot_id: str, names: frozenset[str]) -> None:
        """``snapshot_id`` was just published naming ``names`` (read for its checks: the
        sweep need not read its manifests again, snapshot_growth_100k, session 14)."""
        self._named[snapshot_id] = names

    def forget(self, snapshot_id: str) -> None:
        """``snapshot_id``'s folder is gone."""
        self._named.pop(snapshot_id, None)

    def named_by(self, snapshot_id: str) -> frozenset[str]:
        """The shared records files published snapshot ``snapshot_id`` names."""
        known = self._named.get(snapshot_id)
        if known is None:
            folder = self._fs.join(self._snapshots_root, snapshot_id)
            known = self._named[snapshot_id] = frozenset(self._names_in(folder))
        return known

    def sweep(self) -> None:
        """Delete the shared records files no snapshot folder names any more."""
        objects = self._fs.join(self._root, OBJECTS_DIR)
        try:
            names = self._fs.listdir(objects)
        except OSError:
            return  # no shared records files (yet)
        if not names:
            return
        try:
            referenced = self._referenced()
        except (OSError, RollpointError) as exc:
            # A folder whose references cannot be read might name any file: keep them all.
            log.warning("kept every records file in %s: %s", objects, exc)
            return
        now = time.time()
        for name in names:
            path = self._fs.join(objects, name)
            try:
                if name.startswith("."):
                    if not is_records_temp_name(name):
                        continue
                    modified = self._fs.modified(path)
                    if modified is None or now - modified < _TEMP_RECORDS_AGE_S:
                        continue
                elif name in referenced or not is_records_name(name):
                    continue  # named by a snapshot, or not a file this store writes
                self._fs.remove_file(path)
                log.info("removed records file %s: no kept snapshot names it", name)
            except OSError as exc:
                log.warning("could not remove records file %s (skipped): %s", path, exc)

    def _referenced(self) -> set[str]:
        """The shared records files named in every snapshot and staging folder."""
        referenced: set[str] = set()
        folders: list[tuple[str | None, str]] = [
            (name, self._fs.join(self._snapshots_root, name))
            for name in self._fs.listdir(self._snapshots_root)
        ]
        staging = self._fs.join(self._root, STAGING_DIR)
        if self._fs.local and self._fs.isdir(staging):
            folders += [(None, self._fs.join(staging, name)) for name in self._fs.listdir(staging)]
        for snapshot_id, folder in folders:
            published = snapshot_id is not None and self._fs.exists(
                self._fs.join(folder, MANIFEST_NAME)
            )
            known = self._named.get(snapshot_id) if snapshot_id is not None else None
            if known is None:
                known = frozenset(self._names_in(folder))
                if published and snapshot_id is not None:
                    self._named[snapshot_id] = known
            referenced |= known
        return referenced

    def _names_in(self, folder: str) -> set[str]:
        names: set[str] = set()
        trainer = self._fs.join(folder, TRAINER_DIR)
        if self._fs.isdir(trainer):
            for name in self._fs.listdir(trainer):
                if name.startswith("."):
                    continue  # a temp file of a write that did not finish
                path = self._fs.join(trainer, name)
                names |= trainer_shared_files(self._fs.read_bytes(path), path)
        for _, _, path, data in participant_manifests(self._fs, folder):
            names |= participant_shared_files(data, path)
        return names
