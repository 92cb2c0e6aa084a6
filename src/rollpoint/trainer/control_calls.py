"""Control calls: how the snapshot coordinator calls many participants at once.

Owns the stage order of prepare and resume (:data:`PREPARE_STAGES`), running one verb on
many participants against a shared deadline so none holds the pause
(:func:`by_deadline`), and the one line that names a participant whose call failed
(:func:`failure_line`).

It does not own the calls themselves (:class:`~rollpoint.trainer.participant_client.ParticipantClient`)
nor what a failed call does to a save (:mod:`rollpoint.trainer.coordinator`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.participant_client import ParticipantClient

R = TypeVar("R")

PREPARE_STAGES = (ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES)
"""Callers' callees close first; resume runs in the reverse order."""

# A participant answers at its deadline at the latest; this covers the network and scheduling.
_DEADLINE_SLACK_S = 0.5


async def by_deadline(
    calls: list[Coroutine[Any, Any, R]], deadline: float
) -> list[R | BaseException]:
    """Run the calls together; one that has not answered by the shared deadline (plus a
    little slack) is cancelled and counts as failed, so no participant holds the pause."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.time()) + _DEADLINE_SLACK_S)
    except BaseException:
        # Cancelled with the save: take the calls down too, and collect their outcomes.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    results: list[R | BaseException] = []
    for task in tasks:
        if not task.done():
            task.cancel()
            results.append(TimeoutError("no reply by the deadline"))
        elif task.cancelled():
            results.append(TimeoutError("cancelled"))
        elif (error := task.exception()) is not None:
            results.append(error)
        else:
            results.append(task.result())
    await asyncio.gather(*tasks, return_exceptions=True)
    return results


def failure_line(client: ParticipantClient, verb: str, error: BaseException) -> str:
    """One line naming the participant and what went wrong, without repeating the label."""
    if isinstance(error, RollpointError):
        text = error.message
        return text if text.startswith(client.label) else f"{client.label} {verb}: {text}"
    if isinstance(error, TimeoutError):
        return f"{client.label} {verb}: {error or 'no reply by the deadline'}"
    return f"{client.label} {verb}: {type(error).__name__}: {error}"
