"""One participant's state on disk: round trip, retries, and every way a reader refuses it."""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest

from rollpoint.protocol.errors import (
    BadRequestError,
    CheckpointConflictError,
    InvalidCheckpointStateError,
    SnapshotError,
)
from rollpoint.protocol.manifest import ParticipantManifest, RecordsPart, encode_document
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.filesystem import filesystem_for
from rollpoint.store.participant_state import (
    MANIFEST_NAME,
    read_participant_state,
    verify_participant_state,
    write_participant_state,
)
from rollpoint.store.record_packs import ValueMadeOnWrite
from rollpoint.tuning.collector_pause import collector_paused
from rollpoint.tuning.deferred_value import DeferredValue

IDENTITY: dict[str, str] = {
    "kind": "agent",
    "instance": "agent-replica-0",
    "checkpoint_id": "ckpt-1",
}
RECORDS: list[dict[str, Any]] = [
    {
        "rollout_id": "r1",
        "attempt": 0,
        "turn": 2,
        "messages": [{"role": "user", "content": "héllo ✓"}],
    },
    {"rollout_id": "r2", "attempt": 1, "turn": 0, "messages": [], "reward": None},
    {"rollout_id": "r3", "attempt": 0, "nested": {"a": [1, 2.5, True]}},
]


def _folder(location: str) -> str:
    return f"{location}/participants/agent/agent-replica-0"


def _write(location: str, records: list[dict[str, Any]] = RECORDS) -> ParticipantManifest:
    return write_participant_state(_folder(location), records=records, **IDENTITY)


def _path(location: str, name: str) -> str:
    return f"{_folder(location)}/{name}"


def _rewrite_manifest(location: str, **changes: Any) -> None:
    fs = filesystem_for(location)
    doc = orjson.loads(fs.read_bytes(_path(location, MANIFEST_NAME)))
    doc.update(changes)
    fs.write_bytes(_path(location, MANIFEST_NAME), orjson.dumps(doc))


def test_round_trip_returns_the_records_and_a_manifest_that_describes_the_file(
    location: str,
) -> None:
    written = _write(location)

    manifest, records = read_participant_state(_folder(location), **IDENTITY)

    assert records == RECORDS
    assert manifest == written
    [part] = manifest.parts
    data = filesystem_for(location).read_bytes(_path(location, part.file))
    line_digests = b"".join(hashlib.sha256(line).digest() for line in data.splitlines())
    lines_digest = hashlib.sha256(line_digests).hexdigest()
    assert part.sha256 == manifest.sha256 == lines_digest
    assert part.file == f"records-{lines_digest[:16]}.jsonl"
    assert (part.shared, part.offset, part.length, part.digest) == (False, 0, len(data), "lines")
    assert (manifest.count, manifest.bytes, manifest.written) == (3, len(data), len(data))
    assert data.count(b"\n") == 3
    assert sorted(filesystem_for(location).listdir(_folder(location))) == sorted(
        [MANIFEST_NAME, part.file]
    )


def test_empty_state_round_trips(location: str) -> None:
    _write(location, [])

    manifest, records = read_participant_state(_folder(location), **IDENTITY)

    assert (records, manifest.count, manifest.bytes) == ([], 0, 0)


def test_records_larger_than_one_write_chunk_and_read_block_round_trip(location: str) -> None:
    big = [{"i": i, "text": "x" * (3000 + i % 17)} for i in range(6000)]

    manifest = _write(location, big)
    _, records = read_participant_state(_folder(location), **IDENTITY)

    assert manifest.bytes > 16 << 20
    assert records == big


def test_retrying_the_same_commit_returns_the_existing_manifest(location: str) -> None:
    first = _write(location)

    again = _write(location)

    assert again == first


def test_a_different_commit_into_the_same_folder_is_a_conflict(location: str) -> None:
    _write(location)

    with pytest.raises(CheckpointConflictError, match="already holds a different commit"):
        _write(location, RECORDS[:2])
    with pytest.raises(CheckpointConflictError):
        write_participant_state(
            _folder(location),
            kind="agent",
            instance="agent-replica-0",
            checkpoint_id="ckpt-2",
            records=RECORDS,
        )


def test_missing_manifest_means_no_state_even_with_a_records_file(location: str) -> None:
    _write(location)
    filesystem_for(location).remove_file(_path(location, MANIFEST_NAME))

    with pytest.raises(InvalidCheckpointStateError) as info:
        read_participant_state(_folder(location), **IDENTITY)

    assert f"no participant state in {_folder(location)}" in info.value.message
    assert "manifest.json is missing" in info.value.message


