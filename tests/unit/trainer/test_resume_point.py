"""Choosing what to resume from: fields cross-checked against the trainer's own files."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from rollpoint.protocol.errors import RestoreError
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.resume_point import find_resume_point, read_trainer_document
from rollpoint.trainer.snapshot.publication import FINISHED_QUEUE_FILE, LEDGER_FILE, TRAINER_FILE


def publish(store: SnapshotStore, sid: str, *, train_step: int, in_trainer_json: int) -> None:
    """A snapshot whose manifest says ``train_step`` while its trainer.json says
    ``in_trainer_json`` (a writer with a bug: the manifest is sealed as it is)."""
    staging = store.begin(sid)
    files = {
        LEDGER_FILE: store.write_file(staging, LEDGER_FILE, b"{}"),
        FINISHED_QUEUE_FILE: store.write_file(
            staging, FINISHED_QUEUE_FILE, orjson.dumps({"committed_step": 0})
        ),
        TRAINER_FILE: store.write_file(
            staging,
            TRAINER_FILE,
            orjson.dumps({"train_step": in_trainer_json, "policy_version": 0}),
        ),
    }
    manifest = SnapshotManifest(
        snapshot_id=sid,
        checkpoint_id=sid,
        created_at=1.0,
        train_step=train_step,
        policy_version=0,
        committed_step=0,
        pause_seconds=0.0,
        topology_fingerprint="0" * 64,
        participants=[],
        episodes=[],
        restarts=[],
        finished=[],
        files=files,
        config_fingerprint={},
    )
    store.publish(staging, manifest)


def test_a_manifest_that_disagrees_with_its_trainer_json_is_skipped_naming_the_field(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(str(tmp_path / "snapshots"), keep=5)
    publish(store, "s1", train_step=0, in_trainer_json=0)
    publish(store, "s2", train_step=1, in_trainer_json=0)

    point, skipped = find_resume_point(store, WorkdirRecord(tmp_path))

    assert point is not None and point.manifest.snapshot_id == "s1"
    assert [s.snapshot_id for s in skipped] == ["s2"]
    assert "manifest field 'train_step' is 1 but trainer.json says 0" in skipped[0].reason


def test_an_unreadable_store_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SnapshotStore(str(tmp_path / "snapshots"))

    def refuse(**_: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store, "list_snapshots", refuse)
    with pytest.raises(RestoreError, match=r"cannot read the snapshot store .*: Permission denied"):
        find_resume_point(store, WorkdirRecord(tmp_path))


class _Decoded(Exception):
    pass


def test_the_ledger_kept_as_records_is_decoded_with_the_collector_paused() -> None:
    # The store decodes without knowing the interpreter: the restorer pauses it around.
    seen: list[bool] = []

    class Store:
        def file_format(self, snapshot_id: str, name: str) -> str:
            return "records"

        def read_records(self, snapshot_id: str, name: str) -> list[dict[str, Any]]:
            seen.append(gc.isenabled())
            raise _Decoded

    with pytest.raises(_Decoded):
        read_trainer_document(cast(SnapshotStore, Store()), "s1", LEDGER_FILE)
    assert seen == [False] and gc.isenabled()
