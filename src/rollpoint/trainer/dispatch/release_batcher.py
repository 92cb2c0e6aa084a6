"""What the trainer tells the environment it no longer needs: acks, retires and forgets.

Owns three batched, idempotent flows, flushed together every ``interval_s``:

- **ack**: a sealed rollout's reply is released by its agent (it keeps every finished
  reply until then, so a reply lost on the wire is never lost for good);
- **retire**: a try given up on and still abandoned in the ledger (the dispatcher could
  not retire it at once) gets a retire mark on every participant of its replica, so its
  running work stops and its late calls are refused; then the ledger retires it. A try
  the agent had already finished is acked away: nobody will seal its reply any more;
- **forget**: once a rollout is sealed (or retired a while ago), every participant of its
  replica drops what it keeps about it (call ledger, tool state, marks): memory stays
  bounded by what is in flight, not by the run's length.

It also serves the dispatcher's **retire now** (:meth:`ReleaseBatcher.retire_now`): retire
tries on their replica at once and return the agent's answer, so the dispatcher can adopt a
finished reply instead of running its row again.

A replica that is down (see :class:`~rollpoint.trainer.control.replica_roster.ReplicaRoster`) gets
nothing: its queued acks and forgets are dropped and its abandoned tries are retired in the
ledger directly, since the processes that ran them are gone. Nothing is flushed while the
dispatch barrier is closed (a snapshot's cut must not lose a reply its agent is about to
export), and a participant busy with a checkpoint refuses forget and retire (409): the batch
stays queued and goes out at the next flush. Nothing here blocks the data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from rollpoint.protocol.control import RetireOutcomeKind, RetireReply
from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.state.ledger import RecoveryLedger

log = logging.getLogger(__name__)

# A retired rollout keeps its mark this long before it is forgotten: long enough for any
# call of the old try still on the wire to arrive and be refused.
RETIRE_GRACE_S = 10.0
BATCH_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class RetireAnswer:
    """What retiring tries at once on their replica found."""

    outcomes: dict[str, RetireOutcomeKind]
    """The agent's word on each try, by episode key (``r7#0``)."""
    everywhere: bool
    """Every participant of the replica raised the marks: the tries are retired for good.
    False when one of them did not answer (the ledger keeps them abandoned, to retry)."""


