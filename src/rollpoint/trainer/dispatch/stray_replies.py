"""Stray replies: finished replies an agent holds that no current try will seal.

Prepare lists each agent's finished, unacked replies. Those of a row's current try are a
reply on the wire: they are exported with the cut and adopted later. Any other (a try the
trainer gave up on, one already sealed, one it never knew) is a stray: it is acked away on
its agent once the pause is over, so no reply stays stuck.

Owns telling the two apart against the ledger (:func:`is_wanted`) and releasing the strays
(:func:`ack_strays`). It does not decide when they are released (after every save, published
or not: :class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator`) nor seal or adopt the
wanted ones (the dispatcher does).
"""

from __future__ import annotations

import logging

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState

log = logging.getLogger(__name__)

REPLY_HOLDING_STATES = frozenset(
    {RolloutState.QUEUED, RolloutState.DISPATCHED, RolloutState.FINISHED}
)
"""States in which a row's current try still wants the reply its agent holds: dispatched
(on the wire), queued (pinned to fetch it again), finished (being sealed)."""


def is_wanted(ledger: RecoveryLedger, episode: EpisodeId) -> bool:
    """Whether a held finished reply belongs to its row's current try (adopt it) or to
    no try the trainer still waits on (ack it away)."""
    if episode.rollout_id not in ledger:
        return False
    record = ledger.get(episode.rollout_id)
    if record.attempt != episode.attempt or record.state not in REPLY_HOLDING_STATES:
        return False
    return ledger.current(record.group_id, record.row).rollout_id == record.rollout_id


async def ack_strays(strays: dict[ParticipantClient, list[EpisodeId]]) -> int:
    """Release finished replies nobody will seal; a failed ack is retried by the next
    prepare, which reports them again."""
    acked = 0
    for agent, episodes in strays.items():
        try:
            reply = await agent.ack(episodes)
        except RollpointError as exc:
            log.info("ack of %d stray replies on %s failed: %s", len(episodes), agent.label, exc)
            continue
        acked += len(reply.acked)
        log.debug(
            "acked away %d finished replies on %s that no current try wants: %s",
            len(reply.acked),
            agent.label,
            ", ".join(e.key for e in reply.acked[:5]),
        )
    return acked
