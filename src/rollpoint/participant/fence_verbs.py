"""What each control verb calls on a fence: one handler per row of the verb table.

Owns :func:`fence_handlers`, the map from a verb of
:data:`rollpoint.protocol.control_verbs.VERBS` to the :class:`~rollpoint.participant.fence.Fence`
call that serves it, taking the verb's parsed request (None for ``status``) and returning its
reply model. The HTTP routes (:mod:`rollpoint.participant.control_routes`) and the in-process
transport (:mod:`rollpoint.participant.in_process_control`) both call these, so the two faces
of a fence cannot drift apart. It reads no body and checks no token: its callers do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from rollpoint.participant.fence import Fence
from rollpoint.protocol.control import Verb

__all__ = ["VerbHandler", "fence_handlers"]

VerbHandler = Callable[[Any], Awaitable[BaseModel]]
"""Takes the verb's request model (None for a verb without a body), returns its reply."""


def fence_handlers(fence: Fence) -> dict[Verb, VerbHandler]:
    """The handler of every control verb on ``fence``, in verb order."""

    async def status(_: None) -> BaseModel:
        return fence.status()

    return {
        Verb.STATUS: status,
        Verb.PREPARE: fence.prepare,
        Verb.RENEW: fence.renew,
        Verb.COMMIT: fence.commit,
        Verb.CONFIRM: fence.confirm,
        Verb.RESUME: fence.resume,
        Verb.RESTORE: fence.restore,
        Verb.RETIRE: fence.retire,
        Verb.FORGET: fence.forget,
        Verb.ACK: fence.ack,
        Verb.CHECKPOINT: fence.checkpoint,
    }
