"""What a fence's phase means outside the fence: the participant's admission and the seam.

Owns :class:`FenceHold`: the participant's admission, closed when the fence's phase leaves
idle (counted, status ``counts.admission_closes``; opened again if closing fails) and
opened when it returns, and the checkpoint events the process's listeners on
:mod:`rollpoint.tuning.seam` hear with the fence as their source: that checkpoints are in
use there (its first status or lease, on its loop; a capturing participant is then told to
keep its saved form current), that a checkpoint holds it (the phase leaves idle), that the
hold ended (the phase is back to idle) and that it closed.

The fence holds no performance trick: the entry point that started the process installs
what listens (:func:`rollpoint.tuning.install`: the garbage collector paused through the
hold, full collections run right after it); with nothing installed the events cost a check
of an empty tuple. It does not decide when the phase moves (the fence,
:mod:`rollpoint.participant.fence`, which names itself as each event's source, so nothing
here refers back to it).
"""

from __future__ import annotations

import asyncio
import contextlib

from rollpoint.participant.participant import (
    CapturingParticipant,
    Participant,
    await_hook,
    call_hook,
    hook_error,
)
from rollpoint.protocol.errors import RollpointError
from rollpoint.tuning import seam

__all__ = ["FenceHold"]


class FenceHold:
    """The admission of one fence's participant, and the seam's events of that fence."""

    def __init__(self, participant: Participant) -> None:
        self._participant = participant
        self._closed = False
        self._admission_closes = 0
        """Times this fence closed admission (status ``counts.admission_closes``): what a
        journal-mode job shows never happens (issue 37)."""
        self._in_use = False
        """Checkpoints came into use (:meth:`first_use`): the seam heard it, and a
        capturing participant was told to keep its saved form current."""

    @property
    def admission_closes(self) -> int:
        return self._admission_closes

    @property
    def in_use(self) -> bool:
        return self._in_use

    async def close_admission(self) -> None:
        """The phase leaves idle: close admission, or reopen it and raise if that fails."""
        self._admission_closes += 1
        try:
            await self._participant.close_admission()
        except Exception as exc:
            with contextlib.suppress(Exception):
                await self._participant.open_admission()
            raise hook_error("close_admission", exc, RollpointError) from None

    def hold(self, source: object) -> None:
        """Admission is closed: a checkpoint holds ``source``."""
        # The pause starts (the lease bounds how long). The collector's listener pauses
        # the cyclic collector through it: the cut's own allocations (parsing the
        # scope, exporting) would otherwise trigger a full collection over every
        # session's heap (hundreds of ms at 5k sessions, measured).
        seam.hold(source)

    async def release(self, source: object) -> None:
        """The phase is back to idle: the hold of ``source`` ended; open admission."""
        seam.release(source)
        await await_hook("open_admission", self._participant.open_admission())

    def first_use(self, source: object) -> None:
        """A coordinator asked for the status (it discovers every participant so when a run
        starts), or a lease began: checkpoints are in use. Once, on the loop that serves
        the fence (an app factory may build it inside another): tell the seam, and tell a
        capturing participant to keep its saved form current. A closed fence does neither."""
        if self._closed or self._in_use:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._in_use = True
        seam.in_use(source)
        if isinstance(self._participant, CapturingParticipant):
            call_hook("keep_current", self._participant.keep_current)

    async def close(self, source: object) -> None:
        """The fence closed: no first use from now on; tell the seam."""
        self._closed = True
        await seam.closed(source)