def test_wrong_checkpoint_id_is_refused_naming_both_ids(location: str) -> None:
    _write(location)

    with pytest.raises(InvalidCheckpointStateError) as info:
        read_participant_state(
            _folder(location), kind="agent", instance="agent-replica-0", checkpoint_id="ckpt-9"
        )

    assert _path(location, MANIFEST_NAME) in info.value.message
    assert "checkpoint_id is 'ckpt-1', expected 'ckpt-9'" in info.value.message


def test_wrong_kind_and_instance_are_both_named(location: str) -> None:
    _write(location)

    with pytest.raises(InvalidCheckpointStateError) as info:
        read_participant_state(
            _folder(location), kind="model", instance="model-replica-0", checkpoint_id="ckpt-1"
        )

    assert "kind is 'agent', expected 'model'" in info.value.message
    assert "instance is 'agent-replica-0', expected 'model-replica-0'" in info.value.message


def test_a_flipped_byte_is_reported_as_tampered_naming_the_records_file(
    location: str, flip_byte: Callable[..., None]
) -> None:
    manifest = _write(location)
    flip_byte(_path(location, manifest.parts[0].file), offset=5)

    for check in (read_participant_state, verify_participant_state):
        with pytest.raises(InvalidCheckpointStateError) as info:
            check(_folder(location), **IDENTITY)
        assert f"records file {_path(location, manifest.parts[0].file)}" in info.value.message
        assert "tampered" in info.value.message


def test_a_truncated_records_file_is_refused_by_its_size(location: str) -> None:
    manifest = _write(location)
    fs = filesystem_for(location)
    path = _path(location, manifest.parts[0].file)
    fs.write_bytes(path, fs.read_bytes(path)[:-10])

    with pytest.raises(InvalidCheckpointStateError, match="truncated or tampered"):
        read_participant_state(_folder(location), **IDENTITY)


def test_count_mismatch_is_refused(location: str) -> None:
    manifest = _write(location)
    part = manifest.parts[0].model_dump(mode="json") | {"count": 4}
    _rewrite_manifest(location, count=4, parts=[part])

    with pytest.raises(
        InvalidCheckpointStateError, match=re.escape("holds 3 records at bytes 0..")
    ):
        read_participant_state(_folder(location), **IDENTITY)


def test_missing_records_file_is_refused(location: str) -> None:
    manifest = _write(location)
    filesystem_for(location).remove_file(_path(location, manifest.parts[0].file))

    with pytest.raises(InvalidCheckpointStateError, match="named by its manifest is missing"):
        read_participant_state(_folder(location), **IDENTITY)


def test_a_manifest_whose_totals_differ_from_its_parts_is_refused(location: str) -> None:
    _write(location)
    _rewrite_manifest(location, bytes=1)

    with pytest.raises(InvalidCheckpointStateError, match="its parts hold 3 records in"):
        read_participant_state(_folder(location), **IDENTITY)


def test_a_records_file_path_in_the_manifest_is_refused(location: str) -> None:
    manifest = _write(location)
    part = manifest.parts[0].model_dump(mode="json") | {"file": "../../../etc/passwd"}
    _rewrite_manifest(location, parts=[part])

    with pytest.raises(InvalidCheckpointStateError, match=re.escape("parts.0.file")):
        read_participant_state(_folder(location), **IDENTITY)


def test_a_schema_1_manifest_is_read_through_its_migration(location: str) -> None:
    """A folder written by schema 1 (one records file, digested as bytes) still restores,
    and a schema-1 name that does not match its digest is still refused."""
    fs = filesystem_for(location)
    body = b"".join(orjson.dumps(r) + b"\n" for r in RECORDS)
    sha256 = hashlib.sha256(body).hexdigest()
    fs.makedirs(_folder(location))
    fs.write_bytes(_path(location, f"records-{sha256[:16]}.jsonl"), body)
    v1 = {
        "schema_version": 1,
        **IDENTITY,
        "records_file": f"records-{sha256[:16]}.jsonl",
        "sha256": sha256,
        "count": 3,
        "bytes": len(body),
        "written_at": 0.0,
    }
    fs.write_bytes(_path(location, MANIFEST_NAME), orjson.dumps(v1))

    manifest, records = read_participant_state(_folder(location), **IDENTITY)

    assert records == RECORDS
    assert [p.digest for p in manifest.parts] == ["bytes"] and manifest.sha256 is None
    fs.write_bytes(
        _path(location, MANIFEST_NAME),
        orjson.dumps(v1 | {"records_file": "records-0000000000000000.jsonl"}),
    )
    with pytest.raises(InvalidCheckpointStateError, match="but its digest makes it"):
        read_participant_state(_folder(location), **IDENTITY)


