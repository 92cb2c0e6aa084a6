"""What the trainer tells the environment it no longer needs: acks, retires and forgets.

Owns three batched, idempotent flows, flushed together every ``interval_s``:

- **ack**: a sealed rollout's reply is released by its agent (it keeps every finished
  reply until then, so a reply lost on the wire is never lost for good);
- **retire**: a try the dispatcher gave up on (abandoned in the ledger) gets a retire mark
  on every participant of its replica, so its running work stops and its late calls are
  refused; then the ledger retires it;
- **forget**: once a rollout is sealed (or retired a while ago), every participant of its
  replica drops what it keeps about it (call ledger, tool state, marks): memory stays
  bounded by what is in flight, not by the run's length.

A participant busy with a checkpoint refuses forget and retire (409): the batch stays queued
and goes out at the next flush. Nothing here blocks the data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.ledger import RecoveryLedger
from rollpoint.trainer.participant_client import ParticipantClient

log = logging.getLogger(__name__)

# A retired rollout keeps its mark this long before it is forgotten: long enough for any
# call of the old try still on the wire to arrive and be refused.
RETIRE_GRACE_S = 10.0
BATCH_LIMIT = 10_000


class ReleaseBatcher:
    def __init__(
        self,
        participants: list[ParticipantClient],
        ledger: RecoveryLedger,
        *,
        interval_s: float = 0.25,
    ) -> None:
        self._by_replica: dict[str, list[ParticipantClient]] = defaultdict(list)
        for p in participants:
            self._by_replica[p.address.replica].append(p)
        self._ledger = ledger
        self._interval_s = interval_s
        self._acks: dict[str, list[EpisodeId]] = defaultdict(list)
        self._forgets: dict[str, list[str]] = defaultdict(list)
        self._retired_at: list[tuple[float, str, str]] = []
        self.acked = 0
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
        await self._retire_abandoned()
        await self._flush_acks()
        now = time.monotonic()
        while self._retired_at and self._retired_at[0][0] <= now:
            _, replica, rollout_id = self._retired_at.pop(0)
            self._forgets[replica].append(rollout_id)
        await self._flush_forgets()

    async def _flush_acks(self) -> None:
        for replica, episodes in list(self._acks.items()):
            if not episodes:
                continue
            batch, self._acks[replica] = episodes[:BATCH_LIMIT], episodes[BATCH_LIMIT:]
            agents = [
                p
                for p in self._by_replica.get(replica, [])
                if p.address.kind == ParticipantKind.AGENT
            ]
            for agent in agents:
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
            clients = self._by_replica.get(replica, [])
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
            if record.replica is None:
                # It never reached an agent: nothing to stop anywhere.
                with contextlib.suppress(RollpointError):
                    self._ledger.retire(record.rollout_id)
                continue
            by_replica[record.replica].append(
                EpisodeId(rollout_id=record.rollout_id, attempt=record.attempt)
            )
        for replica, episodes in by_replica.items():
            clients = self._by_replica.get(replica, [])
            results = await asyncio.gather(
                *(p.retire(episodes) for p in clients), return_exceptions=True
            )
            if any(isinstance(r, BaseException) for r in results):
                continue  # retried at the next flush (retire is idempotent: marks only rise)
            deadline = time.monotonic() + RETIRE_GRACE_S
            for episode in episodes:
                self._ledger.retire(episode.rollout_id)
                self._retired_at.append((deadline, replica, episode.rollout_id))
            self.retired += len(episodes)
