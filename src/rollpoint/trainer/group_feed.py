"""The feed: which prompt groups a run sends, in what order, and when the train loop gets them.

Owns :class:`GroupFeed`, which the trainer loop holds, and how a task's group is named
(:func:`group_id_for`, checked by :func:`check_task_ids`):

- the order: the ledger's groups, then those added while the run runs
  (:meth:`~GroupFeed.add_groups`, for a run opened with ``more_groups``, until
  :meth:`~GroupFeed.end_groups`), then those sent again because a sample was beyond
  ``max_policy_lag`` (:meth:`~GroupFeed.fresh_enough`, with ``stale_samples: resend``: the
  stale group fails and its task goes again as a new group);
- the feed task (:meth:`~GroupFeed.run`): just enough groups running to saturate the
  dispatcher's row slots, and none while ``max_ready_batches`` batches wait for training
  (what the trainer holds stays bounded however slow training is);
- the groups that failed, and the share of them that stops the run
  (``failure.max_failed_fraction``: :meth:`~GroupFeed.too_many_failed`); a failed group
  leaves the finished queue, and one sent again as a newer group no longer counts;
- the hand-over to the train loop (:meth:`~GroupFeed.next_batch`): whole groups once a
  batch is ready, or the last, partial one once the feed has nothing more to send.

Does not own training, nor the stop itself (:class:`~rollpoint.trainer.run_stops.RunStops`,
with a final snapshot).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import (
    BadRequestError,
    ConfigError,
    InvalidPhaseError,
    RollpointError,
)
from rollpoint.trainer.dispatch.dispatcher import Dispatcher, GroupOutcome
from rollpoint.trainer.dispatch.failed_groups import FailureLimit, superseded
from rollpoint.trainer.policy_lag import PolicyLag, sample_lag
from rollpoint.trainer.settings import TrainerSettings
from rollpoint.trainer.state.finished_queue import FinishedQueue, GroupBatch
from rollpoint.trainer.state.ledger import RecoveryLedger

log = logging.getLogger("rollpoint.trainer.trainer")
"""The trainer loop's logger: its parts' lines read (and filter) as they did in one module."""


def group_id_for(task_id: str) -> str:
    return f"{task_id}-g0"


def check_task_ids(tasks: list[TaskRow], error: type[RollpointError] = ConfigError) -> None:
    """Config tasks are refused as a ConfigError, tasks handed to add_groups as a 400."""
    ids = [t.task_id for t in tasks]
    duplicates = sorted(tid for tid, n in Counter(ids).items() if n > 1)
    if duplicates:
        raise error(f"trainer: task ids appear more than once: {duplicates[:5]}")
    too_long = [tid for tid in ids if len(group_id_for(tid)) > 128]
    if too_long:
        raise error(f"trainer: task id too long for a group id: {too_long[0][:40]}...")


class GroupFeed:
    """The groups to send and the task that sends them (module docstring)."""

    def __init__(
        self,
        config: TrainerSettings,
        ledger: RecoveryLedger,
        finished_queue: FinishedQueue,
        lag: PolicyLag,
        *,
        more_groups: bool,
        training: Callable[[], bool],
    ) -> None:
        """``training``: whether a train step is in hand (its groups may still be sent
        again)."""
        self.config = config
        self.ledger = ledger
        self.finished_queue = finished_queue
        self.lag = lag
        self._training = training
        self.superseded = superseded(ledger)
        """Failed groups sent again as newer groups: not failures of this run any more."""
        self.failed: dict[str, str] = {}
        """Group id → why it failed."""
        self._failure_limit = FailureLimit(config.max_failed_fraction, config.failure_min_groups)
        self._too_many_failed = asyncio.Event()
        self._feed_order = ledger.group_ids()
        """The groups to send, in order: the ledger's, then those added while running."""
        self._more_groups = more_groups
        self._groups_added = asyncio.Event()
        self._tq_changed = asyncio.Event()
        self._tq_drained = asyncio.Event()
        """Set whenever rollouts leave the finished queue's ready groups (taken for
        training, or a failed group dropped): the feed may have room again."""
        self._dispatch_done = False
        self._feed_idle = False
        """The feed sent every group and none runs, but may still get one (a stale group
        sent again): the trainer may train a last, partial batch."""
        self.stale_resent = 0
        """Groups sent again because a sample was beyond ``max_policy_lag``."""

    # --- what the train loop and the trainer tell it ---------------------------------

    def rollout_finished(self) -> None:
        """A rollout joined the finished queue: the train loop looks again."""
        self._tq_changed.set()

    def look_again(self) -> None:
        """A train step ended (or trained nothing): a group may have been sent again."""
        self._groups_added.set()

    # --- the feed task ---------------------------------------------------------------

    async def run(self, dispatcher: Dispatcher) -> None:
        """Keep just enough groups running to saturate the dispatcher's row slots."""
        window = math.ceil(self.config.concurrency / self.config.group_size) + 1
        tickets = asyncio.Semaphore(window)
        running: set[asyncio.Task[GroupOutcome]] = set()
        errors: list[BaseException] = []
        try:
            sent = 0
            while True:
                sent = await self._feed_some(dispatcher, tickets, running, errors, sent)
                if sent < len(self._feed_order):
                    continue  # sent again while the last ones ran
                if not self._may_resend():
                    break
                # Every group sent and settled; a batch still to train may send one again.
                self._feed_idle = True
                self._tq_changed.set()
                self._groups_added.clear()
                await self._groups_added.wait()
                self._feed_idle = False
        finally:
            leftover = list(running)
            for task in leftover:
                task.cancel()
            await asyncio.gather(*leftover, return_exceptions=True)
        self._dispatch_done = True
        self._tq_changed.set()

    def _may_resend(self) -> bool:
        """Whether a group may still be sent again for staleness: batches left to train."""
        if self.config.max_policy_lag is None or self.config.stale_samples != "resend":
            return False
        return self.finished_queue.ready_groups > 0 or self._training()

    async def _feed_some(
        self,
        dispatcher: Dispatcher,
        tickets: asyncio.Semaphore,
        running: set[asyncio.Task[GroupOutcome]],
        errors: list[BaseException],
        sent: int,
    ) -> int:
        """Send the groups of the feed order from ``sent`` on (and those added meanwhile),
        then wait for every one running; returns how many of the order are sent."""

        def finished(task: asyncio.Task[GroupOutcome]) -> None:
            running.discard(task)
            tickets.release()
            if task.cancelled():
                return
            error = task.exception()
            if error is not None:
                errors.append(error)
            else:
                self._group_done(task.result())

        while sent < len(self._feed_order) or self._more_groups:
            if sent == len(self._feed_order):
                self._groups_added.clear()
                await self._groups_added.wait()  # add_groups or end_groups
                continue
            gid = self._feed_order[sent]
            sent += 1
            await tickets.acquire()
            await self._room_to_train()
            if errors:
                raise errors[0]
            task = asyncio.create_task(dispatcher.run_group(gid), name=f"group-{gid}")
            running.add(task)
            task.add_done_callback(finished)
        while running and not errors:
            await asyncio.wait(set(running), return_when=asyncio.FIRST_EXCEPTION)
        if errors:
            raise errors[0]
        return sent

    def _group_done(self, outcome: GroupOutcome) -> None:
        if outcome.group_id in self.superseded:
            return  # failed before, and sent again as a newer group (retry_failed)
        self._failure_limit.settle(failed=outcome.failed is not None)
        if outcome.failed is not None:
            self.failed[outcome.group_id] = outcome.failed
            self.finished_queue.drop_group(outcome.group_id)
            self.lag.settled(outcome.group_id, self.ledger.group(outcome.group_id).group_size)
            self._tq_changed.set()
            self._tq_drained.set()
        groups = len(self.ledger.group_ids()) - len(self.superseded)
        if self._failure_limit.exceeded(groups):
            self._too_many_failed.set()

    async def too_many_failed(self) -> str:
        """Wait until too many groups failed (``max_failed_fraction``); returns why."""
        await self._too_many_failed.wait()
        return self._failure_limit.line()

    async def _room_to_train(self) -> None:
        """Wait while ``max_ready_batches`` batches of finished rollouts wait for training.

        Training slower than rollouts otherwise piles finished replies up in the finished
        queue without end: the trainer's memory (and every snapshot's finished queue) grew
        with the run (issue 33, the soak: 41 KiB per trained row). The bound is at least
        one batch, so the train loop, which takes a batch as soon as one is ready, always
        makes the room waited for here; while the feed waits the dispatcher goes idle, which
        the stall watch does not count as a stall."""
        batches = self.config.max_ready_batches
        if batches is None:
            return
        limit = batches * self.config.batch_size
        while self.finished_queue.ready_rollouts >= limit:
            self._tq_drained.clear()
            await self._tq_drained.wait()

    # --- the hand-over to the train loop ---------------------------------------------

    async def next_batch(self, step: int) -> list[GroupBatch]:
        """Whole groups for ``step`` once a batch is ready (or the last, partial one)."""
        batch_size = self.config.batch_size
        while True:
            if self.finished_queue.ready_rollouts >= batch_size or (
                (self._dispatch_done or self._feed_idle) and self.finished_queue.ready_groups
            ):
                taken = self.finished_queue.take_groups(batch_size, train_step=step)
                self._tq_drained.set()
                return taken
            if self._dispatch_done:
                return []
            self._tq_changed.clear()
            await self._tq_changed.wait()

    # --- groups added while running -------------------------------------------------

    def add_groups(self, tasks: Iterable[TaskRow]) -> list[str]:
        """Add one prompt group per task (see :meth:`Trainer.add_groups`); returns the ids
        of the groups added."""
        if not self._more_groups:
            raise InvalidPhaseError(
                "trainer: this run takes no more groups (open it with more_groups=True, "
                "and add before end_groups)"
            )
        rows = list(tasks)
        check_task_ids(rows, BadRequestError)
        new = [t for t in rows if not self.ledger.has_group(group_id_for(t.task_id))]
        for task in rows:
            if task not in new and self.ledger.task(task.task_id) != task:
                raise BadRequestError(f"trainer: task {task.task_id} was added with other contents")
        added = []
        for task in new:
            gid = group_id_for(task.task_id)
            self.ledger.add_group(task, gid, self.config.group_size)
            self.finished_queue.expect_group(gid, self.config.group_size)
            self._feed_order.append(gid)
            added.append(gid)
        if added:
            self._groups_added.set()
        return added

    def end_groups(self) -> None:
        """No more groups will be added: the run ends once those it has are trained."""
        self._more_groups = False
        self._groups_added.set()

    # --- stale groups sent again -----------------------------------------------------

    def fresh_enough(self, groups: list[GroupBatch], live: int) -> list[GroupBatch]:
        """The groups to train under the ``live`` version: with ``stale_samples: resend``,
        a group with a sample beyond ``max_policy_lag`` is left out and sent again as a new
        group of its task (one the ledger already replaced, after a restore, is just left
        out)."""
        bound = self.config.max_policy_lag
        if bound is None or self.config.stale_samples != "resend":
            return groups
        kept = []
        for batch in groups:
            if batch.group_id in self.superseded:
                continue
            lag = max((sample_lag(r.model_calls, live) for r in batch.replies), default=0)
            if lag <= bound:
                kept.append(batch)
                continue
            self._send_again(batch, lag, bound)
        return kept

    def _send_again(self, batch: GroupBatch, lag: int, bound: int) -> None:
        gid = batch.group_id
        task_id = self.ledger.group(gid).task_id
        self.ledger.fail_group(
            gid, f"stale: a sample {lag} policy versions behind (train.max_policy_lag {bound})"
        )
        self.superseded.add(gid)
        taken = {g for g in self.ledger.group_ids() if self.ledger.group(g).task_id == task_id}
        n = len(taken)
        while f"{task_id}-g{n}" in taken:
            n += 1
        new = f"{task_id}-g{n}"
        self.ledger.add_group(self.ledger.task(task_id), new, batch.size)
        self.finished_queue.expect_group(new, batch.size)
        self._feed_order.append(new)
        self.lag.settled(gid, batch.size)
        self.stale_resent += 1
        log.info(
            "group %s: a sample %d versions behind the live policy; sent again as %s", gid, lag, new
        )
