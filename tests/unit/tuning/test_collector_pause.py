"""Pausing the cyclic garbage collector around large decodes: shared, and restored exactly."""

from __future__ import annotations

import gc
import threading

import pytest

from rollpoint.tuning.collector_pause import collector_paused, freeze, unfreeze


def test_the_collector_is_off_inside_and_back_on_after() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_it_comes_back_only_when_the_last_of_overlapping_holders_leaves() -> None:
    first_inside, second_may_leave = threading.Event(), threading.Event()
    states: list[bool] = []

    def second() -> None:
        with collector_paused():
            first_inside.set()
            second_may_leave.wait(5)
        states.append(gc.isenabled())  # the main thread still holds it

    worker = threading.Thread(target=second)
    with collector_paused():
        worker.start()
        assert first_inside.wait(5)
        second_may_leave.set()
        worker.join(5)
        assert not gc.isenabled()
    assert states == [False]
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_still_turns_it_back_on() -> None:
    with pytest.raises(ValueError, match="boom"), collector_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def _counting_freeze_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per ``gc.get_freeze_count()`` call from now on (each is a walk of the
    frozen generation)."""
    calls: list[int] = []
    real = gc.get_freeze_count

    def counted() -> int:
        calls.append(1)
        return real()

    monkeypatch.setattr(gc, "get_freeze_count", counted)
    return calls


def test_once_rollpoint_froze_objects_a_pause_freezes_its_own_without_counting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    freeze()
    try:
        before = gc.get_freeze_count()
        calls = _counting_freeze_counts(monkeypatch)
        with collector_paused():
            kept = [[i] for i in range(1_000)]
        assert not calls  # the flag answered: no walk of the frozen generation
        monkeypatch.undo()
        assert gc.get_freeze_count() >= before + len(kept)  # frozen with the others
    finally:
        unfreeze()


def test_with_nothing_frozen_a_pause_leaves_nothing_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    unfreeze()
    calls = _counting_freeze_counts(monkeypatch)
    with collector_paused():
        kept = [[i] for i in range(1_000)]
    assert calls  # counted (cheap: the frozen generation is empty)
    monkeypatch.undo()
    assert gc.get_freeze_count() == 0 and kept


def test_objects_an_application_froze_itself_keep_the_new_ones_frozen_too() -> None:
    unfreeze()
    gc.freeze()  # the application's own, outside rollpoint's flag
    try:
        before = gc.get_freeze_count()
        with collector_paused():
            kept = [[i] for i in range(1_000)]
        assert gc.get_freeze_count() >= before + len(kept)  # nothing of theirs thawed
    finally:
        unfreeze()
