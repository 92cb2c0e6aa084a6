"""Row slots: whole sends take their slots at once, and re-sends go before new groups."""

from __future__ import annotations

import asyncio

import pytest

from rollpoint.protocol.errors import BadRequestError
from rollpoint.trainer.dispatch.row_slots import RowSlots


async def test_a_send_takes_all_its_slots_at_once_or_none() -> None:
    slots = RowSlots(4)
    await slots.acquire(3)
    big = asyncio.create_task(slots.acquire(2))
    await asyncio.sleep(0)
    assert not big.done()
    assert slots.used == 3  # it holds none of the one slot left while it waits
    slots.release(1)
    await asyncio.wait_for(big, 1)
    assert slots.used == 4


async def test_a_resend_goes_before_a_waiting_new_group() -> None:
    slots = RowSlots(4)
    await slots.acquire(4)
    order: list[str] = []

    async def take(name: str, n: int, priority: bool) -> None:
        await slots.acquire(n, priority=priority)
        order.append(name)

    new_group = asyncio.create_task(take("group", 4, False))
    await asyncio.sleep(0)
    resend = asyncio.create_task(take("resend", 1, True))
    await asyncio.sleep(0)
    slots.release(1)  # a cohort's refused row: it must not wait for the new group
    await asyncio.wait_for(resend, 1)
    assert order == ["resend"]
    slots.release(4)
    await asyncio.wait_for(new_group, 1)
    assert order == ["resend", "group"]


async def test_a_cancelled_waiter_gives_way_to_the_next() -> None:
    slots = RowSlots(2)
    await slots.acquire(2)
    head = asyncio.create_task(slots.acquire(2))
    small = asyncio.create_task(slots.acquire(1))
    await asyncio.sleep(0)
    slots.release(1)
    await asyncio.sleep(0)
    assert not small.done()  # first come, first served: the head blocks it
    head.cancel()
    await asyncio.wait_for(small, 1)
    assert slots.used == 2
    assert slots.waiters == 0


async def test_impossible_requests_are_refused() -> None:
    slots = RowSlots(2)
    with pytest.raises(BadRequestError):
        await slots.acquire(3)
    with pytest.raises(BadRequestError):
        slots.release(1)
