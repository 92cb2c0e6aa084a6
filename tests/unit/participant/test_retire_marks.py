"""Retire marks: they only rise, the check refuses attempts at or under a mark, drop forgets."""

from __future__ import annotations

import pytest

from rollpoint.participant import RetireMarks
from rollpoint.protocol.errors import StaleAttemptError
from rollpoint.protocol.ids import EpisodeId


def E(key: str) -> EpisodeId:
    return EpisodeId.from_key(key)


def test_marks_only_rise_and_report_what_is_held() -> None:
    marks = RetireMarks()
    assert marks.raise_to({"r": 3, "s": 0}) == {"r": 3, "s": 0}
    assert marks.raise_to({"r": 1}) == {"r": 3}  # a lower mark leaves the higher one
    assert marks.raise_to({"r": 4}) == {"r": 4}
    assert marks.as_dict() == {"r": 4, "s": 0} and len(marks) == 2


def test_the_check_refuses_attempts_at_or_under_the_mark_only() -> None:
    marks = RetireMarks()
    marks.raise_to({"r": 1})
    for key in ("r#0", "r#1"):
        assert marks.is_retired(E(key))
        with pytest.raises(StaleAttemptError, match=f"episode {key} is retired"):
            marks.check(E(key))
    marks.check(E("r#2"))  # the next attempt owns the rollout
    marks.check(E("other#0"))
    assert not marks.is_retired(E("r#2"))


def test_drop_forgets_and_names_the_rollouts_that_had_a_mark() -> None:
    marks = RetireMarks()
    marks.raise_to({"r": 0, "s": 2})
    assert marks.drop(["r", "never", "r"]) == ["r"]
    assert marks.get("r") is None and marks.get("s") == 2
    marks.check(E("r#0"))
