"""Wire models of the checkpoint control plane: every verb a participant serves.

Owns the request and reply shape of each control verb, the phase names, and the prepare
report. It does not own the phase machine (that is :mod:`rollpoint.participant.fence`) nor the
routes (:mod:`rollpoint.participant.control_routes`).

Every participant (model, agent, resources server) serves the same verbs under
:data:`CONTROL_PREFIX`, each guarded by a bearer token (401 ``unauthorized``). Deadlines
are absolute Unix seconds shared across machines. Every non-idle phase holds a lease of
``deadline_ts + grace``; when it lapses the participant reopens by itself, as if resumed.

Each verb: phases before → after; replay rule; refusals (409 unless noted).

- ``GET status``: any phase; read only.
- ``POST prepare(checkpoint_id, deadline_ts)``: idle|preparing → prepared when ready, else
  stays preparing at the deadline (admission closed: resume to abort). Replay while
  prepared returns the recorded reply. invalid_phase, checkpoint_conflict,
  stale_checkpoint, deadline_exceeded.
- ``POST renew(checkpoint_id, deadline_ts)``: any non-idle phase → same; extends the lease.
  invalid_phase (idle), checkpoint_conflict, stale_checkpoint, deadline_exceeded.
- ``POST commit(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids)``: prepared →
  committed. Exported once per id: the same dir + scope returns the same result, another
  dir or scope is checkpoint_conflict. invalid_phase (also when readiness regressed),
  stale_checkpoint, deadline_exceeded, 400 bad_request (path outside the root), 422
  invalid_checkpoint_state (a reported restart in the scope). With ``wait_for_write:
  false`` (feature ``detached-write``) it replies once the scope's state is captured in
  memory, with ``manifest: null``, and writes nothing yet: ``confirm`` does.
- ``POST confirm(checkpoint_id, deadline_ts)``: any phase → same; writes what a commit of
  that id captured (once; a write that failed is tried again) and returns its manifest.
  Sent after the resume, it keeps encoding and writing out of the pause. The last 8
  commits are kept, and a new commit drops an earlier capture nobody confirmed. 404
  not_found (no commit of that id here), deadline_exceeded (the write goes on; confirm
  again), or the write's own error (500 snapshot_failed, 422 invalid_checkpoint_state).
- ``POST resume(checkpoint_id)``: non-idle → idle. A remembered id (the last 64) replies
  ``idempotent: true``; in idle any id is remembered, so a late prepare is stale.
  checkpoint_conflict.
- ``POST restore(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids, sources?)``:
  idle → restored, all or nothing; ``sources`` names the replicas whose records to merge
  (default: its own). The saved attempts get retire marks (their next attempts continue,
  calls from the saved ones are refused as stale_attempt). Replay while restored with the
  same dir + sources + scope returns the recorded reply. invalid_phase,
  checkpoint_conflict, stale_checkpoint, deadline_exceeded, 400 (path), 422 (records
  missing, corrupt or of another checkpoint).
- ``POST retire(episode_ids)``: idle|restored → same; marks only rise. invalid_phase.
- ``POST forget(rollout_ids)``: idle|restored → same; forgetting twice is a no-op.
  invalid_phase.
- ``POST ack(episode_ids)``: any phase → same; acking twice is a no-op.
- ``POST checkpoint(checkpoint_id, deadline_ts, checkpoint_dir, floor?)``: idle → idle, a
  journal-mode snapshot (``snapshot.mode: journal``, docs/design.md "Pause-free
  snapshots"): admission stays open and nothing parks; the participant takes its journal
  mark (where its journal stands now) and writes a state holding no episode, whose
  manifest's journal mark is ``floor`` (the oldest position a restore from the snapshot
  may need, chosen by the coordinator; null: keep the whole journal). Replay with the same
  id and dir returns the recorded reply. invalid_phase (not idle, or a participant that
  does not journal: it takes the cut), stale_checkpoint, deadline_exceeded, 400 (path, or a
  floor in another folder or past the position now).

Every request is strict and a refused call changes nothing: the body is UTF-8 JSON sent
as ``application/json`` (415 ``unsupported_media_type`` otherwise; a body that is not JSON,
or is cut short, is a 400 saying so), validated in pydantic's strict mode (an unknown
field, a missing one, or a value of another JSON type, such as ``"1"`` for a number,
``true`` or ``1`` where the other is expected, ``1.0`` for an integer, is a 400
``bad_request`` naming the field; a JSON integer is a number, so it is a valid ``deadline_ts``). A ``deadline_ts``
more than the participant's horizon ahead of its clock (``max_deadline_ahead_s``, one hour
by default) is a 400 naming it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

from rollpoint.protocol.ids import CheckpointId, EpisodeId, EpisodeKey, Identifier
from rollpoint.protocol.manifest import JournalMark, ParticipantManifest
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind

CONTROL_PREFIX = "/rollpoint/v1/checkpoint"
PROTOCOL_VERSION = 1
MAX_REPORTED_BLOCKERS = 100
"""Blockers listed in a prepare report; ``blocker_count`` always carries the full count."""
DETACHED_WRITE = "detached-write"
"""The status feature of a participant whose commit can reply before its write ends."""
SCOPE_KEYS = "scope-keys"
"""The status feature of a participant that takes a commit's scope as ``episode_keys``."""
JOURNAL = "journal"
"""The status feature of a participant that journals its completed work (docs/journal.md):
its commits save the journal position the cut opened at."""
MAX_BATCH = 100_000
"""Most episodes or rollouts one retire, forget or ack request may name."""
MAX_CONTROL_BODY_BYTES = 64 * 1024 * 1024
"""The largest control request body a participant reads; a longer one is 413
``payload_too_large``, refused before it is read whole. The largest real bodies (a retire
of ``MAX_BATCH`` episode ids, a commit naming a replica's 100k in-flight episodes) are under
10 MiB; a body of hundreds of MiB was read whole before (issue 33)."""

