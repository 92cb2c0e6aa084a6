"""Scheduling full collections: automatic ones off while attached, run here when due."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from rollpoint.tuning import collector_schedule
from rollpoint.tuning.collector_pause import collector_paused, unfreeze
from rollpoint.tuning.collector_schedule import (
    MAX_GAP_S,
    MIN_GAP_S,
    QUIET_S,
    RATIO,
    THAW_GAP_S,
    CollectorSchedule,
    ServerCollector,
)


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def gc_state() -> Iterator[None]:
    """Every test here leaves the collector's thresholds and switch as it found them."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()
    unfreeze()


def collections_while_allocating() -> set[int]:
    """The generations the automatic collector walks while as many lists are made and kept
    as the heap holds objects: CPython runs a full collection only once the survivors
    since the last one pass a quarter of the heap (and gen 2's count its threshold)."""
    seen: set[int] = set()
    count = max(20_000, len(gc.get_objects()))

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.add(info["generation"])

    gc.callbacks.append(record)
    try:
        kept = [[i] for i in range(count)]
        del kept
    finally:
        gc.callbacks.remove(record)
    return seen


def test_attached_the_automatic_collector_runs_young_collections_but_no_full_one() -> None:
    gc.set_threshold(100, 1, 1)
    assert 2 in collections_while_allocating()  # as a control: unattached, it would
    schedule = CollectorSchedule()
    schedule.attach()
    try:
        t0, t1, t2 = gc.get_threshold()
        assert (t0, t1) == (100, 1) and t2 > 10**9
        seen = collections_while_allocating()
        assert 0 in seen and 1 in seen and 2 not in seen
    finally:
        schedule.detach()


def test_attach_is_counted_and_the_last_detach_restores_the_exact_thresholds() -> None:
    gc.set_threshold(700, 13, 17)
    schedule = CollectorSchedule()
    schedule.attach()
    schedule.attach()
    schedule.detach()
    assert schedule.attached and gc.get_threshold()[2] > 10**9
    schedule.detach()
    assert not schedule.attached and gc.get_threshold() == (700, 13, 17)
    with pytest.raises(RuntimeError, match="without a matching attach"):
        schedule.detach()


def test_a_full_collection_is_due_only_after_the_minimum_gap(full_collections: list[int]) -> None:
    clock = FakeClock()
    schedule = CollectorSchedule(clock)  # the process start counts as the last one
    assert not schedule.collect_if_due(MIN_GAP_S - 0.1)
    assert full_collections == []
    clock.now = MIN_GAP_S
    assert schedule.collect_if_due()
    assert full_collections == [2]
    clock.now = 2 * MIN_GAP_S - 0.1
    assert not schedule.collect_if_due()
    clock.now = 2 * MIN_GAP_S
    assert schedule.collect_if_due()
    assert full_collections == [2, 2]


