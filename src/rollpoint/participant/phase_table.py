"""The participant's phase machine as data: every legal (phase, step) → phase, in one table.

Owns the steps the fence takes by itself (:class:`Event`), the transition table
(:data:`TRANSITIONS`) and :func:`next_phase`, the one function that applies it and names the
phases where a refused step would have been valid. It does not act on a transition (the
fence does: :mod:`rollpoint.participant.fence`).
"""

from __future__ import annotations

from enum import StrEnum

from rollpoint.protocol.control import Phase, Verb
from rollpoint.protocol.errors import InvalidPhaseError

__all__ = ["TRANSITIONS", "Event", "Step", "next_phase"]


class Event(StrEnum):
    """Transitions no verb names: the fence makes them itself."""

    READY = "ready"
    """Every session reached a boundary while preparing."""
    LEASE_EXPIRED = "lease_expired"
    """Nobody renewed or resumed in time: reopen as if resumed."""
    FAILED = "failed"
    """A hook failed while preparing or restoring: reopen; the id may be tried again."""


Step = Verb | Event

_HELD = (Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED)

TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (Phase.IDLE, Verb.PREPARE): Phase.PREPARING,
    (Phase.PREPARING, Verb.PREPARE): Phase.PREPARING,
    (Phase.PREPARED, Verb.PREPARE): Phase.PREPARED,
    (Phase.PREPARING, Event.READY): Phase.PREPARED,
    (Phase.PREPARED, Verb.COMMIT): Phase.COMMITTED,
    (Phase.COMMITTED, Verb.COMMIT): Phase.COMMITTED,
    (Phase.IDLE, Verb.RESTORE): Phase.RESTORED,
    (Phase.RESTORED, Verb.RESTORE): Phase.RESTORED,
    (Phase.IDLE, Verb.RESUME): Phase.IDLE,
    (Phase.PREPARING, Event.FAILED): Phase.IDLE,
    (Phase.RESTORED, Event.FAILED): Phase.IDLE,
    # Retiring stops episodes, whose last calls would wait on a closed gate: only
    # while admission is open (idle) or before restored episodes started (restored).
    (Phase.IDLE, Verb.RETIRE): Phase.IDLE,
    (Phase.RESTORED, Verb.RETIRE): Phase.RESTORED,
    (Phase.IDLE, Verb.FORGET): Phase.IDLE,
    # A journal-mode checkpoint moves nothing: admission stays open (issue 37).
    (Phase.IDLE, Verb.CHECKPOINT): Phase.IDLE,
    (Phase.RESTORED, Verb.FORGET): Phase.RESTORED,
    **{(phase, Verb.RESUME): Phase.IDLE for phase in _HELD},
    **{(phase, Event.LEASE_EXPIRED): Phase.IDLE for phase in _HELD},
    **{(phase, Verb.RENEW): phase for phase in _HELD},
    **{(phase, Verb.ACK): phase for phase in Phase},
    # A detached write outlives its checkpoint's resume: confirm works in every phase.
    **{(phase, Verb.CONFIRM): phase for phase in Phase},
}


def next_phase(phase: Phase, step: Step) -> Phase:
    """The phase ``step`` leads to from ``phase``; :class:`InvalidPhaseError` if illegal."""
    after = TRANSITIONS.get((phase, step))
    if after is None:
        valid = sorted(p.value for (p, s) in TRANSITIONS if s == step)
        legal_in_idle = (Phase.IDLE, step) in TRANSITIONS
        hint = "; resume first" if legal_in_idle and phase is not Phase.IDLE else ""
        raise InvalidPhaseError(
            f"{step} is not valid in phase {phase} (valid in: {', '.join(valid)}){hint}"
        )
    return after
