"""What the fence makes of a participant's readiness report, in prepare and in commit.

Owns :func:`wire_report`, the copy of a report a prepare reply carries (its blockers cut to
:data:`~rollpoint.protocol.control.MAX_REPORTED_BLOCKERS`, counted in full), and
:func:`check_ready_for`, commit's check that the participant is still at the cut and that
the scope it is asked to capture names no episode reported as a restart. It does not ask
the participant (the fence calls its ``readiness`` hook: :mod:`rollpoint.participant.fence`)
nor decide what blocks (the participant does).
"""

from __future__ import annotations

from rollpoint.participant.episode_scope import EpisodeScope
from rollpoint.protocol.control import MAX_REPORTED_BLOCKERS, PrepareReply, Readiness
from rollpoint.protocol.errors import InvalidCheckpointStateError, InvalidPhaseError

__all__ = ["check_ready_for", "wire_report"]


def wire_report(report: Readiness) -> Readiness:
    return report.model_copy(
        update={
            "blockers": report.blockers[:MAX_REPORTED_BLOCKERS],
            "blocker_count": max(report.blocker_count, len(report.blockers)),
        }
    )


def check_ready_for(
    cid: str, report: Readiness, prepared: PrepareReply | None, scope: EpisodeScope
) -> None:
    """Refuse commit ``cid`` of ``scope`` unless ``report`` (the participant's, now) is
    ready and no episode of the scope was reported as a restart, now or in the
    ``prepared`` reply."""
    if not report.ready:
        shown = ", ".join(report.blockers[:10])
        raise InvalidPhaseError(
            f"commit {cid}: participant is no longer ready to commit: "
            f"{max(report.blocker_count, len(report.blockers))} blocker(s): {shown}; "
            "resume and prepare again"
        )
    reported = list(report.restarts)
    if prepared is not None:
        reported.extend(prepared.report.restarts)
    # Restarts are few (usually none): key the scope only when there are some.
    restarts = {e.key for e in reported}
    restarts = restarts & scope.key_set if restarts else set()
    if restarts:
        raise InvalidCheckpointStateError(
            f"commit {cid}: the scope names episodes reported as restarts (they cannot "
            f"be captured): {', '.join(sorted(restarts))}"
        )