def test_a_long_full_collection_pushes_the_next_one_back_by_the_ratio(
    full_collections: list[int],
) -> None:
    clock = FakeClock()
    length = 2.0  # RATIO * length is past the minimum gap: the ratio decides

    def slow(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            clock.now += length

    schedule = CollectorSchedule(clock)
    clock.now = MIN_GAP_S
    gc.callbacks.append(slow)
    try:
        assert schedule.collect_if_due()
        assert schedule.last_duration_s == length
        ended = MIN_GAP_S + length
        assert not schedule.collect_if_due(ended + RATIO * length - 0.1)
        assert not schedule.collect_if_due(ended + MIN_GAP_S)
        assert schedule.collect_if_due(ended + RATIO * length)
    finally:
        gc.callbacks.remove(slow)
    assert full_collections == [2, 2]


def test_nothing_is_due_while_a_pause_holds_the_collector(full_collections: list[int]) -> None:
    schedule = CollectorSchedule(FakeClock())
    with collector_paused():
        assert not schedule.due(10 * MAX_GAP_S)
        assert not schedule.collect_if_due(10 * MAX_GAP_S)
        assert not schedule.collect_if_overdue(10 * MAX_GAP_S)
    assert full_collections == []
    assert schedule.collect_if_due(10 * MAX_GAP_S)
    assert full_collections == [2]


def test_overdue_only_after_the_maximum_gap(full_collections: list[int]) -> None:
    schedule = CollectorSchedule(FakeClock())
    assert schedule.due(MIN_GAP_S) and not schedule.overdue(MAX_GAP_S - 0.1)
    assert not schedule.collect_if_overdue(MAX_GAP_S - 0.1)
    assert full_collections == []
    assert schedule.collect_if_overdue(MAX_GAP_S)
    assert full_collections == [2]
    assert not schedule.overdue(MAX_GAP_S)
    assert schedule.overdue(2 * MAX_GAP_S)


GROWTH = 50_000
"""A growth threshold for tests: the lists below take one block each, and their items more."""


def test_a_grown_heap_is_collected_and_then_not_until_it_grows_again(
    monkeypatch: pytest.MonkeyPatch, full_collections: list[int]
) -> None:
    monkeypatch.setattr(collector_schedule, "GROWTH_BLOCKS", GROWTH)
    schedule = CollectorSchedule(FakeClock())
    schedule.attach()
    try:
        assert not schedule.collect_if_grown()
        kept = [[i] for i in range(GROWTH)]
        assert schedule.collect_if_grown()
        assert full_collections == [2]
        assert not schedule.collect_if_grown()  # measured again from this collection
        more = [[i] for i in range(GROWTH)]
        assert schedule.collect_if_grown()
        assert full_collections == [2, 2]
        del kept, more
    finally:
        schedule.detach()


class Node:
    """A container that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def test_a_scheduled_collection_freezes_its_survivors_and_a_late_one_thaws_first() -> None:
    clock = FakeClock()
    schedule = CollectorSchedule(clock)
    schedule.attach()
    try:
        clock.now = MIN_GAP_S
        assert schedule.collect_if_due()
        assert gc.get_freeze_count() > 0  # survivors frozen: the next scan skips them
        # A cycle that becomes garbage once frozen is not found by a collection that
        # does not thaw...
        a, b = Node(), Node()
        a.other, b.other = b, a
        gc.freeze()
        probe = weakref.ref(a)
        del a, b
        clock.now += MIN_GAP_S * 2
        assert schedule.collect_if_due()
        assert probe() is not None
        # ...and is by the first one past the thaw gap.
        clock.now += THAW_GAP_S
        assert schedule.collect_if_due()
        assert probe() is None
    finally:
        schedule.detach()
    assert gc.get_freeze_count() == 0  # the last detach thaws everything


async def test_an_idle_collector_runs_a_due_full_collection_only_once_nothing_is_busy(
    monkeypatch: pytest.MonkeyPatch, full_collections: list[int]
) -> None:
    monkeypatch.setattr(collector_schedule, "CHECK_EVERY_S", 0.01)
    thresholds = gc.get_threshold()
    clock = FakeClock()
    schedule = CollectorSchedule(clock)
    clock.now = MIN_GAP_S  # one is due from now on
    busy = True
    collector = ServerCollector(schedule, idle=lambda: not busy)
    collector.start()
    try:
        assert gc.get_threshold()[2] > 10**9  # no automatic full collection while started
        await asyncio.sleep(0.15)
        assert full_collections == []  # ~15 checks, all busy
        busy = False
        await until_collected(full_collections)
        assert full_collections == [2]
    finally:
        await collector.aclose()
    assert gc.get_threshold() == thresholds


@pytest.fixture
async def growing(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[FakeClock, ServerCollector]]:
    """A started collector on a fake clock, checking every 10 ms, with a small growth step."""
    monkeypatch.setattr(collector_schedule, "CHECK_EVERY_S", 0.01)
    monkeypatch.setattr(collector_schedule, "GROWTH_BLOCKS", GROWTH)
    clock = FakeClock()
    collector = ServerCollector(CollectorSchedule(clock))
    collector.start()
    yield clock, collector
    await collector.aclose()


async def until_collected(full_collections: list[int]) -> None:
    for _ in range(200):
        if full_collections:
            return
        await asyncio.sleep(0.01)


async def test_a_grown_heap_waits_for_the_checkpoints_to_go_quiet_before_the_task_collects_it(
    growing: tuple[FakeClock, ServerCollector], full_collections: list[int]
) -> None:
    clock, collector = growing
    collector.hold()
    collector.release()  # a checkpoint just ended (nothing due yet: MIN_GAP_S)
    kept = [[i] for i in range(2 * GROWTH)]
    await asyncio.sleep(0.15)
    assert full_collections == []  # ~15 checks, each too soon after the checkpoint
    clock.now += QUIET_S
    await until_collected(full_collections)
    assert full_collections == [2]
    del kept


async def test_after_checkpoints_far_apart_quiet_means_twice_their_gap(
    growing: tuple[FakeClock, ServerCollector], full_collections: list[int]
) -> None:
    clock, collector = growing
    gap = 2 * QUIET_S  # twice that is still short of MAX_GAP_S: nothing overdue below
    for _ in range(2):  # two checkpoints' ends, gap apart (the second runs a due one)
        collector.hold()
        collector.release()
        clock.now += gap
    full_collections.clear()
    kept = [[i] for i in range(2 * GROWTH)]
    clock.now += gap - 1  # just short of twice the gap after the second end
    await asyncio.sleep(0.15)
    assert full_collections == []  # quiet for longer than QUIET_S, not for 2 gaps
    clock.now += 1
    await until_collected(full_collections)
    assert full_collections == [2]
    del kept