def _publish_raw(location: str, body: bytes) -> None:
    """A records file and a manifest that matches it exactly, whatever the body holds."""
    fs = filesystem_for(location)
    sha256 = hashlib.sha256(body).hexdigest()
    fs.makedirs(_folder(location))
    fs.write_bytes(_path(location, f"records-{sha256[:16]}.jsonl"), body)
    lines = hashlib.sha256(b"".join(hashlib.sha256(x).digest() for x in body.splitlines()))
    part = RecordsPart(
        file=f"records-{sha256[:16]}.jsonl",
        shared=False,
        offset=0,
        length=len(body),
        count=body.count(b"\n"),
        digest="lines",
        sha256=lines.hexdigest(),
    )
    manifest = ParticipantManifest(
        kind=ParticipantKind.AGENT,
        instance="agent-replica-0",
        checkpoint_id="ckpt-1",
        parts=[part],
        sha256=lines.hexdigest(),
        count=body.count(b"\n"),
        bytes=len(body),
        written=len(body),
        written_at=0.0,
    )
    fs.write_bytes(_path(location, MANIFEST_NAME), encode_document(manifest))


def test_an_undecodable_line_is_refused_naming_its_number(location: str) -> None:
    _publish_raw(location, b'{"a": 1}\n{"b": \n{"c": 3}\n')

    with pytest.raises(InvalidCheckpointStateError, match="line 2 is not valid JSON"):
        read_participant_state(_folder(location), **IDENTITY)


def test_a_line_that_is_not_an_object_is_refused(location: str) -> None:
    _publish_raw(location, b'{"a": 1}\n[1, 2]\n')

    with pytest.raises(InvalidCheckpointStateError, match="line 2 is a JSON list, not an object"):
        read_participant_state(_folder(location), **IDENTITY)


def test_a_corrupt_manifest_is_refused_naming_it(location: str) -> None:
    _write(location)
    filesystem_for(location).write_bytes(_path(location, MANIFEST_NAME), b'{"schema_version": 1,')

    with pytest.raises(InvalidCheckpointStateError) as info:
        read_participant_state(_folder(location), **IDENTITY)

    assert f"participant manifest {_path(location, MANIFEST_NAME)} is not valid JSON" in (
        info.value.message
    )


def test_a_manifest_from_a_newer_rollpoint_is_refused(location: str) -> None:
    _write(location)
    _rewrite_manifest(location, schema_version=5)

    with pytest.raises(InvalidCheckpointStateError, match="newer than this rollpoint"):
        read_participant_state(_folder(location), **IDENTITY)


def test_an_unencodable_record_publishes_nothing(location: str) -> None:
    records: list[dict[str, Any]] = [{"ok": 1}, {"bad": {1, 2}}]

    with pytest.raises(InvalidCheckpointStateError) as info:
        _write(location, records)

    assert info.value.message == "record 1 cannot be encoded: cannot encode set"

    assert filesystem_for(location).listdir(_folder(location)) == []


