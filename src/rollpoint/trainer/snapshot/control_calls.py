"""Control calls: how the snapshot coordinator calls many participants at once.

Owns the stage order of prepare and resume (:data:`PREPARE_STAGES`), running one verb on
many participants against a shared deadline so none holds the pause
(:func:`by_deadline`), and what names a participant whose call failed: the typed
:class:`~rollpoint.trainer.snapshot.cut.Blocker` (:func:`blocker`) and its one line
(:func:`failure_line`).

It does not own the calls themselves (:class:`~rollpoint.trainer.control.participant_client.ParticipantClient`)
nor what a failed call does to a save (:mod:`rollpoint.trainer.snapshot.coordinator`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from rollpoint.protocol.errors import DeadlineExceededError, RollpointError, StorageError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.snapshot.cut import Blocker

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
    return blocker(client.label, verb, error).message


def blocker(participant: str | None, verb: str, error: BaseException) -> Blocker:
    """What failed, typed: the error's code and whether retrying can help. A call with no
    reply by the deadline is ``deadline_exceeded`` (retryable); an error outside the tree
    is ``internal`` (a bug: not retryable)."""
    who = participant or "trainer"
    if isinstance(error, RollpointError):
        text = error.message
        message = text if text.startswith(who) else f"{who} {verb}: {text}"
        return Blocker(participant, verb, error.code, error.retryable, message)
    if isinstance(error, TimeoutError):
        message = f"{who} {verb}: {error or 'no reply by the deadline'}"
        return Blocker(participant, verb, DeadlineExceededError.code, True, message)
    if isinstance(error, OSError):
        message = f"{who} {verb}: {error}"
        return Blocker(participant, verb, StorageError.code, StorageError.retryable, message)
    message = f"{who} {verb}: {type(error).__name__}: {error}"
    return Blocker(participant, verb, "internal", False, message)
