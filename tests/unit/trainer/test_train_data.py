"""train_data.jsonl: the running digest a checkpoint records, and the rerun's verified cut."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from rollpoint.protocol.errors import RestoreError
from rollpoint.trainer.record.train_checkpoint import (
    INITIAL,
    TRAIN_CHECKPOINT_VERSION,
    TrainCheckpointStore,
)
from rollpoint.trainer.record.train_data import Coverage, TrainData


def rows(*names: str) -> bytes:
    return b"".join(orjson.dumps({"row": n, "reward": 1.0}) + b"\n" for n in names)


def written(tmp_path: Path) -> tuple[Path, Coverage]:
    """Two steps appended; the coverage a checkpoint after the first step records."""
    path = tmp_path / "train_data.jsonl"
    data = TrainData.open(path)
    data.append(rows("a", "b"))
    covered = data.coverage()
    data.append(rows("c"))
    return path, covered


def test_coverage_is_the_length_lines_and_sha256_of_what_was_appended(tmp_path: Path) -> None:
    path, covered = written(tmp_path)

    first = rows("a", "b")
    assert covered == Coverage(len(first), 2, hashlib.sha256(first).hexdigest())
    # A reopened file continues the same digest.
    assert TrainData.open(path).coverage().sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_rerun_cuts_back_exactly_to_the_verified_boundary(tmp_path: Path) -> None:
    path, covered = written(tmp_path)

    data = TrainData.verify(path, covered)
    assert data.cut_back() == len(rows("c"))
    assert path.read_bytes() == rows("a", "b")
    data.append(rows("d"))
    assert data.coverage().sha256 == hashlib.sha256(rows("a", "b", "d")).hexdigest()


def test_an_edited_line_of_the_same_size_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    path, covered = written(tmp_path)
    before = path.read_bytes().replace(b'"row":"a"', b'"row":"z"')
    path.write_bytes(before)

    with pytest.raises(RestoreError, match=r"train_data\.jsonl: .* a line was edited"):
        TrainData.verify(path, covered)
    assert path.read_bytes() == before


def test_a_truncated_file_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    path, covered = written(tmp_path)
    before = path.read_bytes()[: covered.bytes - 5]
    path.write_bytes(before)

    with pytest.raises(RestoreError, match="it was truncated"):
        TrainData.verify(path, covered)
    assert path.read_bytes() == before


def test_a_boundary_inside_a_line_is_refused_not_torn(tmp_path: Path) -> None:
    path, covered = written(tmp_path)
    before = path.read_bytes()
    short = covered.bytes - 7  # a checkpoint that says fewer bytes than it covered

    with pytest.raises(RestoreError, match="do not match the train checkpoint's digest"):
        TrainData.verify(path, Coverage(short, covered.lines, covered.sha256))
    # A schema-1 checkpoint (length only) still cannot tear a line.
    with pytest.raises(RestoreError, match="is inside a line"):
        TrainData.verify(path, Coverage(short, None, None))
    assert path.read_bytes() == before


def test_a_schema_1_checkpoint_loads_with_no_digest(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    v1 = {
        "schema_version": 1,
        "step": 3,
        "policy_version": 3,
        "train_data_bytes": 120,
        "episodes_trained": 12,
        "groups_trained": 3,
        "written_at": 1.0,
    }
    (folder / "step-00000003.json").write_bytes(orjson.dumps(v1))

    checkpoint = TrainCheckpointStore(folder).load(3)

    assert checkpoint.schema_version == TRAIN_CHECKPOINT_VERSION
    assert checkpoint.coverage == Coverage(120, None, None)


def test_prune_keeps_the_newest_and_every_protected_step(tmp_path: Path) -> None:
    store = TrainCheckpointStore(tmp_path / "checkpoints", keep=2)
    for step in range(1, 7):
        store.save(INITIAL.model_copy(update={"step": step}), protect={2})

    assert store.steps() == [2, 5, 6]
