"""The checkpoint ids a fence is done with: :class:`ResumedIds`, the last few resumed.

Owns the fence's memory of ended checkpoints: the ids resumed or lease-lapsed here, newest
last, at most :data:`REMEMBERED_RESUMED_IDS` (the oldest is forgotten). A later call naming
one comes from a stale coordinator and is refused (:meth:`ResumedIds.check`); a resume
naming one again replies idempotently. It does not decide when a checkpoint ends nor which
verbs name an id (the fence: :mod:`rollpoint.participant.fence`).
"""

from __future__ import annotations

from collections import OrderedDict

from rollpoint.protocol.control import Verb
from rollpoint.protocol.errors import StaleCheckpointError

__all__ = ["REMEMBERED_RESUMED_IDS", "ResumedIds"]

REMEMBERED_RESUMED_IDS = 64


class ResumedIds:
    """The last :data:`REMEMBERED_RESUMED_IDS` checkpoint ids resumed, oldest first."""

    __slots__ = ("_resumed",)

    def __init__(self) -> None:
        self._resumed: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._resumed

    def check(self, verb: Verb, checkpoint_id: str) -> None:
        """Refuse ``verb`` naming a resumed id with :class:`StaleCheckpointError`."""
        if checkpoint_id in self._resumed:
            raise StaleCheckpointError(
                f"checkpoint {checkpoint_id} was already resumed; "
                f"this {verb} comes from a stale coordinator"
            )

    def remember(self, checkpoint_id: str) -> None:
        self._resumed[checkpoint_id] = None
        self._resumed.move_to_end(checkpoint_id)
        while len(self._resumed) > REMEMBERED_RESUMED_IDS:
            self._resumed.popitem(last=False)
