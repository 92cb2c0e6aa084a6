"""The snapshot store: the only place in rollpoint that knows about files.

- :mod:`~rollpoint.store.snapshot_store`: staging, publication, retention, verified reads
- :mod:`~rollpoint.store.participant_state`: one participant's records and manifest
- :mod:`~rollpoint.store.filesystem`: local folder or fsspec URL, and path containment
- :mod:`~rollpoint.store.digest`: streaming sha256 of snapshot files
- :mod:`~rollpoint.store.record_packs`: records files shared by snapshots, written once
- :mod:`~rollpoint.store.trainer_records`: the ledger and the finished queue kept as records
- :mod:`~rollpoint.store.journal`: a participant's journal: group commit, index by key, positions
- :mod:`~rollpoint.store.journal_format`: the journal's segments and records, byte by byte
- :mod:`~rollpoint.store.journal_scan`: what a journal folder holds and how far it is trusted
- :mod:`~rollpoint.store.journal_shipping`: a journal's closed segments shipped to an fsspec URL
"""

from rollpoint.store.filesystem import resolve_inside
from rollpoint.store.participant_state import (
    read_participant_state,
    verify_participant_state,
    write_participant_state,
)
from rollpoint.store.snapshot_store import (
    SnapshotStore,
    SnapshotSummary,
    Staging,
    participant_subdir,
)

__all__ = [
    "SnapshotStore",
    "SnapshotSummary",
    "Staging",
    "participant_subdir",
    "read_participant_state",
    "resolve_inside",
    "verify_participant_state",
    "write_participant_state",
]
