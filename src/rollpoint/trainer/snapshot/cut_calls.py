"""The cut's calls: what a cut asks of every participant while the barrier is closed.

Owns steps 2 and 4 of the save order (docs/design.md#the-save-order): prepare in stages
(model servers, then agents, then resources) against one shared deadline, noting what each
participant reported (restarts, replies it holds, stray replies) and, when asked, waiting
once the model servers' gates are closed for the policy calls already running; the renewal
of every prepared participant's lease while the save runs; and the commit: the trainer's
capture (the in-flight tries, the ledger, the finished queue and its counters in one
instant), then every participant committed in parallel, each replica's scope being the
ledger's in-flight episodes on it minus the restarts its participants reported.

It does not close the barrier, resume anyone or decide what a blocked call does to the save
(:class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator`), nor write or
publish (:mod:`rollpoint.trainer.snapshot.publication`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rollpoint.protocol.control import DETACHED_WRITE, SCOPE_KEYS, CommitReply, Phase, Verb
from rollpoint.protocol.errors import DeadlineExceededError, RollpointError, SnapshotError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.staging import Staging
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.dispatch.stray_replies import is_wanted
from rollpoint.trainer.snapshot.control_calls import PREPARE_STAGES, blocker, by_deadline
from rollpoint.trainer.snapshot.cut import Blocker, Cut, Prepared, SaveBlocked
from rollpoint.trainer.snapshot.participant_statuses import ParticipantStatuses
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger

__all__ = ["CutCalls"]

log = logging.getLogger(__name__)


class CutCalls:
    """The prepare, the lease renewal and the commit of one coordinator's cuts."""

    def __init__(
        self,
        *,
        ledger: RecoveryLedger,
        finished_queue: FinishedQueue,
        trainer_state: Callable[[], dict[str, Any]],
        statuses: ParticipantStatuses,
    ) -> None:
        self._ledger = ledger
        self._finished_queue = finished_queue
        self._trainer_state = trainer_state
        self._statuses = statuses

    async def prepare_all(
        self,
        clients: list[ParticipantClient],
        checkpoint_id: str,
        deadline: float,
        prepared: Prepared,
        *,
        drain_until: float = 0.0,
    ) -> None:
        for stage in PREPARE_STAGES:
            stage_clients = [p for p in clients if p.address.kind == stage]
            # Record the clients before awaiting: one whose reply is lost may still have closed.
            prepared.clients.extend(stage_clients)
            replies = await by_deadline(
                [p.prepare(checkpoint_id, deadline) for p in stage_clients], deadline
            )
            blocked: list[Blocker] = []
            for client, reply in zip(stage_clients, replies, strict=True):
                if isinstance(reply, BaseException):
                    blocked.append(blocker(client.label, Verb.PREPARE, reply))
                    continue
                # Whatever else happens to this save, a stray reply is released after it.
                strays = [
                    e for e in reply.report.finished_unacked if not is_wanted(self._ledger, e)
                ]
                if strays:
                    prepared.strays[client] = strays
                if reply.phase != Phase.PREPARED:
                    r = reply.report
                    blocked.append(
                        Blocker(
                            client.label,
                            Verb.PREPARE,
                            DeadlineExceededError.code,
                            True,
                            f"{client.label} not ready by the deadline: {r.blocker_count} "
                            f"blocker(s) {', '.join(r.blockers[:5])}"
                            f"{'…' if r.blocker_count > 5 else ''}",
                        )
                    )
                else:
                    prepared.restarts.update(e.key for e in reply.report.restarts)
                    if stage == ParticipantKind.AGENT:
                        prepared.awaiting_model += reply.report.counts.get("awaiting_model", 0)
                    prepared.finished_unacked.update(e.key for e in reply.report.finished_unacked)
            if blocked:
                raise SaveBlocked(blocked)
            if stage == ParticipantKind.MODEL and drain_until > time.time():
                await _drain(stage_clients, min(drain_until, deadline))

    async def commit_all(
        self,
        clients: list[ParticipantClient],
        staging: Staging,
        checkpoint_id: str,
        prepared: Prepared,
        deadline_s: float,
    ) -> Cut:
        cut = Cut(
            staging=staging,
            checkpoint_id=checkpoint_id,
            created_at=time.time(),
            participants=clients,
        )
        replicas = list(dict.fromkeys(c.address.replica for c in clients))
        # The cut is this instant: the in-flight set, ledger, the finished queue and counters together. A
        # reply that reaches the trainer during the commit is sealed after the cut; its
        # agent still holds it (acks wait for the barrier), so it is exported as finished.
        in_flight = {replica: self._ledger.in_flight(replica) for replica in replicas}
        elsewhere = [r.describe() for r in self._ledger.in_flight() if r.replica not in in_flight]
        if elsewhere:
            message = (
                "episodes in flight on replicas taking no part in the cut: "
                f"{', '.join(elsewhere[:10])}"
            )
            raise SaveBlocked([Blocker(None, Verb.COMMIT, SnapshotError.code, True, message)])
        cut.ledger = self._ledger.capture()
        cut.finished_queue = self._finished_queue.capture()
        cut.trainer_doc = self._trainer_state()
        scopes = {
            replica: [r.episode for r in records if r.key not in prepared.restarts]
            for replica, records in in_flight.items()
        }
        cut.detached = [c for c in clients if DETACHED_WRITE in self._statuses[c].features]
        deadline = time.time() + deadline_s
        replies = await by_deadline(
            [
                p.commit(
                    checkpoint_id,
                    deadline,
                    staging.participants_relative_dir,
                    scopes[p.address.replica],
                    wait_for_write=p not in cut.detached,
                    scope_as_keys=SCOPE_KEYS in self._statuses[p].features,
                )
                for p in clients
            ],
            deadline,
        )
        failed = [
            blocker(client.label, Verb.COMMIT, reply)
            for client, reply in zip(clients, replies, strict=True)
            if isinstance(reply, BaseException)
        ]
        if failed:
            raise SaveBlocked(failed)
        cut.in_flight = in_flight
        for client, reply in zip(clients, replies, strict=True):
            # A commit that did not wait for the write reports it with its confirm.
            is_agent = client.address.kind == ParticipantKind.AGENT
            if is_agent and isinstance(reply, CommitReply) and reply.exported is not None:
                cut.agent_exported[client.address.replica] = reply.exported
        return cut

    async def renew_leases(
        self, checkpoint_id: str, prepared: list[ParticipantClient], deadline_s: float
    ) -> None:
        """Keep every prepared participant's lease alive while the save runs."""
        interval = max(0.2, deadline_s / 3)
        while True:
            await asyncio.sleep(interval)
            deadline = time.time() + deadline_s
            targets = list(prepared)
            results = await asyncio.gather(
                *(p.renew(checkpoint_id, deadline) for p in targets), return_exceptions=True
            )
            for client, result in zip(targets, results, strict=True):
                if isinstance(result, RollpointError):
                    log.debug("renew on %s: %s", client.label, result.message)


_DRAIN_POLL_S = 0.05


async def _drain(models: list[ParticipantClient], until: float) -> None:
    """Wait until no model server of ``models`` runs a call (their gates are closed, so the
    count only falls), or until ``until``; a status that fails just ends the wait."""
    while time.time() < until:
        try:
            statuses = await asyncio.gather(*(m.status() for m in models))
        except RollpointError:
            return
        running = sum(s.counts.get("in_flight", 0) for s in statuses)
        if not running:
            return
        await asyncio.sleep(_DRAIN_POLL_S)
