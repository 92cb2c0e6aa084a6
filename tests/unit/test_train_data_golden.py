"""Golden ``train_data.jsonl`` lines (tests/golden/train_data): the writer writes today's line
byte for byte, and every line, old ones included, validates against the shipped schema and
is read by the invariants' reader."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest

from rollpoint.protocol.episode import ModelCall, RunReply
from rollpoint.protocol.ids import EpisodeId
from rollpoint.testing import invariants
from rollpoint.trainer.record.workdir_record import TRAIN_DATA_FILE, train_rows
from rollpoint.trainer.train_hooks import TrainSample
from tests.support.train_schema import check_train_rows

GOLDEN = Path(__file__).parents[1] / "golden" / "train_data"
LAG = {"row_with_policy_lag.jsonl": 3, "row_before_policy_lag.jsonl": None}


def _call(turn: int, attempt: int, version: int) -> ModelCall:
    arguments = '{"text": "red"}'
    tool_call = {
        "id": f"c{turn}",
        "type": "function",
        "function": {"name": "say", "arguments": arguments},
    }
    return ModelCall(
        turn=turn,
        attempt=attempt,
        response={"role": "assistant", "content": None, "tool_calls": [tool_call]},
        policy_version=version,
        completion_id=f"cmpl-{turn}",
        finish_reason="tool_calls",
    )


def test_the_writer_writes_todays_golden_line() -> None:
    # The golden sample: a continued episode, turn 0 under version 1, turn 1 under 3.
    reply = RunReply(
        episode=EpisodeId(rollout_id="r0123456789abcdef", attempt=1),
        task_id="two_words-0000",
        group_id="two_words-0000-g0",
        row=0,
        reward=0.5,
        messages=[{"role": "user", "content": "Name a colour. Answer with one word."}],
        model_calls=[_call(0, 0, 1), _call(1, 1, 3)],
        turns=2,
        finish_reason="max_turns",
    )
    sample = TrainSample.from_reply(reply, advantage=0.25, group_size=2, live=4)
    written = train_rows(5, [sample], 4)
    assert written == (GOLDEN / "row_with_policy_lag.jsonl").read_bytes()
    line = orjson.loads(written)
    assert line["policy_lag"] == 3 and [t["policy_lag"] for t in line["turns"]] == [3, 1]


@pytest.mark.parametrize("name", sorted(LAG))
def test_every_golden_line_validates_and_is_read(name: str, tmp_path: Path) -> None:
    path = GOLDEN / name
    assert check_train_rows(orjson.loads(raw) for raw in path.read_bytes().splitlines()) == 1
    shutil.copy(path, tmp_path / TRAIN_DATA_FILE)
    rollouts, unreadable = invariants.read_train_data(tmp_path)
    assert unreadable == []
    (rollout,) = rollouts
    assert (rollout.rollout_id, rollout.attempt, rollout.turns) == ("r0123456789abcdef", 1, 2)
    assert rollout.policy_lag == LAG[name]
    assert rollout.model_calls == [
        invariants.ModelCallMark(turn=0, attempt=0),
        invariants.ModelCallMark(turn=1, attempt=1),
    ]
