"""The train loop: whole groups from the feed, through the train hooks, into the step record.

Owns :class:`TrainLoop`, which the trainer loop holds and runs beside the feed. Each step
takes a batch of whole groups from the :class:`GroupFeed` (stale ones left out and sent
again), hands the rest to the :class:`TrainHooks` as :class:`TrainSample` with their
advantages, counts a policy version (unless the trainer reports its own), writes the step's
rows to the :class:`StepRecord` and appends the step to the event log. The step is then
made durable (its train checkpoint written, the finished queue committed, a snapshot that
composes with it) at once, every ``checkpoint_every_steps`` or when the hooks say so, or
later, when the trainer marks it (:meth:`TrainLoop.mark_durable`).

Its counts (steps, groups and episodes trained, the state the hooks handed over) are the
run's: each train checkpoint records them, and a restored run starts from its checkpoint's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pydantic import JsonValue

from rollpoint.http.client import HttpClient
from rollpoint.protocol.errors import BadRequestError
from rollpoint.store import retention
from rollpoint.trainer.group_feed import GroupFeed
from rollpoint.trainer.grpo import advantages_by_episode
from rollpoint.trainer.policy_lag import PolicyLag
from rollpoint.trainer.policy_versions import PolicyVersions
from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint, stamp
from rollpoint.trainer.run_events import RunEvents, TrainStep
from rollpoint.trainer.settings import TrainerSettings
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator
from rollpoint.trainer.state.finished_queue import FinishedQueue, GroupBatch
from rollpoint.trainer.step_record import StepRecord
from rollpoint.trainer.train_hooks import StepResult, TrainHooks, TrainSample

log = logging.getLogger("rollpoint.trainer.trainer")
"""The trainer loop's logger: its parts' lines read (and filter) as they did in one module."""


class TrainLoop:
    """Train steps and when each is durable (module docstring)."""

    def __init__(
        self,
        config: TrainerSettings,
        hooks: TrainHooks,
        step_record: StepRecord,
        finished_queue: FinishedQueue,
        *,
        feed: GroupFeed,
        versions: PolicyVersions,
        lag: PolicyLag,
        events: Callable[[], RunEvents],
        coordinator: SnapshotCoordinator | None,
        restored: TrainCheckpoint | None,
    ) -> None:
        """``events``: the run's event log, as the trainer holds it when a step ends (it
        may be swapped after the trainer is built). ``restored``: the checkpoint a restored
        run continues from (its counts)."""
        self.config = config
        self.hooks = hooks
        self.step_record = step_record
        self.finished_queue = finished_queue
        self.feed = feed
        self.versions = versions
        self.lag = lag
        self._events = events
        self.coordinator = coordinator
        self.train_steps = 0
        self.groups_trained = 0
        self.episodes_trained = 0
        self.trainer_state: JsonValue = None
        """The state the train hooks last handed over (kept in each train checkpoint)."""
        self.last_metrics: dict[str, float] = {}
        self.stale_marked = 0
        """Samples handed over marked ``stale``."""
        self.not_durable: dict[int, TrainCheckpoint] = {}
        """Steps trained but not durable yet: their checkpoints as they stood, by step."""
        self._checkpointing = asyncio.Lock()
        self.step_in_hand: int | None = None
        """The step handed to the train hooks and not yet recorded."""
        self._step_recorded = asyncio.Condition()
        if restored is not None:
            self.train_steps = restored.step
            self.trainer_state = restored.trainer_state
            self.groups_trained = restored.groups_trained
            self.episodes_trained = restored.episodes_trained

    async def run(self, client: HttpClient) -> None:
        """Train every batch the feed hands over; return once it hands over none."""
        while True:
            groups = await self.feed.next_batch(self.train_steps + 1)
            if not groups:
                return
            await self._train_step(client, self.train_steps + 1, groups)

    async def _train_step(self, client: HttpClient, step: int, groups: list[GroupBatch]) -> None:
        groups = self.feed.fresh_enough(groups, self.versions.live)
        if not groups:
            self.feed.look_again()  # the feed looks again: a group may have been re-sent
            return  # every group was sent again: the step trains the next batch instead
        advantages = advantages_by_episode(batch.replies for batch in groups)
        live, bound = self.versions.live, self.config.max_policy_lag
        samples = [
            TrainSample.from_reply(
                reply,
                advantage=advantages[reply.episode.key],
                group_size=batch.size,
                live=live,
                max_lag=bound,
            )
            for batch in groups
            for reply in batch.replies
        ]
        self.stale_marked += sum(s.stale for s in samples)
        generated_by = self.versions.live
        self.step_in_hand = step
        try:
            await self._record_step(client, step, groups, samples, generated_by)
        finally:
            # Waiters in mark_durable go on whether the step was recorded or failed.
            async with self._step_recorded:
                self.step_in_hand = None
                self._step_recorded.notify_all()
            for batch in groups:
                self.lag.settled(batch.group_id, batch.size)
            self.feed.look_again()  # the feed looks again (it may wait for this step)
        log.info(
            "train step %d: %d rollouts from %d groups; %s",
            step,
            len(samples),
            len(groups),
            ", ".join(f"{k}={v:.4g}" for k, v in self.last_metrics.items()),
        )

    async def _record_step(
        self,
        client: HttpClient,
        step: int,
        groups: list[GroupBatch],
        samples: list[TrainSample],
        generated_by: int,
    ) -> None:
        """The hooks' update of ``step``, then its train data, event and checkpoint."""
        result = await self.hooks.train_step(step, samples)
        durable: bool | None = None
        if isinstance(result, StepResult):
            self.last_metrics, durable = result.metrics, result.durable
            if result.state is not None:
                self.trainer_state = result.state
        else:
            self.last_metrics = result
        await self.versions.count_step(client)
        coverage = await asyncio.to_thread(self.step_record.write_step, step, samples, generated_by)
        self.train_steps = step
        self.groups_trained += len(groups)
        self.episodes_trained += len(samples)
        # Before the checkpoint's snapshot: a kill during it must not hide the step.
        self._events().append(
            TrainStep(ts=time.time(), step=step, rollouts=len(samples), groups=len(groups))
        )
        # What the step's checkpoint records, as of now: a trainer that saves its weights
        # in the background marks the step durable later (mark_durable).
        checkpoint = stamp(
            step,
            self.versions.live,
            coverage,
            self.episodes_trained,
            self.groups_trained,
            self.trainer_state,
        )
        if durable is None:
            every = self.config.checkpoint_every_steps
            durable = every is not None and step % every == 0
        if durable:
            await self._checkpoint(checkpoint)
        else:
            self.not_durable[step] = checkpoint

    async def mark_durable(self, step: int) -> None:
        """The trainer's own checkpoint of ``step`` is durable now (see
        :meth:`Trainer.mark_durable`)."""
        if step == self.step_in_hand:
            # Marked as soon as it was done, before the loop recorded it: wait for that.
            async with self._step_recorded:
                await self._step_recorded.wait_for(lambda: self.step_in_hand != step)
        if step <= self.finished_queue.committed_step:
            return
        checkpoint = self.not_durable.get(step)
        if checkpoint is None:
            waiting = ", ".join(map(str, sorted(self.not_durable))) or "none"
            raise BadRequestError(
                f"trainer: step {step} is not a trained step waiting to be durable "
                f"(trained up to {self.train_steps}; waiting: {waiting})"
            )
        await self._checkpoint(checkpoint)

    async def _checkpoint(self, checkpoint: TrainCheckpoint) -> None:
        """A durable train checkpoint, then the finished queue lets go of what it consumed, then a snapshot
        that composes with it (taken at a step >= the checkpoint's)."""
        step = checkpoint.step
        async with self._checkpointing:  # the train loop and mark_durable, one at a time
            if step <= self.finished_queue.committed_step:
                return  # a later step was made durable meanwhile
            protect = await asyncio.to_thread(self._steps_to_keep, step)
            await asyncio.to_thread(self.step_record.save, checkpoint, protect=protect)
            self.finished_queue.commit(step)
            for older in [s for s in self.not_durable if s <= step]:
                del self.not_durable[older]
        if self.coordinator is not None:
            await self.coordinator.save()

    def _steps_to_keep(self, step: int) -> frozenset[int]:
        """The train checkpoints retention keeps once ``step``'s is written: never one a
        kept snapshot composes with, the store's fallback included, nor this run's own
        newest after a resume from an older snapshot (one decision with the snapshots':
        :func:`retention.checkpoints_to_keep`)."""
        if self.coordinator is None:
            return frozenset()
        store = self.coordinator.store
        return retention.checkpoints_to_keep(
            store.spans(),
            self.step_record.steps(),
            step,
            keep_snapshots=store.keep,
            keep_checkpoints=self.step_record.keep,
            protect=store.pinned | store.kept_fallback,
        )
