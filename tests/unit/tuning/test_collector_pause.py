"""Pausing the cyclic garbage collector around large decodes: shared, and restored exactly."""

from __future__ import annotations

import gc
import threading

import pytest

from rollpoint.tuning.collector_pause import collector_paused


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