DeadlineTs = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""Absolute Unix seconds (not a duration): the same instant on every machine."""


def _path_parts_fit(value: str) -> str:
    # File systems refuse names over 255 bytes; refuse them here, before anything moves.
    long = [part for part in value.split("/") if len(part.encode()) > 255]
    if long:
        raise ValueError(f"path part longer than 255 bytes: {long[0][:40]}…")
    return value


CheckpointDir = Annotated[
    str, StringConstraints(min_length=1, max_length=1024), AfterValidator(_path_parts_fit)
]
"""Relative to the participant's snapshot root; absolute paths and ``..`` are refused (400)."""


class Phase(StrEnum):
    IDLE = "idle"
    """Serving normally; admission open. The only phase without a lease."""
    PREPARING = "preparing"
    """Admission closed; waiting for every session to reach a turn boundary."""
    PREPARED = "prepared"
    """Ready: nothing moves until commit or resume."""
    COMMITTED = "committed"
    """The state of the scope is captured (and written, unless the commit did not wait
    for the write); waiting for resume."""
    RESTORED = "restored"
    """Saved state installed; restored episodes wait for their next attempt until resume."""


class Verb(StrEnum):
    """The control verbs; each is also the last segment of its route."""

    STATUS = "status"
    PREPARE = "prepare"
    RENEW = "renew"
    COMMIT = "commit"
    CONFIRM = "confirm"
    RESUME = "resume"
    RESTORE = "restore"
    RETIRE = "retire"
    FORGET = "forget"
    ACK = "ack"
    CHECKPOINT = "checkpoint"


class RetireOutcomeKind(StrEnum):
    CANCELLED = "cancelled"
    """The attempt was still running and has been stopped: the next try starts."""
    FINISHED_UNACKED = "finished_unacked"
    """The attempt had finished; its stored reply can be fetched and sealed (no rerun)."""
    UNKNOWN = "unknown"
    """This participant never saw the attempt (or already forgot it)."""


class RetireOutcome(StrictModel):
    episode: EpisodeId
    outcome: RetireOutcomeKind


