"""The ledger's final tries: only the open chunk in memory, the rest on disk, found by id."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import orjson
import pytest

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import InvalidCheckpointStateError, InvalidPhaseError
from rollpoint.protocol.manifest import FileEntry, SnapshotManifest, topology_fingerprint
from rollpoint.store.record_packs import OBJECTS_DIR, PackIndex, encode_record
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.state.append_log import CHUNK, LogChunk
from rollpoint.trainer.state.final_tries import FinalTries, StoredChunk
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_document import ArchivedEntry, document_from_records
from rollpoint.trainer.state.ledger_record import RolloutState


def entry(i: int) -> ArchivedEntry:
    return ("sealed", f"g{i // 2}", i % 2, f"r{i:04d}", 0, "replica-0" if i % 3 else None, 1)


def test_full_chunks_leave_memory_and_are_found_by_rollout_id() -> None:
    tries = FinalTries(chunk=4)
    for i in range(10):
        tries.add(entry(i))
    assert (len(tries), tries.stored_chunks, tries.held) == (10, 2, 2)
    for i in range(10):  # stored (0 to 7) and open (8, 9) alike
        assert tries.get(f"r{i:04d}") == entry(i)
        assert f"r{i:04d}" in tries
    assert tries.get("r9999") is None and "r9999" not in tries and 7 not in tries


def test_a_stored_chunk_gives_back_its_items_and_the_json_they_encode_to() -> None:
    tries = FinalTries(chunk=4)
    for i in range(6):
        tries.add(entry(i))
    stored, tail = tries.capture()
    assert isinstance(stored, StoredChunk) and len(stored) == 4
    assert stored.items == tuple(entry(i) for i in range(4))
    assert stored.encoded(orjson.dumps) == orjson.dumps(stored.items)
    assert stored.encoded(lambda items: b"%d" % len(items)) == b"4"
    assert tail.items == (entry(4), entry(5))


def test_captures_share_stored_chunks_and_their_records_hold_no_bytes() -> None:
    tries = FinalTries(chunk=4)
    for i in range(9):
        tries.add(entry(i))
    first = tries.capture()
    assert tries.capture() is not first and tries.capture()[:2] == first[:2]
    tries.add(entry(9))
    second = tries.capture()
    assert all(a is b for a, b in zip(first[:2], second[:2], strict=True))
    assert second[2] is not first[2] and len(second[2]) == 2
    made: list[object] = []

    def make(chunk: object) -> dict[str, object]:
        made.append(chunk)
        return {"chunk": len(made)}

    assert first[0].record(make) is second[0].record(make) and made == [first[0]]


def sealed(ledger: RecoveryLedger, groups: int, start: int = 0) -> list[str]:
    task = TaskRow(task_id="t", environment="math", prompt="What is 1 + 1?")
    sealed_ids = []
    for g in range(start, start + groups):
        for record in ledger.add_group(task, f"g{g}", 8):
            ledger.dispatch(record.rollout_id, "replica-0")
            ledger.finish(record.rollout_id)
            ledger.seal(record.rollout_id)
            sealed_ids.append(record.rollout_id)
    return sealed_ids


def test_the_ledger_holds_fewer_final_tries_than_a_chunk_however_many_it_sealed() -> None:
    ledger = RecoveryLedger()
    ids = sealed(ledger, 3 * CHUNK // 8 + 10)  # three full chunks and 80 more
    assert ledger.archived_count == len(ids) == 3 * CHUNK + 80
    assert ledger._final.held == 80 and ledger._final.stored_chunks == 3
    # A try stored on disk is still found, still final, and its id still taken.
    oldest = ledger.get(ids[0])
    assert oldest.state is RolloutState.SEALED and oldest.group_id == "g0"
    assert ids[0] in ledger and ledger.current("g0", 0).rollout_id == ids[0]
    with pytest.raises(InvalidPhaseError, match="is final; no move is legal"):
        ledger.finish(ids[0])


def test_a_ledger_with_stored_chunks_saves_restores_and_encodes_as_before() -> None:
    ledger = RecoveryLedger()
    ids = sealed(ledger, CHUNK // 4 + 3)  # two full chunks and 24 more
    for record in ledger.add_group(
        TaskRow(task_id="u", environment="math", prompt="2 + 2?"), "live", 2
    ):
        ledger.dispatch(record.rollout_id, "replica-1")
    capture = ledger.capture()
    encoded = capture.to_bytes()
    doc = orjson.loads(encoded)
    assert [len(c) for c in doc["archived"]] == [CHUNK, CHUNK, 24]
    assert doc == orjson.loads(orjson.dumps(ledger.to_document()))
    # As the store writes and reads the records, each stored chunk's JSON read from disk.
    lines = [orjson.loads(encode_record(r)) for r in capture.as_records()]
    assert document_from_records(lines, "ledger") == doc
    restored = RecoveryLedger.from_document(doc)
    assert restored._final.stored_chunks == 2 and restored.get(ids[5]) == ledger.get(ids[5])
    assert restored.capture().to_bytes() == encoded


def test_a_saved_rollout_id_twice_is_refused_across_stored_chunks() -> None:
    ledger = RecoveryLedger()
    sealed(ledger, CHUNK // 8 + 1)
    doc = orjson.loads(orjson.dumps(ledger.to_document()))
    doc["archived"][1][0][3] = doc["archived"][0][5][3]  # a stored try's id in the open chunk
    with pytest.raises(InvalidCheckpointStateError, match="appears twice"):
        RecoveryLedger.from_document(doc)


def test_a_writer_thread_reads_stored_chunks_while_the_ledger_seals_more() -> None:
    ledger = RecoveryLedger()
    sealed(ledger, CHUNK // 8)
    capture = ledger.capture()
    expected = capture.to_bytes()
    results: list[bytes] = []
    writer = threading.Thread(target=lambda: results.extend(capture.to_bytes() for _ in range(20)))
    writer.start()
    sealed(ledger, CHUNK // 4, start=CHUNK // 8)  # two more chunks stored meanwhile
    writer.join()
    assert results == [expected] * 20 and ledger._final.stored_chunks == 3


def test_snapshots_of_stored_chunks_reference_them_rebase_them_and_restore(
    tmp_path: Path,
) -> None:
    # Through the real store: the first write writes each chunk, the second rebases (every
    # stored chunk's JSON read back from the database), the third references them unchanged.
    store, index = SnapshotStore(str(tmp_path / "store")), PackIndex()
    objects = tmp_path / "store" / OBJECTS_DIR
    ledger = RecoveryLedger()
    sealed(ledger, CHUNK // 8 * 2 + 5)
    written: list[int] = []
    docs = []
    for number in range(3):
        if number == 1:
            sealed(ledger, CHUNK // 8, start=10_000)  # one more chunk stored
        before = sum(p.stat().st_size for p in objects.iterdir()) if objects.is_dir() else 0
        capture = ledger.capture()
        staging = store.begin(f"s{number}")
        entry = store.write_records(staging, "ledger.json", capture.as_records(), index)
        store.publish(staging, _manifest(f"s{number}", {"ledger.json": entry}))
        written.append(sum(p.stat().st_size for p in objects.iterdir()) - before)
        docs.append(orjson.loads(capture.to_bytes()))
    assert ledger._final.stored_chunks == 3
    chunk_json = len(orjson.dumps(ledger.capture().archived[0].items))
    assert written[0] > 2 * chunk_json and written[1] > 3 * chunk_json  # written, rebased
    assert written[2] < chunk_json / 4  # the header and the open chunk only
    for number, doc in enumerate(docs):
        lines = store.read_records(f"s{number}", "ledger.json")
        joined = document_from_records(lines, "ledger")
        assert joined == doc
        assert orjson.loads(RecoveryLedger.from_document(joined).capture().to_bytes()) == doc


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


def test_snapshot_records_free_the_open_chunk_copies_without_a_collection() -> None:
    # A record that referred to its own chunk made a cycle: every open chunk's copy (and
    # its JSON) stayed until a full collection, which the trainer runs rarely (13 KiB a row
    # in the soak). With the collector off, what a snapshot made must go with it.
    ledger = RecoveryLedger()
    sealed(ledger, CHUNK // 8 + 100)  # a stored chunk and an open one of 800 tries

    def chunks() -> int:
        # type(), not isinstance(): some objects (torch's) warn when asked for __class__.
        return sum(type(o) in (LogChunk, StoredChunk) for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = chunks()
        for start in range(5):
            sealed(ledger, 1, start=20_000 + start)  # the open chunk changes each time
            for record in ledger.capture().as_records():
                encode_record(record)  # as the writer does: stored JSON read back
        assert chunks() - before <= 4  # each of the four logs keeps its newest capture only
    finally:
        gc.enable()
