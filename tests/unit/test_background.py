"""stop_task: the task's own cancellation is taken, the caller's never is."""

from __future__ import annotations

import asyncio

import pytest

from rollpoint.common.background import stop_task


async def test_a_stopped_task_is_cancelled_and_the_stop_returns() -> None:
    task = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    await stop_task(task)
    assert task.cancelled()


async def test_an_error_the_task_ended_with_is_raised() -> None:
    async def fails() -> None:
        raise ValueError("the task's own error")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="the task's own error"):
        await stop_task(task)


async def test_a_cancel_of_the_caller_while_it_waits_reaches_the_caller() -> None:
    cleaning = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await asyncio.sleep(0.2)  # its cleanup takes a while: the caller waits for it

    ran_on = False

    async def caller() -> None:
        nonlocal ran_on
        inner = asyncio.create_task(slow_to_stop())
        await asyncio.sleep(0)
        await stop_task(inner)
        ran_on = True  # a swallowed cancel would get here
        await asyncio.sleep(10)

    outer = asyncio.create_task(caller())
    await cleaning.wait()
    outer.cancel()  # lands while the caller waits in stop_task
    await asyncio.wait({outer}, timeout=5)
    assert outer.cancelled()
    assert not ran_on
