"""Journal retention: the journal segments no snapshot in a store needs any more, deleted.

Owns deciding, from the snapshots published in a store, which segments of each journal
folder (``<root>/journal/<kind>/<instance>/``, docs/journal.md) a restore could still read,
and deleting the others through the store's (contained) filesystem. The snapshot store
calls :meth:`JournalRetention.sweep` after each publication has pruned its snapshots.

What a snapshot needs: each participant manifest of a snapshot saves the position its
participant's journal had when the cut opened (:class:`~rollpoint.protocol.manifest.JournalMark`);
a restore from that snapshot replays the records after it. So a journal folder needs every
segment from the oldest marked segment among the snapshots published here, and nothing
before it. Conservative on every doubt:

- a snapshot holding that participant *without* a mark (it did not journal then) needs the
  whole folder: nothing of it is deleted;
- a folder no snapshot names is left as it is (a replica no cut has covered yet);
- every published snapshot counts, this job's and another's (a store shared across jobs
  never loses a segment another job's snapshot names); staging folders do not, since
  the store's one writer publishes one snapshot at a time and a later cut's marks are
  never older than a published one's;
- only files named like a segment (``segment-<10 digits>.rpj``) are ever removed: set-aside
  (``.untrusted``) and migrated originals (``.v<n>``) stay, as the journal promises;
- a manifest that cannot be read keeps every segment of every folder (warned once per sweep).

The active segment is never removed: a mark names a segment its writer had reached, and
only segments numbered below the oldest mark go. A server still holding a removed segment
in its index forgets it when it next opens a cut or looks a key up there
(:meth:`~rollpoint.store.journal.Journal.forget_removed`).

It does not know what a record means, nor which snapshots to keep (:mod:`.retention`).
Blocking I/O: call it from a worker thread in async code.
"""

from __future__ import annotations

import logging

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.manifest import decode_document, load_participant_manifest
from rollpoint.store.filesystem import Filesystem
from rollpoint.store.journal_format import segment_number
from rollpoint.store.staging import participant_manifests

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"

Needs = dict[str, int]
"""Journal folder (relative to the store root) → the oldest segment a snapshot needs."""


class JournalRetention:
    """The journal half of a store's retention; remembers each published snapshot's needs
    (a published snapshot never changes) so a sweep reads only the new ones."""

    def __init__(self, fs: Filesystem, root: str) -> None:
        self._fs = fs
        self._root = root
        self._known: dict[str, Needs] = {}

    def forget(self, snapshot_id: str) -> None:
        """``snapshot_id`` was pruned: it needs nothing any more."""
        self._known.pop(snapshot_id, None)

    def needs(self, snapshots_root: str, snapshot_ids: list[str]) -> Needs:
        """The oldest segment each journal folder must keep for these published snapshots."""
        needed: Needs = {}
        for snapshot_id in snapshot_ids:
            known = self._known.get(snapshot_id)
            if known is None:
                folder = self._fs.join(snapshots_root, snapshot_id)
                known = self._known[snapshot_id] = self._needs_of(folder)
            for journal, segment in known.items():
                needed[journal] = min(segment, needed.get(journal, segment))
        return needed

    def _needs_of(self, folder: str) -> Needs:
        needed: Needs = {}
        for kind, instance, path, data in participant_manifests(self._fs, folder):
            manifest = load_participant_manifest(decode_document(data, path), path)
            mark = manifest.journal
            if mark is None:
                needed[f"{JOURNAL_DIR}/{kind}/{instance}"] = 0  # not journaled: keep all
            else:
                needed[mark.folder] = min(mark.segment, needed.get(mark.folder, mark.segment))
        return needed

    def sweep(self, snapshots_root: str, snapshot_ids: list[str]) -> list[str]:
        """Delete the segments no published snapshot in ``snapshot_ids`` needs; returns
        their paths relative to the root. Keeps everything when a manifest is unreadable."""
        if not self._fs.isdir(self._fs.join(self._root, JOURNAL_DIR)):
            return []
        try:
            needed = self.needs(snapshots_root, snapshot_ids)
        except (OSError, RollpointError) as exc:
            log.warning("kept every journal segment in %s: %s", self._root, exc)
            return []
        removed = []
        for journal, oldest in sorted(needed.items()):
            folder = self._fs.join(self._root, journal)
            try:
                names = self._fs.listdir(folder)
            except OSError:
                continue  # named by a snapshot, never written here (or on another machine)
            for name in names:
                number = segment_number(name)
                if number is None or number >= oldest:
                    continue
                try:
                    self._fs.remove_file(self._fs.join(folder, name))
                except OSError as exc:
                    log.warning("could not remove journal segment %s/%s: %s", journal, name, exc)
                    continue
                removed.append(f"{journal}/{name}")
        if removed:
            log.info("removed %d journal segment(s) no kept snapshot needs", len(removed))
        return removed
