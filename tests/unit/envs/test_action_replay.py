"""The replay the seed-plus-actions adapters share: how far a replay went, and the one line
that says where it went another way."""

from __future__ import annotations

import pytest

from rollpoint.envs.action_replay import Replay, read_saved
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.model_base import StrictModel

WHERE = "gymnasium:Toy: task toy-0001"


def replay_of(answers: list[object], recorded: list[object]) -> Replay[int]:
    """Replay actions 1, 2, … answered in turn by ``answers`` (an exception: no answer)."""
    replay = Replay(WHERE, list(range(1, len(recorded) + 1)), recorded, shows="[observation]")
    for action in replay:
        got = answers[action - 1]
        if isinstance(got, Exception):
            replay.failed(got)
        else:
            replay.answered(got)
    return replay


def test_a_replay_answered_as_recorded_replays_every_step() -> None:
    replay = replay_of([[1], [2], [3]], [[1], [2], [3]])
    assert (replay.replayed, replay.diverged) == (3, None)


def test_a_replay_stops_at_the_first_other_answer_and_names_it() -> None:
    taken: list[int] = []
    replay = Replay(WHERE, [1, 2, 3], [[1], [2], [3]], shows="[observation]")
    for action in replay:
        taken.append(action)
        replay.answered([9] if action == 2 else [action])
    assert taken == [1, 2] and replay.replayed == 2
    assert replay.diverged == (
        f"{WHERE}: replay diverged at action 2 of 3 ([observation] [9], recorded [2]);"
        " the episode restarts from its seed"
    )


def test_a_step_without_an_answer_is_not_counted_as_replayed() -> None:
    replay = replay_of([[1], ConnectionError("socket closed")], [[1], [2]])
    assert replay.replayed == 1
    assert replay.diverged == (
        f"{WHERE}: replay failed at action 2 (socket closed); the episode restarts from its seed"
    )


def test_a_start_answered_otherwise_replays_nothing() -> None:
    replay = Replay(WHERE, [1], [[1]], shows="[observation]")
    assert not replay.check_start(5, 6, "observation")
    assert list(replay) == [] and replay.replayed == 0
    assert replay.diverged is not None and "diverged at reset (observation 5, recorded 6)" in (
        replay.diverged
    )


def test_the_line_quotes_a_long_answer_cut_short() -> None:
    replay = replay_of(["x" * 1000], ["y"])
    assert replay.diverged is not None and len(replay.diverged) < 800


class Saved(StrictModel):
    actions: list[int]


def test_a_saved_form_that_does_not_fit_is_one_line_naming_task_and_field() -> None:
    task = TaskRow(task_id="toy-0001", environment="gymnasium:Toy", prompt="p", params={})
    with pytest.raises(InvalidCheckpointStateError) as caught:
        read_saved(Saved, {"actions": "three"}, "gymnasium:Toy", task)
    assert str(caught.value).startswith("gymnasium:Toy state of task toy-0001: 'actions': ")
    assert "\n" not in str(caught.value)
