"""What a journal-mode checkpoint writes: the journal's position now and the floor it keeps.

Owns :func:`journal_write`, the :class:`~rollpoint.participant.checkpoint_write.CheckpointWrite`
of a ``checkpoint`` verb (``snapshot.mode: journal``): no episode record (a restore brings
every episode from its prompt through the journal), the participant's journal mark taken
now (the position the reply returns) and the coordinator's floor, checked against that
position, which its manifest saves so retention keeps every record a restore may read. A
participant that does not journal, or journals nothing now, is refused: it keeps the cut.
It does not decide whether the verb may run nor write anything (the fence,
:mod:`rollpoint.participant.fence`, and :mod:`rollpoint.participant.checkpoint_write`).
"""

from __future__ import annotations

from rollpoint.participant.checkpoint_write import CheckpointWrite
from rollpoint.participant.episode_scope import EpisodeScope
from rollpoint.participant.participant import JournalingParticipant, Participant, call_hook
from rollpoint.protocol.control import CheckpointRequest
from rollpoint.protocol.errors import BadRequestError, InvalidPhaseError
from rollpoint.protocol.manifest import JournalMark

__all__ = ["journal_write"]


def journal_write(
    participant: Participant, instance: str, req: CheckpointRequest, directory: str
) -> CheckpointWrite:
    """The write of ``req`` to ``directory`` (the participant's folder, ``instance`` its
    name in errors), its journal mark taken now."""
    cid = req.checkpoint_id
    if not isinstance(participant, JournalingParticipant):
        raise InvalidPhaseError(
            f"checkpoint {cid}: {instance} does not journal; it takes the cut (prepare and commit)"
        )
    position = call_hook("journal_mark", participant.journal_mark)
    if position is None:
        raise InvalidPhaseError(
            f"checkpoint {cid}: {instance} journals nothing now; it takes "
            "the cut (prepare and commit)"
        )
    floor = _checked_floor(cid, req.floor, position)
    return CheckpointWrite(
        cid,
        req.checkpoint_dir,
        directory,
        EpisodeScope([]),
        records=[],
        journal=floor,
        position=position,
    )


def _checked_floor(cid: str, floor: JournalMark | None, position: JournalMark) -> JournalMark:
    """The mark a journal checkpoint's manifest saves: ``floor``, or the journal's first
    segment (keep it whole) when the coordinator gave none; a floor in another folder or
    past ``position`` is a 400 naming it."""
    if floor is None:
        return JournalMark(folder=position.folder, segment=1, offset=0)
    if floor.folder != position.folder:
        raise BadRequestError(
            f"checkpoint {cid}: floor names journal {floor.folder!r}, not {position.folder!r}"
        )
    if (floor.segment, floor.offset) > (position.segment, position.offset):
        raise BadRequestError(
            f"checkpoint {cid}: floor {floor.segment}:{floor.offset} is past the journal's "
            f"position {position.segment}:{position.offset}"
        )
    return floor
