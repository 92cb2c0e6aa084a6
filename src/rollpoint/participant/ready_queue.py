"""Control work ahead of the data plane on a participant's data loop: its steps at the front of the ready queue.

Owns the one place the participant side reaches into asyncio's insides: the ready queue
(a ``deque`` of handles) and the self-pipe wake-up of an asyncio event loop
(:func:`ready_queue`), and what is built on them: moving the handle just scheduled to the
front (:func:`step_next`), and :class:`FrontTask`, a task whose first step and whose
waiters' wake-ups run next rather than after everything the loop has ready.

Why: a control verb runs on the data loop (the participant's state lives there), and a
model server releasing 1k-token replies with logprobs has hundreds to thousands of
callbacks ready at once, each ~1 ms. Every step of a verb that asyncio schedules the usual
way (a task's first step, the wake-up of a task whose awaited future finished, a done
callback) waits for all of them. Measured at 10k sessions with token data (issue 37): a
model server's commit took 2.7 s, of which its capture's work was 21-29 ms and the rest
three such waits — the capture task's first step behind 711-785 ready handles (0.6-0.9
s), then the commit's wake-up once the capture finished (shield's done callback, then the
task's wake-up: 1.8-2.1 s) — and the reply's hand-back to the control thread one more.

Each move here is a reorder of handles the loop already holds: nothing is skipped, run
twice or run on another thread. On any loop without that queue (uvloop), every function
degrades to plain asyncio: the same order as before, behind what is ready.

Does not own the control listener's hand-over between threads
(:func:`rollpoint.participant.control_listener.hand_over`), nor what a capture does
(:mod:`rollpoint.participant.checkpoint_write`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def ready_queue(
    loop: asyncio.AbstractEventLoop,
) -> tuple[deque[asyncio.Handle] | None, Callable[[], None] | None]:
    """The ready queue and self-pipe wake-up of an asyncio (selector or proactor) loop;
    (None, None) on any other loop. Private to asyncio, hence read defensively."""
    if not isinstance(loop, asyncio.BaseEventLoop):
        return None, None
    ready = getattr(loop, "_ready", None)
    wake = getattr(loop, "_write_to_self", None)
    if not isinstance(ready, deque) or not callable(wake):
        return None, None
    return ready, wake


def step_next(loop: asyncio.AbstractEventLoop, count: int = 1) -> None:
    """On ``loop``'s own thread, right after scheduling ``count`` handles (a
    ``create_task``, a future's result set): they run next, in the order they were
    scheduled, rather than after the rest of the ready queue."""
    ready, _ = ready_queue(loop)
    if not ready or count <= 0:
        return
    moved = [ready.pop() for _ in range(min(count, len(ready)))]
    ready.extendleft(moved)  # popped last-first, so extendleft restores their order


class FrontTask(Generic[T]):
    """``coro`` as a task of the running loop whose first step runs next, and whose
    waiters (:meth:`result`) wake next once it finishes: the task itself settles their
    futures as its last step and moves their wake-ups to the front, where a done callback
    would be scheduled behind everything ready.

    ``task`` is the plain :class:`asyncio.Task` (its result, its failure, its
    cancellation), for whoever needs no hurry."""

    def __init__(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._waiters: list[asyncio.Future[T]] = []
        self.task: asyncio.Task[T] = self._loop.create_task(self._run(coro), name=name)
        step_next(self._loop)

    async def result(self, timeout_s: float) -> T:
        """The task's result (or its exception), awaited at most ``timeout_s``
        (:class:`TimeoutError`); the task goes on either way."""
        if self.task.done():
            return self.task.result()
        waiter: asyncio.Future[T] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            result = await coro
        except asyncio.CancelledError:
            self._settle(asyncio.Future.cancel)
            raise
        except BaseException as exc:
            self._settle(partial(_fail, exc))
            raise
        self._settle(partial(_succeed, result))
        return result

    def _settle(self, settle: Callable[[asyncio.Future[T]], object]) -> None:
        waiters, self._waiters = self._waiters, []
        ready, _ = ready_queue(self._loop)
        before = len(ready) if ready is not None else 0
        for waiter in waiters:
            if not waiter.done():
                settle(waiter)
        if ready is not None:
            step_next(self._loop, len(ready) - before)


def _succeed(result: T, waiter: asyncio.Future[T]) -> None:
    waiter.set_result(result)


def _fail(exc: BaseException, waiter: asyncio.Future[Any]) -> None:
    waiter.set_exception(exc)
