"""The admission gate: closed means new calls wait (never fail), running calls finish."""

from __future__ import annotations

import asyncio

from rollpoint.participant.admission_gate import AdmissionGate


async def _call(gate: AdmissionGate, release: asyncio.Event, log: list[str], name: str) -> None:
    async with gate.admit():
        log.append(f"{name} admitted")
        await release.wait()
    log.append(f"{name} done")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_open_gate_admits_and_counts_in_flight() -> None:
    gate = AdmissionGate()
    release = asyncio.Event()
    log: list[str] = []
    task = asyncio.create_task(_call(gate, release, log, "a"))
    await _settle()
    assert gate.is_open and gate.in_flight == 1 and gate.waiting == 0
    release.set()
    await task
    assert gate.in_flight == 0
    assert log == ["a admitted", "a done"]


async def test_closed_gate_holds_new_calls_while_running_ones_finish() -> None:
    gate = AdmissionGate()
    release_running = asyncio.Event()
    log: list[str] = []
    running = asyncio.create_task(_call(gate, release_running, log, "running"))
    await _settle()
    gate.close()
    free = asyncio.Event()
    free.set()
    held = [asyncio.create_task(_call(gate, free, log, f"new{i}")) for i in range(3)]
    await _settle()
    assert (gate.in_flight, gate.waiting) == (1, 3)
    assert not gate.drained
    release_running.set()
    await running
    await _settle()
    assert (gate.in_flight, gate.waiting) == (0, 3)
    assert gate.drained
    assert log == ["running admitted", "running done"]
    assert not any(t.done() for t in held)

    gate.open()
    await asyncio.gather(*held)
    assert (gate.in_flight, gate.waiting) == (0, 0)
    assert sorted(log[2:]) == sorted(
        [f"new{i} {what}" for i in range(3) for what in ("admitted", "done")]
    )


async def test_close_and_open_are_idempotent() -> None:
    gate = AdmissionGate()
    gate.close()
    gate.close()
    assert not gate.is_open
    gate.open()
    gate.open()
    assert gate.is_open


async def test_a_released_waiter_waits_again_if_the_gate_closes_before_it_runs() -> None:
    gate = AdmissionGate()
    gate.close()
    free = asyncio.Event()
    free.set()
    log: list[str] = []
    task = asyncio.create_task(_call(gate, free, log, "w"))
    await _settle()
    gate.open()
    gate.close()  # before the waiter got a turn
    await _settle()
    assert not task.done() and gate.waiting == 1 and gate.in_flight == 0
    gate.open()
    await task
    assert log == ["w admitted", "w done"]


async def test_a_cancelled_waiter_is_no_longer_counted() -> None:
    gate = AdmissionGate()
    gate.close()
    free = asyncio.Event()
    task = asyncio.create_task(_call(gate, free, [], "w"))
    await _settle()
    assert gate.waiting == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert (gate.waiting, gate.in_flight) == (0, 0)


async def test_wait_changed_wakes_on_a_change_and_times_out_without_one() -> None:
    gate = AdmissionGate()
    assert await gate.wait_changed(0.01) is False

    watcher = asyncio.create_task(gate.wait_changed(5))
    await _settle()
    assert not watcher.done()
    gate.close()
    assert await asyncio.wait_for(watcher, 1) is True

    # A fence waiting for "nothing in flight" wakes when the last call finishes.
    gate.open()
    release = asyncio.Event()
    call = asyncio.create_task(_call(gate, release, [], "c"))
    await _settle()
    gate.close()
    watcher = asyncio.create_task(gate.wait_changed(5))
    await _settle()
    assert not watcher.done()
    release.set()
    assert await asyncio.wait_for(watcher, 1) is True
    await call
    assert gate.drained


async def test_wait_open_returns_at_once_while_open_and_counts_as_waiting_while_closed() -> None:
    gate = AdmissionGate()
    await gate.wait_open()
    assert (gate.waiting, gate.in_flight) == (0, 0)

    gate.close()
    parked = asyncio.create_task(gate.wait_open())
    await _settle()
    # A paused session is held, not in flight: the gate is drained with it waiting.
    assert not parked.done() and (gate.waiting, gate.in_flight) == (1, 0) and gate.drained
    gate.open()
    await parked
    assert gate.waiting == 0


async def test_notify_wakes_watchers_for_the_owners_own_changes() -> None:
    gate = AdmissionGate()
    watcher = asyncio.create_task(gate.wait_changed(5))
    await _settle()
    gate.notify()  # e.g. a session moved to a boundary
    assert await asyncio.wait_for(watcher, 1) is True
    gate.notify()  # nobody watches: nothing to wake, nothing kept
    assert await gate.wait_changed(0.01) is False


async def test_a_watcher_cancelled_as_the_change_fires_stays_cancelled() -> None:
    # The reason the gate waits with asyncio.timeout: on 3.11 asyncio.wait_for returns the
    # result when a cancel lands as the event fires, and a fence closing would never stop.
    gate = AdmissionGate()
    watcher = asyncio.create_task(gate.wait_changed(5))
    await _settle()
    gate.close()
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert watcher.cancelled()
