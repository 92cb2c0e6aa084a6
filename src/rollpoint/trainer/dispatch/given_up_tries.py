"""Given-up tries: what becomes of a try the dispatcher gives up on
(docs/design.md#giving-up-on-a-try).

The try is retired on its replica's participants first, and the agent's answer decides.
``cancelled`` (it was still running) or ``unknown`` (it never got there): the row is re-sent
fresh under a **new** rollout id, never under an id the agent may still run.
``finished_unacked`` (it had finished; only its reply was lost): the row is sent again under
the **same** identity, the agent returns the stored reply without running anything, and it
is sealed like any reply: no rerun. With no release batcher, or when the replica cannot be
reached, the try is abandoned and re-sent fresh at once; it stays in the ledger's abandoned
tries (:attr:`Dispatcher.retire_queue <rollpoint.trainer.dispatch.dispatcher.Dispatcher.retire_queue>`)
and the batcher retires it later. A row fails its group instead once it has used
``max_tries`` fresh rollout ids **and** :data:`RETRY_WINDOW_S` has passed since it was first
lost: a server restarting, or a network cut, costs seconds, and a handful of quick tries
must not fail a group over it. Past ``max_tries`` every re-send backs off (up to
:data:`FRESH_BACKOFF_MAX_S`), so a row that fails everywhere is not sent in a loop.

Owns that sequence: asking for the retire (through the
:class:`~rollpoint.trainer.dispatch.release_batcher.ReleaseBatcher`, after the barrier opens, within
:data:`RETIRE_TIMEOUT_S`), waiting a grace for a down report when the replica did not
answer, adopting finished tries, the ledger moves of abandoning, and the backoff of a fresh
re-send; plus the counts of fresh re-sends and adoptions. It does not open streams, pick
replicas, or record a group's failure: it calls back into the dispatcher's ``send`` and
``fail``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from rollpoint.protocol.control import RetireOutcomeKind
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.group_run import GroupRun
from rollpoint.trainer.dispatch.release_batcher import ReleaseBatcher, RetireAnswer
from rollpoint.trainer.dispatch.replica_picker import ReplicaPicker
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import LedgerRecord, RolloutState

log = logging.getLogger(__name__)

FRESH_BACKOFF_S = 0.25
FRESH_BACKOFF_MAX_S = 2.0
RETRY_WINDOW_S = 10.0
"""A lost row fails its group no sooner than this after it was first lost (the chaos run's
trial 355 lost 4 rows in under a second while a model server restarted; a container restart
takes seconds: the same reasoning as ``snapshot.retry_after_seconds``)."""
RETIRE_TIMEOUT_S = 5.0
"""How long a give-up waits for the agent's retire answer before it re-sends fresh."""
RETIRE_ROUNDS = 3
_DOWN_POLL_S = 0.05
"""Retire calls refused because a snapshot began meanwhile are tried again this often."""

SendRows = Callable[[GroupRun, list[str]], Coroutine[Any, Any, None]]
"""Send these queued rows of the group in one stream, ahead of new groups."""


