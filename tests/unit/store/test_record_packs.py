"""Incremental snapshots: a write adds what changed, references the rest, and retention keeps
every records file a kept snapshot names (and only those)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from rollpoint.protocol.errors import InvalidCheckpointStateError, SnapshotError
from rollpoint.protocol.manifest import (
    ParticipantEntry,
    ParticipantManifest,
    SnapshotManifest,
    topology_fingerprint,
)
from rollpoint.store import shared_records, snapshot_checks
from rollpoint.store.filesystem import filesystem_for
from rollpoint.store.participant_state import (
    read_participant_state,
    records_files,
    write_participant_state,
)
from rollpoint.store.record_packs import OBJECTS_DIR, PackIndex
from rollpoint.store.snapshot_store import SnapshotStore, participant_subdir

pytestmark = pytest.mark.usefixtures("no_early_rebase")

KIND, INSTANCE = "agent", "agent-replica-0"


def _records(n: int, pad: int = 200) -> list[dict[str, Any]]:
    return [{"rollout_id": f"r{i}", "turn": 0, "text": "x" * pad} for i in range(n)]


def _snapshot(
    store: SnapshotStore, snapshot_id: str, records: list[dict[str, Any]], index: PackIndex
) -> ParticipantManifest:
    """Publish a snapshot holding one participant's state, written with ``index``."""
    staging = store.begin(snapshot_id)
    state = write_participant_state(
        staging.participant_dir(KIND, INSTANCE),
        kind=KIND,
        instance=INSTANCE,
        checkpoint_id=f"ckpt-{snapshot_id}",
        records=records,
        root=store.root,
        index=index,
    )
    store.publish(staging, _manifest(snapshot_id))
    return state


def _manifest(snapshot_id: str) -> SnapshotManifest:
    entry = ParticipantEntry(
        kind=KIND,
        name=KIND,
        replica="replica-0",
        mode="turn",
        instance=INSTANCE,
        manifest_path=f"{participant_subdir(KIND, INSTANCE)}/manifest.json",
    )
    return SnapshotManifest(
        snapshot_id=snapshot_id,
        checkpoint_id=f"ckpt-{snapshot_id}",
        created_at=time.time(),
        train_step=0,
        policy_version=0,
        pause_seconds=0.01,
        topology_fingerprint=topology_fingerprint([{"kind": KIND, "name": INSTANCE}]),
        participants=[entry],
        episodes=[],
        restarts=[],
        finished=[],
        files={},
        config_fingerprint={},
    )


def _read(store: SnapshotStore, snapshot_id: str) -> list[dict[str, Any]]:
    _, records = read_participant_state(
        store.participant_dir(snapshot_id, KIND, INSTANCE),
        kind=KIND,
        instance=INSTANCE,
        checkpoint_id=f"ckpt-{snapshot_id}",
        root=store.root,
    )
    return records


def _objects(store: SnapshotStore) -> list[str]:
    fs = filesystem_for(store.root)
    folder = fs.join(store.root, OBJECTS_DIR)
    return sorted(fs.listdir(folder)) if fs.isdir(folder) else []


def _line_bytes(record: dict[str, Any]) -> int:
    return len(orjson.dumps(record)) + 1