class _FullDisk:
    """A stream whose second write fails as a full disk does (in the writer's thread)."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.writes = stream, 0

    def write(self, chunk: bytes) -> int:
        self.writes += 1
        if self.writes == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written: int = self._stream.write(chunk)
        return written


def test_a_disk_error_while_writing_is_a_snapshot_error_naming_the_folder_and_publishes_nothing(
    location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs_class = type(filesystem_for(location))
    real = fs_class.open_write
    streams: list[_FullDisk] = []

    @contextlib.contextmanager
    def failing(self: Any, path: str) -> Iterator[_FullDisk]:
        with real(self, path) as stream:
            streams.append(_FullDisk(stream))
            yield streams[-1]

    monkeypatch.setattr(fs_class, "open_write", failing)
    # Two chunks at least: a chunk is about 8 MiB.
    records = [{"i": i, "pad": "x" * 20_000} for i in range(1000)]

    with pytest.raises(SnapshotError) as info:
        _write(location, records)

    assert info.value.message.startswith(f"cannot write participant state in {_folder(location)}")
    assert info.value.message.endswith("No space left on device")
    assert [s.writes for s in streams] == [2]
    assert filesystem_for(location).listdir(_folder(location)) == []


# --- deferred values: made by the writer -------------------------------------------------


def _counted(value: str, calls: list[str]) -> DeferredValue[str]:
    def make() -> str:
        calls.append(value)
        return value

    return DeferredValue(make, "the test value")


def test_a_deferred_value_is_made_by_the_writer_and_written_as_its_value(location: str) -> None:
    calls: list[str] = []
    records: list[dict[str, Any]] = [{"rollout_id": "r1", "packed": _counted("abc", calls)}]
    assert calls == []  # handing the record to the writer made nothing

    _write(location, records)

    assert len(calls) == 1
    _, read = read_participant_state(_folder(location), **IDENTITY)
    assert read == [{"rollout_id": "r1", "packed": "abc"}]


def test_a_deferred_value_is_made_once_across_writes_of_the_same_record(location: str) -> None:
    calls: list[str] = []
    records: list[dict[str, Any]] = [{"rollout_id": "r1", "packed": _counted("abc", calls)}]
    first = _write(location, records)
    # A retried commit (hashes the records again) and a later checkpoint reusing the record.
    assert _write(location, records) == first
    other = f"{location}/participants/agent/other"
    write_participant_state(
        other, kind="agent", instance="agent-replica-0", checkpoint_id="ckpt-2", records=records
    )
    assert len(calls) == 1
    assert read_participant_state(other, **{**IDENTITY, "checkpoint_id": "ckpt-2"})[1] == [
        {"rollout_id": "r1", "packed": "abc"}
    ]


def test_a_failing_deferred_value_names_the_record_and_publishes_nothing(location: str) -> None:
    def boom() -> str:
        raise ValueError("the export was malformed")

    records: list[dict[str, Any]] = [
        {"ok": DeferredValue(lambda: "fine", "a fine value")},
        {"bad": DeferredValue(boom, "packed state of rollout r2")},
    ]

    with pytest.raises(InvalidCheckpointStateError) as info:
        _write(location, records)

    assert info.value.message == (
        "record 1 cannot be encoded: packed state of rollout r2 could not be made: "
        "ValueError: the export was malformed"
    )
    assert filesystem_for(location).listdir(_folder(location)) == []


@pytest.mark.parametrize(
    ("kind", "instance", "checkpoint_id", "message"),
    [
        ("gpu", "agent-replica-0", "ckpt-1", "unknown participant kind 'gpu'"),
        ("agent", "../escape", "ckpt-1", "instance '../escape' is not a valid identifier"),
        ("agent", "agent-replica-0", "", "checkpoint id '' is not a valid identifier"),
    ],
)
def test_bad_identity_is_refused_before_writing(
    location: str, kind: str, instance: str, checkpoint_id: str, message: str
) -> None:
    with pytest.raises(BadRequestError, match=message):
        write_participant_state(
            _folder(location),
            kind=kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            records=RECORDS,
        )

    assert not filesystem_for(location).exists(_folder(location))


# --- the store knows files, not the interpreter ----------------------------------------


class _Upper(ValueMadeOnWrite):
    """The store's own notion of a deferred value, without rollpoint.tuning."""

    def __init__(self, text: str) -> None:
        self.text = text

    def value(self) -> object:
        return self.text.upper()


def test_any_value_made_on_write_is_written_as_its_value(location: str) -> None:
    _write(location, [{"rollout_id": "r1", "packed": _Upper("abc")}])
    _, read = read_participant_state(_folder(location), **IDENTITY)
    assert read == [{"rollout_id": "r1", "packed": "ABC"}]


def test_reading_leaves_the_garbage_collector_as_it_found_it(location: str) -> None:
    # Pausing it while decoding is the caller's trick (the fence's restore, the trainer's
    # restorer: rollpoint.tuning.collector_pause), not the store's.
    _write(location)
    assert gc.isenabled()
    read_participant_state(_folder(location), **IDENTITY)
    assert gc.isenabled()
    gc.disable()
    try:
        read_participant_state(_folder(location), **IDENTITY)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_read_also_leaves_the_collector_on(location: str) -> None:
    _publish_raw(location, b'{"a": 1}\n{"b": \n')
    with pytest.raises(InvalidCheckpointStateError):
        read_participant_state(_folder(location), **IDENTITY)
    assert gc.isenabled()


def test_objects_an_application_froze_stay_frozen(location: str) -> None:
    _write(location)
    # Watched by identity, not by gc.get_freeze_count(): the count also moves when other
    # code in this process freezes what it allocated (the pause's own settle step, or a
    # collector schedule left by an earlier test on the same xdist worker), which says
    # nothing about whether the application's objects were thawed.
    application_object = [object()]
    gc.freeze()
    try:
        # Paused as the fence's restore reads: the pause's exit settles what was allocated.
        with collector_paused():
            read_participant_state(_folder(location), **IDENTITY)
        # gc.get_objects() lists the collector's generations, never the frozen one.
        assert not any(o is application_object for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is application_object for o in gc.get_objects())


def test_concurrent_paused_reads_all_decode_and_leave_the_collector_on(
    location: str,
) -> None:
    # As the fence's restore reads each replica's folder: in worker threads, each paused,
    # each its own folder. (Not one file read by every thread: fsspec's memory filesystem
    # hands every reader of a file the same file object, so its readers share one position.)
    folders = [f"{location}/copy-{n}" for n in range(8)]
    for folder in folders:
        _write(folder, [{"i": i, "text": "x" * 50} for i in range(20_000)])
    complete: list[bool] = []

    def read(folder: str) -> None:
        with collector_paused():
            _, records = read_participant_state(_folder(folder), **IDENTITY)
        complete.append(len(records) == 20_000)

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(read, folders))
    assert complete == [True] * 8
    assert gc.isenabled()
