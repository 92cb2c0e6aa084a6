"""The cut: what one save captured, and what it reports.

Owns the data a save carries from the pause to the publish: what prepare found
(:class:`Prepared`: the participants that may have closed, the restarts and held replies
they reported, stray replies), what the commit captured (:class:`Cut`: the in-flight tries,
the ledger, the finished queue and trainer captures, each agent's commit reply), the sorting of each
in-flight try into saved, finished or restart (:meth:`Cut.classify`), and the
:class:`SaveReport` of one attempt: the :class:`SavePhase` it reached, in the order a save
goes through them, and, for a failed one, its :class:`Blocker` s (who, in which verb, with
which error code, and whether trying again can help).

It does not call participants, write files or publish (the
:class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator` does, through
:mod:`rollpoint.trainer.snapshot.cut_calls` and :mod:`rollpoint.trainer.snapshot.publication`),
nor encode the captures (:mod:`rollpoint.trainer.state.ledger_document`,
:mod:`rollpoint.trainer.state.finished_queue`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import RestartEpisode, SavedEpisode, SnapshotManifest
from rollpoint.store.staging import Staging
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.state.finished_queue import FinishedQueueCapture
from rollpoint.trainer.state.ledger_document import LedgerCapture
from rollpoint.trainer.state.ledger_record import LedgerRecord

log = logging.getLogger(__name__)


class SavePhase(StrEnum):
    """The phases of one save, in the order it goes through them."""

    DISCOVER = "discover"
    """Ask servers that came back who they are (status)."""
    RESUME_LEFTOVERS = "resume_leftovers"
    """Reopen what an earlier save's lost resume left closed."""
    PREPARE = "prepare"
    """Close admission everywhere, models first, and wait for every turn boundary."""
    COMMIT = "commit"
    """Capture the cut: trainer state and every participant's scope."""
    WRITE = "write"
    """After the reopen: the trainer's files, and every participant's confirmed write."""
    PUBLISH = "publish"
    """Seal and publish the manifest."""
    PUBLISHED = "published"


@dataclass(frozen=True, slots=True)
class Blocker:
    """One reason a save could not go on."""

    participant: str | None
    """The participant's label (``agent@replica-0``); None for the trainer's own part."""
    verb: str
    """What failed: a control verb (``prepare``, ``commit``, ``confirm``, ``resume``,
    ``status``) or the trainer's ``write`` or ``publish``."""
    code: str
    """The error code (:mod:`rollpoint.protocol.errors`), e.g. ``deadline_exceeded``."""
    retryable: bool
    """Whether the next save can get past it (a peer down, a deadline) or not."""
    message: str
    """One line saying all of it, the participant named first."""


@dataclass
class SaveReport:
    """What one save attempt did, published or not."""

    snapshot_id: str
    published: bool
    phase: SavePhase = SavePhase.DISCOVER
    """The phase the save reached: where it stopped when it failed."""
    blockers: list[Blocker] = field(default_factory=list)
    """Why it failed (empty when it was published)."""
    pause_s: float = 0.0
    prepare_s: float = 0.0
    commit_s: float = 0.0
    write_s: float = 0.0
    """After the reopen: until the trainer's files were written and every participant
    confirmed its write (participants that waited for their write inside the commit
    confirm at once)."""
    saved: int = 0
    mid_call: int = 0
    """Of ``saved``, those waiting on a policy call at the cut (held at the model gate, or
    their reply held unapplied); the others were parked at a turn boundary."""
    restarts: int = 0
    finished: int = 0
    journaled: int = 0
    """Tries in flight a journal-mode snapshot listed (no episode saved)."""
    acked_away: int = 0
    """Finished replies of tries nobody will seal, released on their agents."""
    manifest: SnapshotManifest | None = None
    not_taken: bool = False
    """True for a save asked after the run's final one: nothing was tried (the run is
    stopping; the final snapshot holds it), nothing counted as a failure."""

    @property
    def blocked_by(self) -> str:
        """The blockers as one line (empty when published)."""
        return "; ".join(b.message for b in self.blockers)


class SaveBlocked(Exception):
    """A phase of a save cannot go on; raised and caught inside the coordinator only."""

    def __init__(self, blockers: list[Blocker]) -> None:
        super().__init__("; ".join(b.message for b in blockers))
        self.blockers = blockers


@dataclass
class Prepared:
    """What prepare found: the participants that may have closed, and what they reported."""

    clients: list[ParticipantClient] = field(default_factory=list)
    restarts: set[str] = field(default_factory=set)
    finished_unacked: set[str] = field(default_factory=set)
    strays: dict[ParticipantClient, list[EpisodeId]] = field(default_factory=dict)
    """Per agent: finished replies of tries that are not a row's current try."""
    awaiting_model: int = 0
    """Sessions the agents reported waiting on a policy call once ready (the rest parked)."""


@dataclass
class Cut:
    """Everything captured while the barrier was closed, written after it reopens."""

    staging: Staging
    checkpoint_id: str
    created_at: float
    participants: list[ParticipantClient] = field(default_factory=list)
    """The participants that committed: the only ones the manifest names."""
    detached: list[ParticipantClient] = field(default_factory=list)
    """Those whose commit replied before the write: confirmed before the publish."""
    episodes: list[SavedEpisode] = field(default_factory=list)
    restarts: list[RestartEpisode] = field(default_factory=list)
    finished: list[RestartEpisode] = field(default_factory=list)
    journal_mode: bool = False
    """A pause-free save (``snapshot.mode: journal``): no participant saved any episode, so
    every try in flight is ``journaled`` (sent again under its own id on restore)."""
    journaled: list[RestartEpisode] = field(default_factory=list)
    ledger: LedgerCapture | None = None
    """Frozen references, O(live tries): encoded by
    :meth:`~rollpoint.trainer.snapshot.publication.Publication._write_trainer_files`."""
    finished_queue: FinishedQueueCapture | None = None
    trainer_doc: dict[str, Any] = field(default_factory=dict)
    in_flight: dict[str, list[LedgerRecord]] = field(default_factory=dict)
    """Per replica, the tries in flight at the cut (immutable records)."""
    agent_exported: dict[str, dict[str, int | None]] = field(default_factory=dict)
    """Per replica, what its agent exported (episode key → turns): from its commit reply,
    or from its confirm reply when the commit did not wait for the write."""

    def classify(self, prepared: Prepared) -> None:
        """Every in-flight episode is saved, finished (reply held) or a restart — exactly
        one; in a journal-mode save every one is journaled."""
        for replica, records in self.in_flight.items():
            exported = self.agent_exported.get(replica, {})
            for record in records:
                key = record.key
                base: dict[str, Any] = {
                    "rollout_id": record.rollout_id,
                    "attempt": record.attempt,
                    "replica": replica,
                    "group_id": record.group_id,
                    "row": record.row,
                }
                if self.journal_mode:
                    self.journaled.append(RestartEpisode(**base))
                elif key in exported:
                    turns = exported[key] or 0
                    self.episodes.append(SavedEpisode(**base, turns_completed=turns))
                elif key in prepared.finished_unacked:
                    self.finished.append(RestartEpisode(**base))
                else:
                    if key not in prepared.restarts:
                        # Dispatched, but its /run never reached the agent before the cut: it had
                        # not started, so starting over loses nothing.
                        log.info(
                            "snapshot %s: %s on %s had not started; it restarts",
                            self.checkpoint_id,
                            key,
                            replica,
                        )
                    self.restarts.append(RestartEpisode(**base))
