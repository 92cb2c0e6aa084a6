"""Versioned on-disk documents: golden files of every schema version, migrations, refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.manifest import (
    SNAPSHOT_MANIFEST_VERSION,
    LatestPointer,
    ParticipantManifest,
    SnapshotManifest,
    decode_document,
    encode_document,
    field_digests,
    load_latest_pointer,
    load_participant_manifest,
    load_snapshot_manifest,
    load_trainer_file_manifest,
    load_versioned,
    topology_fingerprint,
)
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import ParticipantKind

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "manifest"


def load_golden_snapshot(name: str) -> SnapshotManifest:
    path = GOLDEN / name
    what = f"snapshot manifest {path}"
    return load_snapshot_manifest(decode_document(path.read_bytes(), what), what)


def test_golden_v6_loads_and_reencodes_to_the_same_bytes() -> None:
    manifest = load_golden_snapshot("snapshot_manifest_v6.json")

    assert manifest.schema_version == SNAPSHOT_MANIFEST_VERSION == 6
    assert [(j.rollout_id, j.attempt, j.replica) for j in manifest.journaled] == [
        ("r5a6b7c8d9e0f1a2b", 0, "replica-1")
    ]
    assert encode_document(manifest) == (GOLDEN / "snapshot_manifest_v6.json").read_bytes()


def test_golden_v6_with_a_journaled_try_dropped_is_refused_by_its_seal() -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v6.json").read_bytes())
    doc["journaled"] = []

    with pytest.raises(InvalidCheckpointStateError, match="field 'journaled' does not match"):
        load_snapshot_manifest(doc, "doc")


def test_golden_v5_migrates_to_v6_with_no_journaled_try() -> None:
    manifest = load_golden_snapshot("snapshot_manifest_v5.json")

    assert manifest.schema_version == SNAPSHOT_MANIFEST_VERSION == 6
    assert manifest.journaled == []
    assert len(manifest.participants) == 6
    assert all(p.sha256 is not None and p.bytes is not None for p in manifest.participants)
    assert manifest.committed_step == 12
    assert manifest.seal is not None and "files" in manifest.seal
    assert {name: (f.path, f.format) for name, f in manifest.files.items()} == {
        "ledger.json": ("trainer/ledger.json", "records"),
        "trainer.json": ("trainer.json", "document"),
    }
    assert [e.turns_completed for e in manifest.episodes] == [3, 5, 0]
    v6 = load_golden_snapshot("snapshot_manifest_v6.json")
    same = {"journaled", "seal", "schema_version"}
    assert manifest.model_dump(exclude=same) == v6.model_dump(exclude=same)


def test_golden_v5_with_a_file_format_changed_is_refused_by_its_seal() -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v5.json").read_bytes())
    doc["files"]["ledger.json"]["format"] = "document"

    with pytest.raises(InvalidCheckpointStateError, match="field 'files' does not match"):
        load_snapshot_manifest(doc, "doc")


def test_golden_v4_migrates_to_v5_with_every_file_a_document() -> None:
    manifest = load_golden_snapshot("snapshot_manifest_v4.json")

    assert manifest.schema_version == SNAPSHOT_MANIFEST_VERSION
    assert len(manifest.participants) == 6
    assert all(p.sha256 is not None and p.bytes is not None for p in manifest.participants)
    assert manifest.committed_step == 12
    assert manifest.seal is not None and "train_step" in manifest.seal
    assert [e.turns_completed for e in manifest.episodes] == [3, 5, 0]
    assert manifest.restarts[0].rollout_id == "r9e8d7c6b5a493827"
    assert [f.rollout_id for f in manifest.finished] == ["r0f1e2d3c4b5a6978"]
    assert {name: f.format for name, f in manifest.files.items()} == {
        "ledger": "document",
        "tq": "document",
    }


def test_a_v4_file_entry_carrying_a_format_is_refused_not_guessed() -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v4.json").read_bytes())
    doc["files"]["ledger"]["format"] = "records"
    doc["seal"]["files"] = field_digests(doc)["files"]

    with pytest.raises(InvalidCheckpointStateError, match="cannot migrate schema_version 4 to 5"):
        load_snapshot_manifest(doc, "doc")


def test_trainer_file_manifest_golden_loads_and_re_encodes_to_the_same_bytes() -> None:
    raw = (GOLDEN / "trainer_file_manifest_v1.json").read_bytes()

    manifest = load_trainer_file_manifest(orjson.loads(raw), "t")

    assert (manifest.name, manifest.snapshot_id) == ("ledger.json", "snap-000042")
    assert [(p.offset, p.count, p.shared) for p in manifest.parts] == [(0, 3, True), (112, 2, True)]
    assert (manifest.count, manifest.bytes, manifest.written) == (5, 70, 30)
    assert encode_document(manifest) == raw


def test_golden_v4_with_a_flipped_train_step_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidCheckpointStateError) as info:
        load_golden_snapshot("snapshot_manifest_v4_flipped_train_step.json")

    assert "snapshot_manifest_v4_flipped_train_step.json" in info.value.message
    assert "field 'train_step' does not match the manifest's seal" in info.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("policy_version", 11),
        ("episodes", []),
        ("participants", []),
        ("committed_step", 11),
        ("config_fingerprint", {}),
    ],
)
def test_any_field_the_restore_trusts_is_covered_by_the_seal(field: str, value: object) -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v4.json").read_bytes())
    doc[field] = value

    with pytest.raises(InvalidCheckpointStateError, match=f"field '{field}' does not match"):
        load_snapshot_manifest(doc, "doc")


def test_golden_v4_without_its_seal_is_refused() -> None:
    with pytest.raises(InvalidCheckpointStateError, match="the manifest is not sealed"):
        load_golden_snapshot("snapshot_manifest_v4_unsealed.json")


def test_a_field_added_to_a_sealed_manifest_is_refused() -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v4.json").read_bytes())
    doc["surprise"] = 1

    with pytest.raises(InvalidCheckpointStateError, match="'surprise' is not covered by the"):
        load_snapshot_manifest(doc, "doc")


def test_golden_v3_migrates_to_v4_unsealed() -> None:
    v3 = load_golden_snapshot("snapshot_manifest_v3.json")
    v4 = load_golden_snapshot("snapshot_manifest_v4.json")

    assert v3.schema_version == SNAPSHOT_MANIFEST_VERSION
    assert v3.seal is None and v3.committed_step is None
    assert all(p.sha256 is None and p.bytes is None for p in v3.participants)
    unsealed = {"seal", "committed_step", "participants"}
    assert v3.model_dump(exclude=unsealed) == v4.model_dump(exclude=unsealed)
    strip = {"__all__": {"sha256", "bytes"}}
    assert v3.model_dump(include={"participants"}, exclude={"participants": strip}) == (
        v4.model_dump(include={"participants"}, exclude={"participants": strip})
    )


def test_a_v3_document_carrying_a_seal_is_refused_not_guessed() -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v3.json").read_bytes())
    doc["seal"] = {}

    with pytest.raises(InvalidCheckpointStateError, match="cannot migrate schema_version 3 to 4"):
        load_snapshot_manifest(doc, "doc")


def test_golden_v2_migrates_to_v3_with_no_finished_replies() -> None:
    v2 = load_golden_snapshot("snapshot_manifest_v2.json")
    v3 = load_golden_snapshot("snapshot_manifest_v3.json")

    assert v2.schema_version == SNAPSHOT_MANIFEST_VERSION
    assert v2.finished == []
    assert v2.model_dump(exclude={"finished"}) == v3.model_dump(exclude={"finished"})


def test_golden_v1_migrates_to_current() -> None:
    v1 = load_golden_snapshot("snapshot_manifest_v1.json")
    v2 = load_golden_snapshot("snapshot_manifest_v2.json")

    assert v1.schema_version == SNAPSHOT_MANIFEST_VERSION
    assert v1.pause_seconds == pytest.approx(0.184)
    assert v1.restarts == []
    same_fields = v1.model_dump(exclude={"restarts", "pause_seconds"})
    assert same_fields == v2.model_dump(exclude={"restarts", "pause_seconds"})


def test_v1_document_carrying_v2_fields_is_refused_not_guessed() -> None:
    with pytest.raises(InvalidCheckpointStateError) as info:
        load_golden_snapshot("snapshot_manifest_v1_with_v2_fields.json")

    assert "cannot migrate schema_version 1 to 2" in info.value.message
    assert "pause_seconds" in info.value.message


def test_newer_golden_is_refused_with_upgrade_advice() -> None:
    with pytest.raises(InvalidCheckpointStateError) as info:
        load_golden_snapshot("snapshot_manifest_v9_newer.json")

    assert "snapshot_manifest_v9_newer.json" in info.value.message
    assert (
        "schema_version 9 is newer than this rollpoint understands (max 6); upgrade rollpoint"
        in info.value.message
    )


def test_golden_without_schema_version_is_refused() -> None:
    with pytest.raises(InvalidCheckpointStateError, match="has no schema_version"):
        load_golden_snapshot("snapshot_manifest_no_version.json")


def test_corrupt_golden_is_refused_naming_the_file() -> None:
    with pytest.raises(InvalidCheckpointStateError) as info:
        load_golden_snapshot("snapshot_manifest_corrupt.json")

    assert "snapshot_manifest_corrupt.json is not valid JSON" in info.value.message


def test_participant_manifest_and_latest_pointer_goldens_load() -> None:
    participant_path = GOLDEN / "participant_manifest_v1.json"
    participant = load_participant_manifest(orjson.loads(participant_path.read_bytes()), "p")
    pointer = load_latest_pointer(
        orjson.loads((GOLDEN / "latest_pointer_v1.json").read_bytes()), "l"
    )

    assert isinstance(participant, ParticipantManifest)
    assert participant.kind is ParticipantKind.MODEL
    [part] = participant.parts
    assert (part.file, part.shared, part.digest) == (
        "records-b6fbd9c855e4f07c.jsonl",
        False,
        "bytes",
    )
    assert (part.offset, part.length, part.count) == (0, 20, 2)
    assert part.sha256 == "b6fbd9c855e4f07c804642815ac94ec06923ad78f353a72aeb79d74cb2480528"
    assert participant.sha256 is None and participant.written == 20
    assert pointer == LatestPointer(snapshot_id="snap-000042", published_at=1767225601.25)


def test_participant_manifest_v2_golden_migrates_to_v3_without_a_journal_mark() -> None:
    raw = (GOLDEN / "participant_manifest_v2.json").read_bytes()

    manifest = load_participant_manifest(orjson.loads(raw), "p")

    assert [(p.count, p.shared, p.digest) for p in manifest.parts] == [
        (2, True, "lines"),
        (1, True, "lines"),
    ]
    assert (manifest.count, manifest.bytes, manifest.written) == (3, 24, 8)
    assert manifest.schema_version == 3 and manifest.journal is None
    doc = orjson.loads(raw)
    doc["journal"] = None
    with pytest.raises(InvalidCheckpointStateError, match="version 2 document has no 'journal'"):
        load_participant_manifest(doc, "p")


def test_participant_manifest_v3_golden_loads_its_journal_mark_and_re_encodes_the_same() -> None:
    raw = (GOLDEN / "participant_manifest_v3.json").read_bytes()

    manifest = load_participant_manifest(orjson.loads(raw), "p")

    assert manifest.journal is not None
    assert (manifest.journal.folder, manifest.journal.segment, manifest.journal.offset) == (
        "journal/model/model-replica-0",
        7,
        40960,
    )
    assert encode_document(manifest) == raw
    doc = orjson.loads(raw)
    doc["journal"]["folder"] = "journal/../../elsewhere"
    with pytest.raises(InvalidCheckpointStateError, match=r"journal\.folder"):
        load_participant_manifest(doc, "p")


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("2", "must be a positive integer, got '2'"),
        (True, "must be a positive integer, got True"),
        (0, "must be a positive integer, got 0"),
        (None, "must be a positive integer, got None"),
    ],
)
def test_schema_version_of_the_wrong_type_is_refused(version: object, message: str) -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v2.json").read_bytes())
    doc["schema_version"] = version

    with pytest.raises(InvalidCheckpointStateError, match=message):
        load_snapshot_manifest(doc, "doc")


def test_unknown_field_is_refused_naming_it() -> None:
    doc = orjson.loads((GOLDEN / "snapshot_manifest_v2.json").read_bytes())
    doc["surprise"] = 1

    with pytest.raises(InvalidCheckpointStateError, match="doc: unknown field 'surprise'"):
        load_snapshot_manifest(doc, "doc")


def test_a_json_array_is_not_a_document() -> None:
    with pytest.raises(InvalidCheckpointStateError, match="must be a JSON object, got list"):
        decode_document(b"[1, 2]", "thing.json")


class _Counter(StrictModel):
    schema_version: int
    value: int
    history: list[int]


def _v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    doc["value"] = doc.pop("old_value")
    doc["history"] = [1]
    return doc


def _v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    doc["history"] = [*doc["history"], 2]
    return doc


def test_migrations_apply_step_by_step_in_order() -> None:
    migrations = {1: _v1_to_v2, 2: _v2_to_v3}

    from_v1 = load_versioned({"schema_version": 1, "old_value": 7}, _Counter, migrations, 3, "c")
    from_v2 = load_versioned(
        {"schema_version": 2, "value": 7, "history": [1]}, _Counter, migrations, 3, "c"
    )

    assert from_v1 == _Counter(schema_version=3, value=7, history=[1, 2])
    assert from_v2 == from_v1


def test_a_missing_migration_step_is_refused() -> None:
    with pytest.raises(InvalidCheckpointStateError, match="no migration from 1 to 2"):
        load_versioned({"schema_version": 1, "old_value": 7}, _Counter, {2: _v2_to_v3}, 3, "c")


def test_a_failing_migration_is_refused_naming_the_step() -> None:
    with pytest.raises(InvalidCheckpointStateError, match="cannot migrate schema_version 1 to 2"):
        load_versioned({"schema_version": 1}, _Counter, {1: _v1_to_v2, 2: _v2_to_v3}, 3, "c")


# --- topology fingerprint --------------------------------------------------------------


def _deployment(features: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "kind": kind,
            "name": kind,
            "replica": f"replica-{r}",
            "mode": "turn",
            "features": features,
        }
        for r in range(2)
        for kind in ("model", "agent", "resources")
    ]


def test_topology_fingerprint_ignores_features() -> None:
    assert topology_fingerprint(_deployment([])) == topology_fingerprint(
        _deployment(["ack_batch", "generation_cut"])
    )


def test_topology_fingerprint_ignores_listing_order() -> None:
    participants = _deployment([])

    assert topology_fingerprint(participants) == topology_fingerprint(participants[::-1])


def test_topology_fingerprint_changes_when_a_participant_is_missing() -> None:
    participants = _deployment([])

    assert topology_fingerprint(participants) != topology_fingerprint(participants[:-1])


def test_topology_fingerprint_changes_when_a_checkpoint_mode_changes() -> None:
    participants = _deployment([])
    changed = [dict(p) for p in participants]
    changed[0]["mode"] = "restart_only"

    assert topology_fingerprint(participants) != topology_fingerprint(changed)