class Readiness(StrictModel):
    """Whether a participant is at a cut, and what stands in the way: the prepare report."""

    ready: bool
    blockers: list[str] = Field(default_factory=list)
    """Episode keys not yet at a boundary (capped at :data:`MAX_REPORTED_BLOCKERS` on the wire)."""
    blocker_count: Annotated[int, Field(ge=0)] = 0
    """How many episodes block, in full."""
    restarts: list[EpisodeId] = Field(default_factory=list)
    """In-flight episodes this participant cannot capture: they start over and never block."""
    finished_unacked: list[EpisodeId] = Field(default_factory=list)
    """Finished episodes whose replies were not acknowledged yet (exported at commit)."""
    counts: dict[str, int] = Field(default_factory=dict)


# --- requests ---------------------------------------------------------------------------


class PrepareRequest(StrictModel):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs


class RenewRequest(StrictModel):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs


class CommitRequest(StrictModel):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs
    checkpoint_dir: CheckpointDir
    episode_ids: list[EpisodeId] = Field(default_factory=list)
    """The scope: in-flight episodes to save (never a reported restart). Order and
    duplicates do not matter: a retry naming the same set is the same commit."""
    episode_keys: list[EpisodeKey] = Field(default_factory=list)
    """More of the scope, as keys (``rollout#attempt``); the scope is both lists together.
    Only to a participant listing feature ``scope-keys``: inside the pause, 5,000 keys
    validate in ~0.4 ms and 5,000 nested ids in ~4 ms."""
    wait_for_write: bool = True
    """False: reply as soon as the scope's state is captured (``manifest`` is null) and
    write it only when ``confirm`` asks, after the resume, so the write stays out of the
    snapshot pause. Only to a participant listing feature ``detached-write``."""


class CheckpointRequest(StrictModel):
    """A journal-mode checkpoint: no admission close, no prepare (see ``checkpoint`` above)."""

    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs
    checkpoint_dir: CheckpointDir
    floor: JournalMark | None = None
    """The journal mark the written manifest saves: the oldest record a restore from this
    snapshot may read (every try the snapshot holds in flight was first seen after it).
    Null: keep the whole journal (segment 1), when the coordinator cannot bound it."""


class ConfirmRequest(StrictModel):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs


class ResumeRequest(StrictModel):
    checkpoint_id: CheckpointId


class RestoreRequest(StrictModel):
    checkpoint_id: CheckpointId
    """This restore's own id (what renew and resume name)."""
    deadline_ts: DeadlineTs
    checkpoint_dir: CheckpointDir
    episode_ids: list[EpisodeId]
    """The saved episodes to install (their saved attempts)."""
    source_checkpoint_id: CheckpointId | None = None
    """The checkpoint the records were committed under; defaults to ``checkpoint_id``.
    Give a fresh ``checkpoint_id`` when the participant may have taken part in that save:
    it remembers resumed ids and refuses them as stale."""
    sources: Annotated[list[Identifier], Field(min_length=1, max_length=1024)] | None = None
    """The replicas whose saved records to install (the folders ``<kind>/<name>-<source>``),
    merged by episode key, which is unique across replicas; defaults to this participant's
    own replica. A restore onto fewer replicas names several (elastic restore)."""


class RetireRequest(StrictModel):
    episode_ids: Annotated[list[EpisodeId], Field(min_length=1, max_length=MAX_BATCH)]
    """Each rollout's mark rises to the highest attempt named for it."""


class ForgetRequest(StrictModel):
    rollout_ids: Annotated[list[Identifier], Field(min_length=1, max_length=MAX_BATCH)]


class AckRequest(StrictModel):
    episode_ids: Annotated[list[EpisodeId], Field(min_length=1, max_length=MAX_BATCH)]


# --- replies ----------------------------------------------------------------------------


