"""The trainer's façade for a synchronous training loop: :class:`SyncRollouts`.

Owns running a :class:`~rollpoint.rollouts.Rollouts` on an event loop in a thread of its
own, so that a loop with no asyncio of its own pulls batches from a plain iterator and
makes every call as a plain call (each handed to the run's loop and waited for). The run
and its guarantees are the async façade's; what this adds is the hand-over between the
two threads, and one-line errors for a call made after the run's thread ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Self, TypeVar

from pydantic import JsonValue

from rollpoint.job.settings import JobConfig, JobSettings
from rollpoint.policy.engine_adapters import PauseMode
from rollpoint.protocol.deployment import ReplicaEndpoints, ServedDeployment
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import InvalidPhaseError
from rollpoint.rollouts import END_OF_RUN, Rollouts, RunProgress, TrainBatch
from rollpoint.trainer.snapshot.cut import SaveReport
from rollpoint.trainer.step_record import StepRecord
from rollpoint.trainer.trainer import RunSummary

log = logging.getLogger(__name__)
T = TypeVar("T")

_CALL_POLL_S = 0.1
"""How often a call waiting on the run's loop checks that the run's thread still lives (a
loop that stopped does not run what was handed to it)."""

__all__ = ["SyncRollouts"]


class SyncRollouts:
    """:class:`Rollouts` for a synchronous training loop: ``with SyncRollouts(config) as run``.

    The run lives on an event loop in a thread of its own; :meth:`batches` is a plain
    iterator and :meth:`snapshot` a plain call. Same arguments and the same guarantees as
    :class:`Rollouts`. For the embedded runtime or attached servers (the Ray runtime's
    driver must be the main thread: it handles signals).
    """

    def __init__(
        self,
        config: JobSettings | JobConfig,
        *,
        deployment: ServedDeployment | None = None,
        fresh: bool = False,
        more_groups: bool = False,
        step_record: StepRecord | None = None,
        say: Callable[[str], None] = log.info,
        retry_failed: bool = False,
    ) -> None:
        self._rollouts = Rollouts(
            config,
            deployment=deployment,
            fresh=fresh,
            more_groups=more_groups,
            step_record=step_record,
            say=say,
            retry_failed=retry_failed,
        )
        self._items: queue.Queue[TrainBatch | BaseException | object] = queue.Queue()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[RunSummary] | None = None
        self._summary: RunSummary | None = None
        self._pending: TrainBatch | None = None
        self._thread = threading.Thread(target=self._serve, name="rollpoint-rollouts", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            self._thread.join()
            raise self._failed
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leaving before the run ended stops it, as :class:`Rollouts` does."""
        loop, main = self._loop, self._main
        if self._thread.is_alive() and loop is not None and main is not None:
            # The run may end and its thread close the loop at any moment: a loop closed
            # before or during this call has nothing left to stop.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(main.cancel)
        self._thread.join()

    @property
    def settings(self) -> JobSettings:
        """What this run was told (as :attr:`Rollouts.settings`)."""
        return self._rollouts.settings

    @property
    def resumed_from(self) -> str | None:
        return self._rollouts.resumed_from

    @property
    def resumed_step(self) -> int:
        return self._rollouts.resumed_step

    @property
    def resumed_state(self) -> JsonValue:
        return self._rollouts.resumed_state

    @property
    def continued(self) -> int:
        return self._rollouts.continued

    def batches(self) -> Iterator[TrainBatch]:
        """Each train step's batch; a batch not yet done when the next is asked for is done then."""
        while True:
            if self._pending is not None:
                self._pending.done()
                self._pending = None
            item = self._items.get()
            if isinstance(item, BaseException):
                raise item
            if not isinstance(item, TrainBatch):
                return
            self._pending = item
            yield item

    def progress(self) -> RunProgress:
        """As :meth:`Rollouts.progress`, read on the run's loop (its ledger changes there)."""

        async def read() -> RunProgress:
            return self._rollouts.progress()

        return self._call(read())

    def snapshot(self) -> SaveReport:
        """Take one snapshot now; returns once it is published or failed."""
        return self._call(self._rollouts.snapshot())

    def add_groups(self, tasks: Iterable[TaskRow]) -> list[str]:
        """As :meth:`Rollouts.add_groups`, from your thread."""
        return self._call(self._rollouts.add_groups(list(tasks)))

    def end_groups(self) -> None:
        """As :meth:`Rollouts.end_groups`, from your thread."""
        self._call(self._rollouts.end_groups())

    def mark_durable(self, step: int) -> None:
        """As :meth:`Rollouts.mark_durable`, from your thread."""
        self._call(self._rollouts.mark_durable(step))

    def weights_live(self, version: int) -> None:
        """As :meth:`Rollouts.weights_live`, from your thread."""
        self._call(self._rollouts.weights_live(version))

    @contextmanager
    def weight_update(self, version: int, mode: PauseMode = "keep") -> Iterator[None]:
        """As :meth:`Rollouts.weight_update`: ``with run.weight_update(v):`` push inside."""

        async def pause() -> None:
            await self._rollouts._started().pause_for_update(mode)

        async def end(live: int | None) -> None:
            await self._rollouts._started().end_update(live)

        self._call(pause())
        try:
            yield
        except BaseException:
            self._call(end(None))
            raise
        self._call(end(version))

    def replica_down(self, name: str) -> None:
        """As :meth:`Rollouts.replica_down`, from your thread."""
        self._call(self._rollouts.replica_down(name))

    def replica_up(self, endpoints: ReplicaEndpoints) -> None:
        """As :meth:`Rollouts.replica_up`, from your thread."""
        self._call(self._rollouts.replica_up(endpoints))

    def _call(self, call: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            call.close()
            raise InvalidPhaseError("rollouts: the run is not open (use with)")
        # The run may end, and its thread stop and close the loop, at any moment: a call
        # made then is refused in one line, never an asyncio RuntimeError or a wait for a
        # loop that will not run it.
        try:
            future = asyncio.run_coroutine_threadsafe(call, self._loop)
        except RuntimeError:  # the loop is closed
            call.close()
            raise InvalidPhaseError("rollouts: the run has ended") from None
        while True:
            try:
                return future.result(timeout=_CALL_POLL_S)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive() and not future.done():
                    future.cancel()
                    call.close()  # never started, and nothing will start it now
                    raise InvalidPhaseError(
                        "rollouts: the run ended before this call ran"
                    ) from None

    def summary(self) -> RunSummary:
        """The run's end: every batch pulled and done; its figures."""
        self._thread.join()
        if self._failed is not None:
            raise self._failed
        if self._summary is None:
            raise InvalidPhaseError("rollouts: the run was stopped before its end")
        return self._summary

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._main = loop.create_task(self._drive())
            loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # handed to the caller's thread, raised there
            self._failed = exc
            self._items.put(exc)
        finally:
            self._ready.set()
            self._items.put(END_OF_RUN)
            loop.close()

    async def _drive(self) -> RunSummary:
        async with self._rollouts as run:
            self._ready.set()
            async for batch in run.batches():
                self._items.put(batch)
                await asyncio.shield(batch._reply)  # done() from the caller's thread
            self._summary = await run.summary()
            return self._summary