class ReleaseBatcher:
    def __init__(
        self,
        participants: Sequence[ParticipantClient] | ReplicaRoster,
        ledger: RecoveryLedger,
        *,
        interval_s: float = 0.25,
        barrier: DispatchBarrier | None = None,
    ) -> None:
        """``participants``: a roster (replicas may go down and come back) or a fixed list."""
        self._roster = (
            participants
            if isinstance(participants, ReplicaRoster)
            else ReplicaRoster.of_participants(participants)
        )
        self._ledger = ledger
        self._interval_s = interval_s
        self._barrier = barrier
        self._lock = asyncio.Lock()
        self._acks: dict[str, list[EpisodeId]] = defaultdict(list)
        self._forgets: dict[str, list[str]] = defaultdict(list)
        self._retired_at: list[tuple[float, str, str]] = []
        self.acked = 0
        self.acked_away = 0
        """Finished replies of tries given up on, released unread."""
        self.retired = 0
        self.forgotten = 0

    def sealed(self, episode: EpisodeId, replica: str) -> None:
        """A rollout was sealed: ack its reply, then forget it everywhere."""
        self._acks[replica].append(episode)
        self._forgets[replica].append(episode.rollout_id)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            if self._barrier is not None and not self._barrier.is_open:
                return  # a cut is being taken: wait for the next flush
            self._drop_down_replicas()
            await self._retire_abandoned()
            await self._flush_acks()
            now = time.monotonic()
            while self._retired_at and self._retired_at[0][0] <= now:
                _, replica, rollout_id = self._retired_at.pop(0)
                self._forgets[replica].append(rollout_id)
            await self._flush_forgets()

    async def retire_now(self, replica: str, episodes: list[EpisodeId]) -> RetireAnswer | None:
        """Retire these tries on every participant of ``replica`` at once.

        Returns the agent's answer, or None when the replica is down or its agent did not
        answer (unreachable, or busy with a checkpoint): the caller decides without it.
        The ledger moves are the caller's; forgetting the marks later is queued here.
        """
        clients = self._roster.participants(replica)
        agent = self._roster.agent(replica)
        if agent is None:
            return None
        results = await asyncio.gather(
            *(p.retire(episodes) for p in clients), return_exceptions=True
        )
        replies = dict(zip(clients, results, strict=True))
        answer = replies[agent]
        if not isinstance(answer, RetireReply):
            detail = answer.message if isinstance(answer, RollpointError) else repr(answer)
            log.info("retire of %d tries on %s: no answer (%s)", len(episodes), agent.label, detail)
            return None
        everywhere = all(isinstance(r, RetireReply) for r in results)
        if everywhere:
            self._forget_later(replica, [e.rollout_id for e in episodes])
            self.retired += len(episodes)
        return RetireAnswer(
            outcomes={o.episode.key: o.outcome for o in answer.outcomes}, everywhere=everywhere
        )

    # --- flows -----------------------------------------------------------------------

    def _drop_down_replicas(self) -> None:
        for replica in self._roster.down:
            # Its processes died with everything they held: nothing left to release there.
            self._acks.pop(replica, None)
            self._forgets.pop(replica, None)

    async def _flush_acks(self) -> None:
        for replica, episodes in list(self._acks.items()):
            if not episodes:
                continue
            batch, self._acks[replica] = episodes[:BATCH_LIMIT], episodes[BATCH_LIMIT:]
            agent = self._roster.agent(replica)
            if agent is None:
                continue
            try:
                await agent.ack(batch)
                self.acked += len(batch)
            except RollpointError as exc:
                log.debug("ack on %s deferred: %s", agent.label, exc.message)
                self._acks[replica][:0] = batch

    async def _flush_forgets(self) -> None:
        for replica, rollout_ids in list(self._forgets.items()):
            if not rollout_ids:
                continue
            batch, self._forgets[replica] = rollout_ids[:BATCH_LIMIT], rollout_ids[BATCH_LIMIT:]
            clients = self._roster.participants(replica)
            results = await asyncio.gather(
                *(p.forget(batch) for p in clients), return_exceptions=True
            )
            if any(isinstance(r, BaseException) for r in results):
                # Forget is idempotent: send the whole batch again next time.
                self._forgets[replica][:0] = batch
            else:
                self.forgotten += len(batch)

    async def _retire_abandoned(self) -> None:
        by_replica: dict[str, list[EpisodeId]] = defaultdict(list)
        for record in self._ledger.abandoned():
            if record.replica is None or not self._roster.is_up(record.replica):
                # It never reached an agent, or the processes that ran it are gone: nothing
                # to stop anywhere.
                with contextlib.suppress(RollpointError):
                    self._ledger.retire(record.rollout_id)
                continue
            by_replica[record.replica].append(record.episode)
        for replica, episodes in by_replica.items():
            answer = await self.retire_now(replica, episodes)
            if answer is None or not answer.everywhere:
                continue  # retried at the next flush (retire is idempotent: marks only rise)
            for episode in episodes:
                self._ledger.retire(episode.rollout_id)
            finished = [
                e
                for e in episodes
                if answer.outcomes.get(e.key) is RetireOutcomeKind.FINISHED_UNACKED
            ]
            if finished:
                # Finished after the trainer gave up on it: its row went on under a new
                # rollout id, so this reply is never sealed. Release it, or it stays forever.
                self._acks[replica].extend(finished)
                self.acked_away += len(finished)

    def _forget_later(self, replica: str, rollout_ids: list[str]) -> None:
        deadline = time.monotonic() + RETIRE_GRACE_S
        self._retired_at.extend((deadline, replica, rid) for rid in rollout_ids)