class StatusReply(StrictModel):
    kind: ParticipantKind
    name: Identifier
    replica: Identifier
    mode: CheckpointMode
    protocol_version: int
    features: list[str]
    """Additive capabilities; a topology fingerprint ignores them."""
    phase: Phase
    checkpoint_id: CheckpointId | None
    lease_expires_at: float | None
    """Absolute Unix seconds; None in idle."""
    counts: dict[str, int]
    retired_rollouts: int
    """Rollouts holding a retire mark (retired and not yet forgotten)."""
    portable: bool = True
    """Whether its saved state may be installed on another replica (an elastic restore
    onto a different replica count); a participant that cannot move says false."""
    control_port: int | None = Field(default=None, ge=1, le=65535)
    """The port of a second listener serving these control routes on a loop of their own
    (same host as the server's URL), so data-plane load cannot delay them; None: only at
    the server's URL. A coordinator sends its calls there once it has read it, if it
    reached the server directly (``server_port`` is the port of its URL)."""
    server_port: int | None = Field(default=None, ge=0, le=65535)
    """The local port this status was served on, as the server's socket says. A client
    whose URL names another port reaches the server through a proxy (a fault proxy, a
    gateway) and keeps using its URL, so the proxy stays in the path of every call."""
    data_loop_quiet_ms: int | None = Field(default=None, ge=0)
    """Served by the control listener: how long the server's data loop has not run its
    heartbeat (a loop blocked by a hung tool or verifier stops it), in milliseconds; None
    when the status was served on the data loop itself (which is then running). A status
    answered off the data loop says nothing else about it: the stuck watchdog reads this."""


class PrepareReply(StrictModel):
    phase: Phase
    """``prepared`` when ready; ``preparing`` when the deadline passed first (admission
    stays closed: resume to abort)."""
    checkpoint_id: CheckpointId
    report: Readiness
    lease_expires_at: float


class RenewReply(StrictModel):
    phase: Phase
    checkpoint_id: CheckpointId
    lease_expires_at: float


class CommitReply(StrictModel):
    phase: Phase
    checkpoint_id: CheckpointId
    checkpoint_dir: str
    """As the request named it, relative to the snapshot root."""
    state_dir: str
    """This participant's folder relative to ``checkpoint_dir``: ``<kind>/<name>-<replica>``."""
    scope_size: int
    """How many distinct episodes the scope named (the scope is not echoed: at 10k
    episodes, parsing it back cost the trainer tens of ms inside the pause)."""
    manifest: ParticipantManifest | None
    """The written state's manifest; null from a commit that did not wait for the write."""
    exported: dict[EpisodeKey, int | None] | None = Field(default_factory=dict)
    """Episode key (``rollout#attempt``) → policy turns completed at the cut (a record's
    top-level ``turn``; null when the participant does not know), for each episode of the
    scope this participant holds state for (records carrying a top-level ``episode``). A
    scoped episode missing here was not live on this participant. Null from a commit that
    did not wait for the write: ``confirm`` returns it with the manifest (scanning every
    record cost the pause a few ms per participant at 5k episodes)."""


class ConfirmReply(StrictModel):
    checkpoint_id: CheckpointId
    manifest: ParticipantManifest
    """The state the commit captured, written and named by its digest."""
    exported: dict[EpisodeKey, int | None] = Field(default_factory=dict)
    """As :attr:`CommitReply.exported`, for the commit that did not wait for the write."""


class CheckpointReply(StrictModel):
    checkpoint_id: CheckpointId
    position: JournalMark
    """Where the participant's journal stood as it checkpointed (its end of last durable
    record): a later snapshot may name it as its floor."""
    manifest: ParticipantManifest
    """The written state (no episode records), its journal mark the request's floor."""


class ResumeReply(StrictModel):
    phase: Phase
    """``idle`` after a resume that reopened; for an idempotent one, the current phase
    (another checkpoint may have started since the named one ended)."""
    checkpoint_id: CheckpointId
    idempotent: bool
    """True when there was nothing to reopen (already resumed, or idle)."""


class RestoreReply(StrictModel):
    phase: Phase
    checkpoint_id: CheckpointId
    source_checkpoint_id: CheckpointId
    restored: list[EpisodeId]
    """The next attempts made ready (``attempt + 1`` of each installed episode)."""


class RetireReply(StrictModel):
    marks: dict[str, int]
    """rollout_id → highest retired attempt, after this call."""
    outcomes: list[RetireOutcome]


class ForgetReply(StrictModel):
    forgotten: list[str]


class AckReply(StrictModel):
    acked: list[EpisodeId]
