"""Participant records as a restore reads them back from disk.

Exports hand the writer records ready for orjson, with parts pre-encoded as
:class:`orjson.Fragment` (an agent session's row, messages and calls; a held reply): a test
that compares them with plain dumps, or installs them without the disk in between, decodes
them first, exactly as the write and the read would. And the records files a saved
participant state names (in the store's shared ``objects/`` folder), for tests that tamper
with them or read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from rollpoint.protocol.manifest import ParticipantManifest, load_participant_manifest
from rollpoint.store.participant_state import (
    MANIFEST_NAME,
    read_participant_state,
    records_files,
)


def read_back(exported: Any) -> Any:
    """``exported`` (a record or a list of them) encoded and decoded again."""
    return orjson.loads(orjson.dumps(exported))


def state_manifest(folder: str | Path) -> ParticipantManifest:
    """The participant manifest in a participant's state ``folder``."""
    path = Path(folder) / MANIFEST_NAME
    return load_participant_manifest(orjson.loads(path.read_bytes()), str(path))


def records_paths(folder: str | Path, root: str | Path) -> list[Path]:
    """The records files the state in ``folder`` (a snapshot under store ``root``) names."""
    manifest = state_manifest(folder)
    return [Path(p) for p in records_files(str(folder), manifest, root=str(root))]


def state_records(folder: str | Path, root: str | Path) -> list[dict[str, Any]]:
    """The verified records of the participant state in ``folder`` under store ``root``."""
    manifest = state_manifest(folder)
    _, records = read_participant_state(
        str(folder),
        kind=manifest.kind.value,
        instance=manifest.instance,
        checkpoint_id=manifest.checkpoint_id,
        root=str(root),
    )
    return records
