"""Row deadlines: a stream that still owes rows expires after its timeout on the pause
clock, never counting time the barrier was closed, and never when it owes nothing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from rollpoint.protocol.errors import BadRequestError
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.row_deadlines import RowDeadlines


@dataclass(eq=False)
class FakeStream:
    name: str
    pending: set[str] = field(default_factory=lambda: {"r0"})


class Expired:
    def __init__(self) -> None:
        self.streams: list[str] = []

    def __call__(self, stream: FakeStream) -> None:
        stream.pending.clear()
        self.streams.append(stream.name)


def deadlines(
    barrier: DispatchBarrier, timeout_s: float, expired: Expired
) -> RowDeadlines[FakeStream]:
    return RowDeadlines(barrier, timeout_s, owes=lambda s: bool(s.pending), expire=expired)


async def test_streams_expire_in_order_and_those_owing_nothing_never_do() -> None:
    barrier, expired = DispatchBarrier(), Expired()
    watch = deadlines(barrier, 0.05, expired)
    a, b, c = FakeStream("a"), FakeStream("b"), FakeStream("c")
    for stream in (a, b, c):
        watch.add(stream)
    b.pending.clear()  # b got every answer in time
    await asyncio.sleep(0.15)
    await watch.aclose()
    assert expired.streams == ["a", "c"]


async def test_time_paused_by_a_snapshot_does_not_count() -> None:
    barrier, expired = DispatchBarrier(), Expired()
    watch = deadlines(barrier, 0.1, expired)
    watch.add(FakeStream("a"))
    barrier.close()
    await asyncio.sleep(0.2)  # twice the timeout, all of it paused
    assert expired.streams == []
    barrier.open()
    await asyncio.sleep(0.04)
    assert expired.streams == []  # the 0.1 s budget is still running
    await asyncio.sleep(0.12)
    await watch.aclose()
    assert expired.streams == ["a"]


def test_a_timeout_that_is_not_positive_is_refused() -> None:
    with pytest.raises(BadRequestError, match="row_timeout_s must be > 0"):
        deadlines(DispatchBarrier(), 0, Expired())


async def test_ended_streams_are_not_kept_until_their_due_time() -> None:
    # Dropped only at the head, every ended stream stayed a whole timeout behind the oldest
    # (300 s of rows at the default: issue 33's soak). The watch holds what is open.
    barrier, expired = DispatchBarrier(), Expired()
    watch = deadlines(barrier, 300.0, expired)
    oldest = FakeStream("oldest")  # a long row: still owed
    watch.add(oldest)
    for number in range(1000):
        stream = FakeStream(f"s{number}")
        watch.add(stream)
        await asyncio.sleep(0)  # the watch task runs between streams
        stream.pending.clear()
        watch.drop(stream)
    assert len(watch) == 1
    watch.drop(oldest)
    assert len(watch) == 0
    await watch.aclose()
    assert expired.streams == []


async def test_a_stream_dropped_while_the_watch_sleeps_on_it_never_expires() -> None:
    barrier, expired = DispatchBarrier(), Expired()
    watch = deadlines(barrier, 0.05, expired)
    a, b = FakeStream("a"), FakeStream("b")
    watch.add(a)
    watch.add(b)
    await asyncio.sleep(0.01)  # the watch sleeps until a's due time
    watch.drop(a)  # a ended (its rows were settled by the dispatcher), still "owing"
    await asyncio.sleep(0.15)
    await watch.aclose()
    assert expired.streams == ["b"]
