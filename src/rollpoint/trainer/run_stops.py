"""The run's stops from inside: too many failed groups, a stuck peer.

Owns :class:`RunStops`, whose two side tasks the trainer loop runs alongside the run:
:meth:`~RunStops.on_failures` waits for the feed's failure limit
(``failure.max_failed_fraction``), :meth:`~RunStops.when_stuck` for the :class:`StuckWatch`
(a peer takes calls and answers none). Either takes a final snapshot
(:func:`~rollpoint.trainer.snapshot.early_stop.stop_snapshot`, given the snapshot deadline
and :data:`STOP_SNAPSHOT_SLACK_S` more), then raises its typed error, saying what holds the
run now. A signal's stop is :mod:`rollpoint.preemption`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rollpoint.protocol.errors import GroupsFailedError, RunStuckError
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.control.stuck_watch import StuckWatch
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.failed_groups import digest
from rollpoint.trainer.group_feed import GroupFeed
from rollpoint.trainer.settings import TrainerSettings
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator
from rollpoint.trainer.snapshot.early_stop import stop_snapshot
from rollpoint.trainer.state.ledger import RecoveryLedger

log = logging.getLogger("rollpoint.trainer.trainer")
"""The trainer loop's logger: its parts' lines read (and filter) as they did in one module."""

STOP_SNAPSHOT_SLACK_S = 5.0
"""A stop from inside (too many failed groups, a stuck peer) gives its final snapshot the
snapshot deadline and this much more."""


class RunStops:
    """The two stops from inside, each with its final snapshot (module docstring)."""

    def __init__(
        self,
        config: TrainerSettings,
        coordinator: SnapshotCoordinator | None,
        barrier: DispatchBarrier,
        roster: ReplicaRoster,
        ledger: RecoveryLedger,
        *,
        policy_url: Callable[[], str],
        previous: str | None,
    ) -> None:
        """``policy_url``: the deployment's, as it stands (a replica may come back at new
        URLs). ``previous``: the snapshot the run continues (None: it started fresh)."""
        self.config = config
        self.coordinator = coordinator
        self.barrier = barrier
        self.roster = roster
        self.ledger = ledger
        self._policy_url = policy_url
        self._previous = previous

    async def on_failures(self, feed: GroupFeed) -> None:
        """Too many groups failed (``max_failed_fraction``): a snapshot, then stop."""
        why = await feed.too_many_failed()
        log.warning("%s: taking a snapshot, then stopping", why)
        holds = await self._stop_snapshot()
        raise GroupsFailedError(
            f"stopped early: {why}; {holds}. {digest(feed.failed)}", feed.failed
        )

    async def when_stuck(self) -> None:
        """A peer takes calls and answers none
        (:mod:`~rollpoint.trainer.control.stuck_watch`): a snapshot, then stop."""
        if self.coordinator is None:
            return  # no control plane: no status to read
        watch = StuckWatch(
            self.roster,
            self.ledger,
            policy_url=self._policy_url,
            clock=self.barrier.pause_clock,
            warn_s=self.config.stuck_warn_seconds,
            stop_s=self.config.stuck_stop_seconds,
        )
        why = await watch.run()
        holds = await self._stop_snapshot()
        raise RunStuckError(f"{why}; {holds}")

    async def _stop_snapshot(self) -> str:
        return await stop_snapshot(
            self.coordinator,
            self.barrier,
            budget_s=self.config.save.deadline_seconds + STOP_SNAPSHOT_SLACK_S,
            previous=self._previous,
        )
