"""RecordMemo: the same record object while its source and key are the same, one build back."""

from __future__ import annotations

from typing import Any

from rollpoint.participant import RecordMemo


def _make(calls: list[str], name: str) -> Any:
    def make() -> dict[str, Any]:
        calls.append(name)
        return {"name": name}

    return make


def test_a_record_comes_back_while_source_and_key_are_the_same() -> None:
    memo, calls = RecordMemo(), []
    source, other = {"a": 1}, {"a": 1}
    first = memo.record(source, 0, _make(calls, "first"))
    memo.rotate()

    assert memo.record(source, 0, _make(calls, "again")) is first
    assert memo.record(other, 0, _make(calls, "equal, not the same")) is not first
    assert memo.record(source, 1, _make(calls, "another key")) is not first
    assert calls == ["first", "equal, not the same", "another key"]


def test_a_build_forgets_what_it_did_not_ask_for() -> None:
    memo, calls = RecordMemo(), []
    source = {"a": 1}
    first = memo.record(source, 0, _make(calls, "first"))
    memo.rotate()
    memo.rotate()  # a build that did not hand the record out

    assert memo.record(source, 0, _make(calls, "made again")) is not first
    assert calls == ["first", "made again"]
