"""Train checkpoints on disk: every golden schema loads or is refused as documented, and
the trainer's own state is kept with the step, checked as it is handed over."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest

from rollpoint.protocol.errors import BadRequestError, InvalidCheckpointStateError
from rollpoint.trainer.record.train_checkpoint import (
    TRAIN_CHECKPOINT_VERSION,
    TRAINER_STATE_MAX_BYTES,
    TrainCheckpointStore,
    stamp,
)
from rollpoint.trainer.record.train_data import Coverage
from rollpoint.trainer.train_hooks import StepResult

GOLDEN = Path(__file__).parents[2] / "golden" / "train_checkpoint"


def load_golden(tmp_path: Path, name: str) -> TrainCheckpointStore:
    doc = orjson.loads((GOLDEN / name).read_bytes())
    folder = tmp_path / "checkpoints"
    folder.mkdir(exist_ok=True)
    shutil.copy(GOLDEN / name, folder / f"step-{doc['step']:08d}.json")
    return TrainCheckpointStore(folder)


def test_the_current_schema_is_3() -> None:
    assert TRAIN_CHECKPOINT_VERSION == 3


def test_a_schema_3_checkpoint_keeps_the_trainer_state_as_written(tmp_path: Path) -> None:
    checkpoint = load_golden(tmp_path, "step_v3.json").load(5)
    assert checkpoint.trainer_state == {
        "weights": "/ckpt/step-5.pt",
        "optimizer": "/ckpt/step-5.opt",
        "data_cursor": 40,
        "lr": 1e-05,
    }
    written = orjson.loads((GOLDEN / "step_v3.json").read_bytes())
    assert checkpoint.model_dump(mode="json") == written


@pytest.mark.parametrize(
    ("name", "step", "lines"), [("step_v2.json", 4, 16), ("step_v1.json", 3, None)]
)
def test_older_schemas_migrate_with_no_trainer_state(
    tmp_path: Path, name: str, step: int, lines: int | None
) -> None:
    checkpoint = load_golden(tmp_path, name).load(step)
    assert checkpoint.schema_version == 3
    assert checkpoint.trainer_state is None
    assert checkpoint.train_data_lines == lines


def test_a_schema_2_file_with_a_trainer_state_is_refused(tmp_path: Path) -> None:
    store = load_golden(tmp_path, "step_v2_with_v3_fields.json")
    with pytest.raises(InvalidCheckpointStateError, match="trainer_state"):
        store.load(4)


def test_a_saved_checkpoint_hands_its_trainer_state_back(tmp_path: Path) -> None:
    store = TrainCheckpointStore(tmp_path / "checkpoints")
    state = {"weights": "/w/step-2.pt", "cursor": [3, 7]}
    store.save(stamp(2, 2, Coverage(10, 1, "0" * 64), 4, 2, state))
    assert store.load(2).trainer_state == state
    assert store.available()[0].trainer_state == state


def test_a_step_result_refuses_a_state_that_is_not_json_in_one_line() -> None:
    with pytest.raises(BadRequestError, match=r"^trainer state: not JSON: ") as refused:
        StepResult(metrics={}, state={"weights": object()})  # type: ignore[dict-item]
    assert "\n" not in refused.value.message


def test_a_step_result_refuses_a_state_too_big_to_keep_per_step() -> None:
    big = "x" * TRAINER_STATE_MAX_BYTES
    with pytest.raises(BadRequestError, match=r"more than the 1,048,576 kept") as refused:
        StepResult(metrics={}, state=big)
    assert "paths here" in refused.value.message
    StepResult(metrics={}, state="x" * (TRAINER_STATE_MAX_BYTES - 2))  # its quotes fit
