"""What a restore finds in the servers' journals, for the job's restore line and event.

Owns the job's questions to journaling servers after a restore: how many turns and
finished replies each agent's journal holds past the restored snapshot
(:func:`journal_pending`), how long each journaling server took to read its journal back
(:func:`journal_read_back`), and pinning each restored queued row to the replica whose
journal holds its turns (:func:`pin_to_journals`: only there can it go on from them).
"""

from __future__ import annotations

import asyncio
import logging

from rollpoint.http.client import HttpClient
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState

log = logging.getLogger(__name__)


async def journal_pending(
    participants: list[ParticipantClient],
) -> tuple[dict[str, int], dict[str, int]] | None:
    """(turns, finished replies) each agent's journal holds past the restored snapshot, to
    be resumed or adopted as their rows come, by journal (``agent/<name>-<replica>``, as
    ``inspect`` and ``report`` name it); None: no agent journals."""
    agents = [p for p in participants if p.address.kind is ParticipantKind.AGENT]
    replies = await asyncio.gather(*(p.status() for p in agents), return_exceptions=True)
    statuses = [
        r for r in replies if not isinstance(r, BaseException) and "journal_turns" in r.counts
    ]
    if not statuses:
        return None
    turns = {f"{r.kind}/{r.name}-{r.replica}": r.counts["journal_turns"] for r in statuses}
    finished = {
        f"{r.kind}/{r.name}-{r.replica}": r.counts.get("journal_replies", 0) for r in statuses
    }
    return turns, finished


async def journal_read_back(participants: list[ParticipantClient]) -> dict[str, int] | None:
    """How long each journaling server took to read its journal back when it started, by
    journal (``<kind>/<name>-<replica>``); None when none journals."""
    replies = await asyncio.gather(*(p.status() for p in participants), return_exceptions=True)
    found = {
        f"{r.kind}/{r.name}-{r.replica}": r.counts["journal_read_ms"]
        for r in replies
        if not isinstance(r, BaseException) and "journal_read_ms" in r.counts
    }
    return found or None


async def pin_to_journals(ledger: RecoveryLedger, deployment: Deployment, http: HttpClient) -> int:
    """Pin each row the restored ledger holds queued (it will be sent again under its own
    rollout id) to the replica whose agent journaled its turns: only there do the servers'
    journals let it go on from its last journaled turn. Returns how many were pinned."""
    replies = await asyncio.gather(
        *(
            http.get_json(f"{r.agent_url}/rollpoint/v1/journal", timeout_s=30)
            for r in deployment.replicas
        ),
        return_exceptions=True,
    )
    pinned = 0
    for replica, reply in zip(deployment.replicas, replies, strict=True):
        if isinstance(reply, BaseException) or not isinstance(reply, dict):
            log.warning("%s: its agent's journal could not be read: %s", replica.name, reply)
            continue
        for rollout_id in reply.get("rollouts", []):
            if rollout_id not in ledger:
                continue
            record = ledger.get(rollout_id)
            if record.state is RolloutState.QUEUED and record.replica is None:
                ledger.pin(rollout_id, replica.name)
                pinned += 1
    return pinned