def test_an_unchanged_state_is_referenced_not_written_again(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    records = _records(50)

    first = _snapshot(store, "s1", records, index)
    second = _snapshot(store, "s2", records, index)

    assert first.written == first.bytes > 0
    assert second.written == 0 and second.bytes == first.bytes
    assert second.parts == first.parts and len(second.parts) == 1
    assert _read(store, "s2") == _read(store, "s1") == records


def test_a_write_of_records_already_in_the_store_keeps_that_file(location: str) -> None:
    # A rebase (or a rerun's first write) writes records whose file is there already under
    # the same name: the file stays as it was, so no snapshot naming it finds it written
    # after its manifest (the object store's publication order: test_object_store).
    store = SnapshotStore(location)
    records = _records(50)
    first = _snapshot(store, "s1", records, PackIndex())
    (name,) = _objects(store)
    fs = filesystem_for(store.root)
    path = fs.join(store.root, OBJECTS_DIR, name)
    written_at = fs.modified(path)
    time.sleep(0.05)  # a rewrite would then carry a later time

    second = _snapshot(store, "s2", records, PackIndex())

    assert second.written == first.written > 0
    assert _objects(store) == [name]
    assert fs.modified(path) == written_at
    assert _read(store, "s2") == records


def test_a_write_adds_only_the_changed_records_and_keeps_the_order(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    records = _records(30)
    _snapshot(store, "s1", records, index)

    # A session that moved on hands out a new record; the others hand out the same ones.
    changed = [*records[:10], {**records[10], "turn": 1}, *records[11:], {"rollout_id": "new"}]
    state = _snapshot(store, "s2", changed, index)

    assert state.written == _line_bytes(changed[10]) + _line_bytes(changed[-1])
    # Records 0-9 and 11-29 of the first pack, then the changed and the new in the second.
    assert [(p.count, p.file == state.parts[0].file) for p in state.parts] == [
        (10, True),
        (1, False),
        (19, True),
        (1, False),
    ]
    assert _read(store, "s2") == changed


def test_an_equal_record_handed_out_anew_is_found_by_its_content(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    _snapshot(store, "s1", _records(20), index)

    state = _snapshot(store, "s2", _records(20), index)  # equal dicts, new objects

    assert state.written == 0 and len(state.parts) == 1


def test_a_pack_referenced_for_less_than_half_its_bytes_is_compacted(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    records = _records(100)
    first = _snapshot(store, "s1", records, index)
    # 70 of the 100 records change: the first pack is referenced for 30 %.
    changed = [*records[:30], *({**r, "turn": 1} for r in records[30:])]
    second = _snapshot(store, "s2", changed, index)
    assert second.written == sum(_line_bytes(r) for r in changed[30:])

    third = _snapshot(store, "s3", changed, index)

    # The next write moves the 30 live records out of the first pack...
    assert third.written == sum(_line_bytes(r) for r in changed[:30])
    assert first.parts[0].file not in {p.file for p in third.parts}
    assert _read(store, "s3") == changed
    # ...so once s1 and s2 are gone the first pack is deleted. s1, sharing no records
    # file with the newest, stays as the fallback until a rebase (the 8th write) makes a
    # newer one.
    store.keep = 1
    _snapshot(store, "s4", changed, index)
    assert [s.snapshot_id for s in store.list_snapshots()] == ["s4", "s1"]
    for n in range(5, 9):
        _snapshot(store, f"s{n}", changed, index)
    assert [s.snapshot_id for s in store.list_snapshots()] == ["s8", "s7"]
    assert first.parts[0].file not in _objects(store)


def test_a_records_file_removed_under_the_index_is_written_again(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    records = _records(10)
    first = _snapshot(store, "s1", records, index)
    [path] = records_files(store.participant_dir("s1", KIND, INSTANCE), first, root=store.root)
    filesystem_for(path).remove_file(path)

    second = _snapshot(store, "s2", records, index)

    assert second.written == second.bytes and _read(store, "s2") == records


def test_retention_deletes_exactly_the_records_files_no_kept_snapshot_names(
    location: str,
) -> None:
    store, index = SnapshotStore(location, keep=2), PackIndex()
    files_by_snapshot: dict[str, set[str]] = {}
    records = _records(40)
    for step in range(6):
        # Each snapshot changes one record in four: most of every pack stays referenced.
        records = [{**r, "turn": step} if i % 4 == step % 4 else r for i, r in enumerate(records)]
        sid = f"s{step}"
        state = _snapshot(store, sid, records, index)
        files_by_snapshot[sid] = {p.file for p in state.parts}
        kept = [s.snapshot_id for s in store.list_snapshots()]
        assert set(_objects(store)) == set().union(*(files_by_snapshot[k] for k in kept))
        for k in kept:
            _read(store, k)  # every kept snapshot still reads and verifies


def test_a_publication_reads_each_participant_manifest_once(
    location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks before publishing read which records files the snapshot names; the sweep
    after it reuses that, and still keeps exactly the named files (snapshot_growth_100k)."""
    store, index = SnapshotStore(location, keep=2), PackIndex()
    records = _records(40)
    _snapshot(store, "s0", records, index)
    read: list[str] = []
    real = shared_records.participant_shared_files

    def counting(data: bytes, path: str) -> set[str]:
        read.append(path)
        return real(data, path)

    # The check before publishing and the sweep after it each read the names this way.
    monkeypatch.setattr(snapshot_checks, "participant_shared_files", counting)
    monkeypatch.setattr(shared_records, "participant_shared_files", counting)
    names = {p.file for p in _snapshot(store, "s1", [*records[1:], {"new": 1}], index).parts}
    assert len(read) == 1  # the check; the sweep did not read it again
    assert names <= set(_objects(store))
    _read(store, "s1")


def test_publication_refuses_a_snapshot_naming_a_missing_records_file(location: str) -> None:
    store, index = SnapshotStore(location), PackIndex()
    staging = store.begin("s1")
    state = write_participant_state(
        staging.participant_dir(KIND, INSTANCE),
        kind=KIND,
        instance=INSTANCE,
        checkpoint_id="ckpt-s1",
        records=_records(5),
        root=store.root,
        index=index,
    )
    fs = filesystem_for(store.root)
    fs.remove_file(fs.join(store.root, OBJECTS_DIR, state.parts[0].file))

    with pytest.raises(SnapshotError, match="names records files missing from objects/"):
        store.publish(staging, _manifest("s1"))


def test_a_tampered_shared_records_file_fails_every_snapshot_naming_it(
    location: str, flip_byte: Callable[..., None]
) -> None:

    store, index = SnapshotStore(location), PackIndex()
    records = _records(10)
    first = _snapshot(store, "s1", records, index)
    _snapshot(store, "s2", records, index)
    [path] = records_files(store.participant_dir("s1", KIND, INSTANCE), first, root=store.root)

    flip_byte(path, offset=3)

    for sid in ("s1", "s2"):
        with pytest.raises(InvalidCheckpointStateError, match="tampered or corrupt"):
            store.verify(sid)
    assert store.latest() is None


def test_a_pack_written_without_its_manifest_is_never_read_and_is_swept(location: str) -> None:
    """A crash between writing the records and publishing leaves a file no manifest names:
    nothing reads it, and the next publication deletes it."""
    store, index = SnapshotStore(location), PackIndex()
    _snapshot(store, "s1", _records(5), index)
    fs = filesystem_for(store.root)
    orphan = fs.join(store.root, OBJECTS_DIR, "records-0123456789abcdef.jsonl")
    fs.write_bytes(orphan, b'{"left": "by a crash"}\n')

    _snapshot(store, "s2", _records(5), index)

    assert not fs.exists(orphan)
    assert _read(store, "s2") == _records(5)
