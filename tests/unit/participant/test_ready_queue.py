"""Control work ahead of the data plane: what rollpoint.participant.ready_queue promises.

A backlog of ready handles stands in for a model server's burst of 1k-token replies (issue
37: a commit waited 2.7 s behind ~750 of them, three times). Each test checks the order the
loop ran things in, never a duration.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollpoint.participant.control_listener import hand_over
from rollpoint.participant.ready_queue import FrontTask, step_next

BACKLOG = 500


def queue_backlog(loop: asyncio.AbstractEventLoop, ran: list[object]) -> None:
    for i in range(BACKLOG):
        loop.call_soon(ran.append, i)


async def test_step_next_runs_the_handles_just_scheduled_first_in_their_order() -> None:
    loop = asyncio.get_running_loop()
    ran: list[object] = []
    queue_backlog(loop, ran)
    loop.call_soon(ran.append, "a")
    loop.call_soon(ran.append, "b")
    step_next(loop, 2)
    await asyncio.sleep(0.01)
    assert ran[:3] == ["a", "b", 0]
    assert len(ran) == BACKLOG + 2


async def test_a_front_task_runs_and_wakes_its_waiter_before_the_backlog() -> None:
    loop = asyncio.get_running_loop()
    ran: list[object] = []
    queue_backlog(loop, ran)

    async def capture() -> int:
        ran.append("captured")
        return 7

    task = FrontTask(capture())
    assert await task.result(10.0) == 7
    ran.append("woken")
    assert ran[:2] == ["captured", "woken"]
    assert task.task.result() == 7


async def test_a_front_task_that_fails_wakes_its_waiter_with_the_failure_first() -> None:
    loop = asyncio.get_running_loop()
    ran: list[object] = []
    queue_backlog(loop, ran)

    async def capture() -> int:
        raise ValueError("export failed")

    task = FrontTask(capture())
    with pytest.raises(ValueError, match="export failed"):
        await task.result(10.0)
    assert ran == []  # woken before any of the backlog ran
    assert isinstance(task.task.exception(), ValueError)


async def test_a_waiter_out_of_time_leaves_the_task_running_for_the_next() -> None:
    release = asyncio.Event()

    async def capture() -> str:
        await release.wait()
        return "captured"

    task = FrontTask(capture())
    with pytest.raises(TimeoutError):
        await task.result(0.01)
    assert not task.task.done()
    release.set()
    assert await task.result(10.0) == "captured"


def test_a_verb_handed_to_a_busy_data_loop_runs_and_answers_ahead_of_its_backlog() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    holding, release = threading.Event(), threading.Event()
    ran: list[object] = []

    def hold() -> None:  # the data loop busy in one callback, the backlog ready behind it
        holding.set()
        release.wait(10)

    def fill() -> None:
        loop.call_soon(hold)
        queue_backlog(loop, ran)

    try:
        loop.call_soon_threadsafe(fill)
        assert holding.wait(10)

        async def verb() -> int:
            return len(ran)

        out = hand_over(loop, verb())
        answered_at: list[int] = []
        out.add_done_callback(lambda _: answered_at.append(len(ran)))
        release.set()
        assert out.result(10) == 0  # the verb ran before any of the backlog
        assert answered_at == [0]  # and its reply was handed back before any of it too
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
