"""What the session book and the function that plays a session agree on.

Owns :data:`PlayFn` (plays one session to its end), the :class:`TurnBoundary` the book
hands it (park between turns, hold a policy reply while a checkpoint is cut; the
:class:`Boundary` protocol is its plain call), and :func:`row_failure`, the failure line a
row gets when playing it raises or admission refuses it. Kept apart from
:mod:`rollpoint.servers.agent.session_book` so the episode runner, which plays, needs none
of the book.

Does not own: the boundaries themselves (the book's gate) or how an episode is played
(:mod:`rollpoint.servers.agent.episode_runner`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from rollpoint.protocol.episode import RowFailure, RunReply, RunRow
from rollpoint.protocol.errors import RollpointError, TransportError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.agent.session import Session

if TYPE_CHECKING:
    from rollpoint.servers.agent.session_book import SessionBook

__all__ = ["Boundary", "PlayFn", "TurnBoundary", "row_failure"]


class Boundary(Protocol):
    """What a play function awaits at each turn boundary (``boundary(session)``)."""

    async def __call__(self, session: Session) -> None: ...


class TurnBoundary:
    """The book's boundaries as a play function sees them: park between turns, and hold a
    policy reply that arrives while a checkpoint is cut.

    Holding the reply is what lets the model server's prepare skip waiting for running
    policy calls (the generation cut): the session stays ``awaiting_model`` with the reply
    unapplied, so a checkpoint saves it as *before* that call; after the resume the reply
    is applied, after a restore the call is made again by the next attempt.
    """

    __slots__ = ("_book",)

    def __init__(self, book: SessionBook) -> None:
        self._book = book

    async def __call__(self, session: Session) -> None:
        await self._book.boundary(session)

    async def hold_reply(self, session: Session) -> None:
        await self._book.hold_reply(session)


PlayFn = Callable[[Session, TurnBoundary], Awaitable[RunReply]]
"""Plays a session to its end, awaiting ``boundary(session)`` at every turn boundary and
``boundary.hold_reply(session)`` when a policy reply arrives, before applying it."""


def row_failure(row: RunRow, err: BaseException, episode: EpisodeId | None = None) -> RowFailure:
    """The failure line of a row (of ``episode``, if not the row's own), its code the
    error's own, from the one tree; transport failures (retryable errors) are worth a fresh
    re-send."""
    if not isinstance(err, RollpointError):
        # Not raised on purpose: a bug, reported under the tree's code for that (internal).
        err = RollpointError(f"{type(err).__name__}: {err}")
    return RowFailure(
        episode=row.episode if episode is None else episode,
        group_id=row.group_id,
        row=row.row,
        code=err.code,
        message=err.message,
        transport=isinstance(err, TransportError) or err.retryable,
    )
