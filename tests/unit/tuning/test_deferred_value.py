"""A value made on first use: made once, remembered, a failure named and tried again."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollpoint.protocol.errors import BadRequestError, SnapshotError
from rollpoint.tuning.deferred_value import DeferredValue


def test_the_value_is_made_on_first_use_and_then_remembered() -> None:
    calls: list[int] = []

    def make() -> str:
        calls.append(1)
        return "packed"

    deferred = DeferredValue(make, "the value")
    assert calls == [] and not deferred.made

    assert deferred.value() == "packed"
    assert deferred.value() == "packed"

    assert calls == [1] and deferred.made


def test_a_failure_names_the_value_and_the_next_use_tries_again() -> None:
    outcomes: list[Exception | str] = [ValueError("bad bytes"), BadRequestError("refused"), "ok"]

    def make() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    deferred = DeferredValue(make, "packed state of rollout r1")
    with pytest.raises(SnapshotError) as first:
        deferred.value()
    assert first.value.message == (
        "packed state of rollout r1 could not be made: ValueError: bad bytes"
    )
    with pytest.raises(SnapshotError) as second:
        deferred.value()
    assert second.value.message == "packed state of rollout r1 could not be made: refused"
    assert not deferred.made

    assert deferred.value() == "ok" and deferred.made


def test_threads_asking_at_once_all_get_the_value() -> None:
    started = threading.Barrier(2, timeout=5)

    def make() -> str:
        # Both callers are inside make at once: each computes, neither sees a half-made value.
        started.wait()
        return "x" * 1000

    deferred = DeferredValue(make, "the value")
    with ThreadPoolExecutor(max_workers=2) as pool:
        values = list(pool.map(lambda _: deferred.value(), range(2)))

    assert values == ["x" * 1000] * 2
    assert deferred.made and deferred.value() == "x" * 1000


def test_what_the_function_holds_is_freed_once_the_value_is_made() -> None:
    class Export:
        text = "uncompressed"

        def packed(self) -> str:
            return self.text.upper()

    export = Export()
    held = weakref.ref(export)
    deferred = DeferredValue(export.packed, "the value")
    del export

    assert held() is not None  # not made yet: the input must stay
    assert deferred.value() == "UNCOMPRESSED"
    assert held() is None
