"""Trainer files kept as records: a snapshot writes the ledger's and the finished queue's records that
changed since the previous one, reads them back verified, and retention keeps every
records file a kept snapshot's trainer file names."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from rollpoint.protocol.errors import BadRequestError, InvalidCheckpointStateError, SnapshotError
from rollpoint.protocol.manifest import FileEntry, SnapshotManifest, topology_fingerprint
from rollpoint.store.filesystem import filesystem_for
from rollpoint.store.record_packs import OBJECTS_DIR, PackIndex
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.store.staging import Staging

pytestmark = pytest.mark.usefixtures("no_early_rebase")

NAME = "ledger.json"


def _records(n: int, turn: int = 0) -> list[dict[str, Any]]:
    return [{"schema_version": 3}, *({"try": {"row": i, "turn": turn}} for i in range(n))]


def _manifest(snapshot_id: str, files: dict[str, FileEntry]) -> SnapshotManifest:
    return SnapshotManifest(
        snapshot_id=snapshot_id,
        checkpoint_id=f"ckpt-{snapshot_id}",
        created_at=time.time(),
        train_step=0,
        policy_version=0,
        pause_seconds=0.01,
        topology_fingerprint=topology_fingerprint([]),
        participants=[],
        episodes=[],
        restarts=[],
        finished=[],
        files=files,
        config_fingerprint={},
    )


def _write(
    store: SnapshotStore, snapshot_id: str, records: list[dict[str, Any]], index: PackIndex
) -> tuple[Staging, FileEntry]:
    staging = store.begin(snapshot_id)
    return staging, store.write_records(staging, NAME, records, index)


def _snapshot(
    store: SnapshotStore, snapshot_id: str, records: list[dict[str, Any]], index: PackIndex
) -> FileEntry:
    staging, entry = _write(store, snapshot_id, records, index)
    store.publish(staging, _manifest(snapshot_id, {NAME: entry}))
    return entry


def _objects(store: SnapshotStore) -> set[str]:
    fs = filesystem_for(store.root)
    folder = fs.join(store.root, OBJECTS_DIR)
    return set(fs.listdir(folder)) if fs.isdir(folder) else set()


def _object_bytes(store: SnapshotStore) -> int:
    fs = filesystem_for(store.root)
    return sum(len(fs.read_bytes(fs.join(store.root, OBJECTS_DIR, n))) for n in _objects(store))


def test_a_trainer_file_reads_back_as_the_records_written(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    records = _records(20)

    entry = _snapshot(store, "s1", records, index)

    assert (entry.path, entry.format) == (f"trainer/{NAME}", "records")
    assert store.file_format("s1", NAME) == "records"
    assert store.read_records("s1", NAME) == records
    store.verify("s1")


def test_a_second_snapshot_writes_only_the_records_that_changed(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    records = _records(200)
    _snapshot(store, "s1", records, index)
    before = _object_bytes(store)

    changed = [*records[:-1], {"try": {"row": 199, "turn": 1}}]
    _snapshot(store, "s2", changed, index)

    added = _object_bytes(store) - before
    assert added == len(b'{"try":{"row":199,"turn":1}}\n')
    assert store.read_records("s2", NAME) == changed
    assert store.read_records("s1", NAME) == records


def test_retention_keeps_what_a_kept_trainer_file_names_and_deletes_the_rest(
    location: str,
) -> None:
    store, index = SnapshotStore(location, keep=1), PackIndex()
    _snapshot(store, "s1", _records(50), index)
    first = _objects(store)

    _snapshot(store, "s2", _records(50, turn=1), index)  # every try changed, not the header

    assert first <= _objects(store)  # s1 is pruned, but s2 names its header where s1 wrote it
    _snapshot(store, "s3", _records(50, turn=1), index)

    # That file was referenced for under half its bytes: s3 wrote the header again, and
    # with s2 pruned nothing names the file any more.
    assert not first & _objects(store)
    assert store.read_records("s3", NAME) == _records(50, turn=1)
    assert [s.snapshot_id for s in store.list_snapshots()] == ["s3"]


def test_publication_refuses_a_trainer_file_naming_a_missing_records_file(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    staging, entry = _write(store, "s1", _records(5), index)
    fs = filesystem_for(store.root)
    [name] = _objects(store)
    fs.remove_file(fs.join(store.root, OBJECTS_DIR, name))

    with pytest.raises(SnapshotError, match=f"trainer file {NAME} names records files missing"):
        store.publish(staging, _manifest("s1", {NAME: entry}))


def test_a_tampered_records_file_fails_the_read_and_the_verify(
    location: str, flip_byte: Callable[..., None]
) -> None:

    store, index = SnapshotStore(location), PackIndex()
    _snapshot(store, "s1", _records(10), index)
    fs = filesystem_for(store.root)
    [name] = _objects(store)

    flip_byte(fs.join(store.root, OBJECTS_DIR, name), offset=5)

    with pytest.raises(InvalidCheckpointStateError, match="tampered or corrupt"):
        store.read_records("s1", NAME)
    with pytest.raises(InvalidCheckpointStateError, match="tampered or corrupt"):
        store.verify("s1")


def test_a_document_file_is_not_read_as_records(location: str) -> None:
    store = SnapshotStore(location)
    staging = store.begin("s1")
    entry = store.write_file(staging, "trainer.json", b"{}")
    store.publish(staging, _manifest("s1", {"trainer.json": entry}))

    with pytest.raises(InvalidCheckpointStateError, match="is a document, not records"):
        store.read_records("s1", "trainer.json")


def test_the_trainer_folder_is_reserved_for_records(location: str) -> None:
    store = SnapshotStore(location)
    staging = store.begin("s1")

    with pytest.raises(BadRequestError, match="reserved by the snapshot layout"):
        store.write_file(staging, "trainer/ledger.json", b"{}")
