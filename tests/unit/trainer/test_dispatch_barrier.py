"""The dispatch barrier: who waits behind it, and the pause clock that stops while closed."""

from __future__ import annotations

import asyncio

from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_pause_clock_stops_while_closed_and_pauses_add_up() -> None:
    clock = FakeClock()
    barrier = DispatchBarrier(clock=clock)
    start = barrier.pause_clock()
    clock.now += 5
    barrier.close()
    clock.now += 30
    assert barrier.pause_clock() - start == 5  # frozen during the pause
    assert barrier.current_pause_seconds == 30
    barrier.open()
    clock.now += 2
    barrier.close()
    clock.now += 3
    barrier.open()
    assert barrier.paused_seconds_total == 33
    assert barrier.pause_clock() - start == 7
    assert barrier.pauses == 2


def test_close_and_open_are_idempotent() -> None:
    clock = FakeClock()
    barrier = DispatchBarrier(clock=clock)
    barrier.close()
    clock.now += 4
    barrier.close()  # must not restart the pause
    clock.now += 4
    barrier.open()
    barrier.open()
    assert barrier.paused_seconds_total == 8
    assert barrier.pauses == 1


async def test_wait_open_blocks_until_the_barrier_opens() -> None:
    barrier = DispatchBarrier()
    await asyncio.wait_for(barrier.wait_open(), 1)  # open: returns at once
    barrier.close()
    waiter = asyncio.create_task(barrier.wait_open())
    await asyncio.sleep(0.02)
    assert not waiter.done()
    barrier.open()
    await asyncio.wait_for(waiter, 1)
    assert barrier.is_open


async def test_a_sealed_barrier_stays_closed_whatever_opens_it() -> None:
    barrier = DispatchBarrier()
    barrier.seal()
    waiter = asyncio.create_task(barrier.wait_open())
    barrier.open()  # a save in progress reopening after its cut
    await asyncio.sleep(0.02)
    assert barrier.sealed and not barrier.is_open and not waiter.done()
    waiter.cancel()