class GivenUpTries:
    """Retires, adopts or re-sends fresh the tries the dispatcher gives up on."""

    def __init__(
        self,
        ledger: RecoveryLedger,
        roster: ReplicaRoster,
        barrier: DispatchBarrier,
        picker: ReplicaPicker,
        *,
        releases: ReleaseBatcher | None,
        max_tries: int,
        retry_window_s: float = RETRY_WINDOW_S,
        down_grace_s: float,
        down_first: bool = False,
        send: SendRows,
        fail: Callable[[GroupRun, str], None],
    ) -> None:
        self._ledger = ledger
        self._roster = roster
        self._barrier = barrier
        self._picker = picker
        self._releases = releases
        self._max_tries = max_tries
        self._retry_window_s = retry_window_s
        self._down_grace_s = down_grace_s
        self._down_first = down_first
        self._send = send
        self._fail = fail
        self.resent_fresh = 0
        self.adopted = 0
        """Given-up tries whose stored reply was fetched and sealed instead of rerun."""

    def lose(
        self, group: GroupRun, records: list[LedgerRecord], reason: str, *, adopt: bool = True
    ) -> None:
        """Give up on tries of one replica that may still run there; ``adopt=False``: a
        finished one is retired and re-sent fresh too (its stored reply was refused)."""
        if group.failure is not None or not records:
            return
        if self._releases is None:
            self.abandon(group, records, reason)
        else:
            group.spawn(self._give_up(group, records, reason, adopt=adopt))

    async def _give_up(
        self, group: GroupRun, records: list[LedgerRecord], reason: str, *, adopt: bool
    ) -> None:
        """Retire the tries first; then adopt the finished ones and re-send the others.

        ``down_first`` (the servers journal): wait for a down report before that. A server
        of the replica that dies makes its agent fail the rows it was running (a transport
        error) while the agent itself still answers; re-sent fresh under new rollout ids,
        they would run every turn again, their tools' effects too. Reported down within
        the grace, the replica's tries are held for its restart instead, which continues
        them from its journals (:mod:`~rollpoint.trainer.restore.replica_recovery`)."""
        if self._down_first:
            await self._await_down_report(records[0].replica)
            records = [r for r in records if self._still_dispatched(r)]
            if not records:
                return
        answer = await self._retire(records)
        if answer is None:
            await self._await_down_report(records[0].replica)
        # While we waited the replica may have gone down (and its tries with it).
        still = [r for r in records if self._still_dispatched(r)]
        if answer is None:
            self.abandon(group, still, reason)  # the release batcher retires them later
            return
        adopted = [
            r
            for r in still
            if adopt and answer.outcomes.get(r.key) is RetireOutcomeKind.FINISHED_UNACKED
        ]
        if adopted:
            for record in adopted:
                # Same identity, pinned to the agent holding the reply: it answers at once.
                self._ledger.requeue(record.rollout_id, keep_replica=True)
            self.adopted += len(adopted)
            log.info(
                "%s had finished on %s (%s): fetching the stored replies, no rerun",
                ", ".join(r.key for r in adopted),
                adopted[0].replica,
                reason,
            )
            group.spawn(self._send(group, [r.rollout_id for r in adopted]))
        fresh = [r for r in still if r not in adopted]
        self.abandon(group, fresh, reason, retired=answer.everywhere)

    async def _retire(self, records: list[LedgerRecord]) -> RetireAnswer | None:
        """The agent's answer to retiring these tries, or None when there is none to get."""
        replica = records[0].replica
        if self._releases is None or replica is None or not self._roster.is_up(replica):
            return None
        episodes = [r.episode for r in records]
        for _ in range(RETIRE_ROUNDS):
            await self._barrier.wait_open()  # participants refuse retire during a save
            try:
                async with asyncio.timeout(RETIRE_TIMEOUT_S):
                    answer = await self._releases.retire_now(replica, episodes)
            except TimeoutError:
                return None
            if answer is not None or self._barrier.is_open:
                return answer
        return None

    async def _await_down_report(self, replica: str | None) -> None:
        """An unreachable replica may be dying: give the runtime ``down_grace_s`` to say
        so, and the tries a snapshot saved there are restored on its restart (the trainer
        holds them) instead of being re-sent fresh from here."""
        give_up_at = time.monotonic() + self._down_grace_s
        while replica is not None and self._roster.is_up(replica):
            if time.monotonic() >= give_up_at:
                return
            await asyncio.sleep(_DOWN_POLL_S)

    def _still_dispatched(self, record: LedgerRecord) -> bool:
        now = self._ledger.get(record.rollout_id)
        return now.state is RolloutState.DISPATCHED and now.attempt == record.attempt

    def abandon(
        self,
        group: GroupRun,
        records: list[LedgerRecord],
        reason: str,
        *,
        retired: bool = False,
    ) -> None:
        """Re-send these rows fresh; ``retired``: their old tries are retired everywhere."""
        if group.failure is not None or not records:
            return
        fresh: list[str] = []
        now = time.monotonic()
        for record in records:
            lost_for = now - group.first_lost.setdefault(record.row, now)
            if record.tries >= self._max_tries and lost_for >= self._retry_window_s:
                self._fail(
                    group,
                    f"row {record.row} gave up after {record.tries} fresh tries in "
                    f"{lost_for:.1f}s; last: {record.key}: {reason}",
                )
                return
            fresh.append(self._ledger.abandon(record.rollout_id).rollout_id)
            if retired:
                self._ledger.retire(record.rollout_id)
        self.resent_fresh += len(fresh)
        log.info(
            "%s lost (%s): re-sending under new rollout ids",
            ", ".join(r.key for r in records),
            reason,
        )
        group.spawn(self._resend_fresh(group, fresh, tries=1 + max(r.tries for r in records)))

    async def _resend_fresh(self, group: GroupRun, rollout_ids: list[str], *, tries: int) -> None:
        if self._picker.all_suspect() or tries > self._max_tries:
            # No healthy replica to go to, or a row failing wherever it goes: give a
            # restarting server a moment before the row spends another try on it.
            await asyncio.sleep(min(FRESH_BACKOFF_S * 2 ** (tries - 2), FRESH_BACKOFF_MAX_S))
        await self._send(group, rollout_ids)
