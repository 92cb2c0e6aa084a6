"""The checkpoint fence: one participant's phase machine, lease, replays and retire marks.

Owns everything a control verb does to a participant apart from the participant's own
state: which verb is legal in which phase (the transition table of
:mod:`rollpoint.participant.phase_table`, applied by its :func:`next_phase`), which checkpoint id is active, the ids already resumed
(the last 64: a late call naming one is stale), the recorded replies that make prepare,
commit and restore replayable, the lease that reopens a participant whose coordinator
went away, and the retire marks every data-plane route checks with one call
(:meth:`Fence.check_attempt`; the marks are a :class:`~rollpoint.participant.retire_marks.RetireMarks`
this fence alone writes, and servers that read them directly hold :attr:`Fence.marks`). It does not own the participant's state (the
:class:`~rollpoint.participant.participant.Participant` hooks), the wire shapes
(:mod:`rollpoint.protocol.control`), the routes (:mod:`rollpoint.participant.control_routes`) or
the file format (:mod:`rollpoint.store.participant_state`)::

    idle --prepare--> preparing --ready--> prepared --commit--> committed
    idle --restore--> restored
    idle --checkpoint--> idle                (journal mode: admission stays open)
    preparing|prepared|committed|restored --resume|lease_expired--> idle
    preparing|restored --failed--> idle      (a hook failed; the id is not spent)

Admission follows the phase, in one place (:meth:`Fence._move`): it is closed when the
phase leaves idle and opened when it returns, so it is open iff the phase is idle.

One :class:`asyncio.Lock` serialises every transition. Two waits run outside it so the
participant keeps answering: prepare's wait for readiness, and commit's capture and write
(tasks per checkpoint id, so a concurrent or repeated commit awaits the same result).
A refused call raises before it changes anything.

**Detached writes.** A commit captures the scope (the participant's export, taken while
nothing moves) and then writes it. With ``wait_for_write: false`` it replies after the
capture and writes nothing yet; ``confirm`` (which the coordinator sends after the resume)
writes it and returns the manifest, so encoding and hashing run outside the snapshot pause
and an aborted checkpoint writes nothing. The captures and writes themselves, and the last
few kept for ``confirm``, are :mod:`rollpoint.participant.checkpoint_write`'s.

**Checkpoint events.** The fence holds no performance trick: it tells the process's
listeners on :mod:`rollpoint.tuning.seam` that checkpoints are in use here (its first status
or lease, on its loop), that a checkpoint holds it (the phase leaves idle), that the hold
ended (the phase is back to idle) and that it closed. The entry point that started the
process installs what listens (:func:`rollpoint.tuning.install`: the garbage collector
paused through the hold, full collections run right after it); with nothing installed
the events cost a check of an empty tuple.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import JsonValue

from rollpoint.common.background import stop_task
from rollpoint.participant.checkpoint_write import (
    REMEMBERED_WRITES,
    CheckpointWrite,
    CheckpointWrites,
)
from rollpoint.participant.episode_scope import EpisodeScope
from rollpoint.participant.participant import (
    CapturingParticipant,
    JournalingParticipant,
    Participant,
    await_hook,
    call_hook,
    hook_error,
)
from rollpoint.participant.phase_table import Event, Step, next_phase
from rollpoint.participant.retire_marks import RetireMarks
from rollpoint.protocol.control import (
    DETACHED_WRITE,
    MAX_REPORTED_BLOCKERS,
    PROTOCOL_VERSION,
    SCOPE_KEYS,
    AckReply,
    AckRequest,
    CheckpointReply,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    ConfirmReply,
    ConfirmRequest,
    ForgetReply,
    ForgetRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    Readiness,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    StatusReply,
    Verb,
)
from rollpoint.protocol.errors import (
    BadRequestError,
    CheckpointConflictError,
    ConfigError,
    DeadlineExceededError,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    NotFoundError,
    RestoreError,
    RollpointError,
    StaleCheckpointError,
)
from rollpoint.protocol.ids import EpisodeId, is_identifier
from rollpoint.protocol.manifest import JournalMark, ParticipantManifest
from rollpoint.store.filesystem import resolve_inside
from rollpoint.store.participant_state import read_participant_state
from rollpoint.tuning import seam
from rollpoint.tuning.collector_pause import collector_paused

log = logging.getLogger(__name__)

REMEMBERED_RESUMED_IDS = 64
_WAIT_SLICE_S = 1.0
"""Longest single wait on the participant while preparing (a resume is noticed this fast)."""
_REOPEN_RETRY_S = 1.0
"""After a failed reopen on lease expiry, try again this much later."""


@dataclass(frozen=True)
class ControlSettings:
    """How a participant's control plane is set up; build one per server process."""

    token: str = field(repr=False)
    """Bearer token every control call must carry (see :func:`rollpoint.http.auth.load_token`)."""
    snapshot_root: str
    """Local folder or fsspec URL; commit and restore name folders relative to it."""
    lease_grace_s: float = 2.0
    """The lease lapses this long after the last deadline, then the participant reopens."""
    max_deadline_ahead_s: float = 3600.0
    """A ``deadline_ts`` further ahead of this participant's clock than this is refused
    (400): a deadline holds admission closed until it lapses, and one of ``1e12`` (a
    duration or milliseconds sent for Unix seconds) would close it for good."""

    def __post_init__(self) -> None:
        if not self.token.strip():
            raise ConfigError(
                "no control token configured: set ROLLPOINT_CONTROL_TOKEN or pass a token file"
            )
        if not self.snapshot_root.strip():
            raise ConfigError("snapshot_root is empty: give the folder snapshots are written to")
        if not math.isfinite(self.lease_grace_s) or self.lease_grace_s < 0:
            raise ConfigError(f"lease_grace_s must be >= 0 seconds, got {self.lease_grace_s}")
        if not math.isfinite(self.max_deadline_ahead_s) or self.max_deadline_ahead_s <= 0:
            raise ConfigError(
                f"max_deadline_ahead_s must be > 0 seconds, got {self.max_deadline_ahead_s}"
            )


@dataclass(frozen=True)
class _RestoreMemo:
    key: tuple[tuple[str, ...], str, frozenset[str]]
    reply: RestoreReply


class Fence:
    """The control plane of one participant. Call :meth:`aclose` when the server stops."""

    def __init__(
        self,
        participant: Participant,
        settings: ControlSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._participant = participant
        self._settings = settings
        self._clock = clock
        self._instance = f"{participant.name}-{participant.replica}"
        if not is_identifier(self._instance):
            raise ConfigError(
                f"participant name {participant.name!r} and replica {participant.replica!r} "
                "must be identifiers ([A-Za-z0-9][A-Za-z0-9._:-]*): they name its state folder"
            )
        self._lock = asyncio.Lock()
        self._phase = Phase.IDLE
        self._checkpoint_id: str | None = None
        self._lease_expires_at: float | None = None
        self._resumed: OrderedDict[str, None] = OrderedDict()
        self._prepared: PrepareReply | None = None
        self._write: CheckpointWrite | None = None
        """The active checkpoint's commit; cleared when the phase returns to idle."""
        self._journal_mark: JournalMark | None = None
        """Where the participant's journal stood when the active cut opened (its commit
        saves it): at the open, not the commit, since a call finishing during the cut is
        journaled before the commit while its reply is held unapplied."""
        self._writes = CheckpointWrites(
            participant, self._instance, clock, root=settings.snapshot_root
        )
        """The last commits by checkpoint id, kept past their resume for ``confirm``."""
        self._restored: _RestoreMemo | None = None
        self._marks = RetireMarks()
        self._lease_changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False
        self.control_port: int | None = None
        """The port of the control listener serving this fence on its own loop, if one
        runs (:mod:`rollpoint.participant.control_listener` sets it); status reports it."""
        self._admission_closes = 0
        """Times this fence closed admission (status ``counts.admission_closes``): what a
        journal-mode job shows never happens (issue 37)."""
        self._in_use = False
        """Checkpoints came into use (:meth:`_first_use`): the seam heard it, and a
        capturing participant was told to keep its saved form current."""

    # --- read side ---------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def checkpoint_id(self) -> str | None:
        return self._checkpoint_id

    @property
    def lease_expires_at(self) -> float | None:
        return self._lease_expires_at

    @property
    def marks(self) -> RetireMarks:
        """This participant's retire marks, the one copy: read them, never write them (the
        fence's retire, restore and forget do)."""
        return self._marks

    @property
    def retire_marks(self) -> dict[str, int]:
        return self._marks.as_dict()

    def check_attempt(self, episode: EpisodeId) -> None:
        """Refuse data-plane work of a retired attempt with :class:`StaleAttemptError`."""
        self._marks.check(episode)

    @property
    def instance(self) -> str:
        """``<name>-<replica>``: the participant's state folder, and its name in logs."""
        return self._instance

    @property
    def in_use(self) -> bool:
        """Checkpoints came into use here (a first status or lease, on the data loop)."""
        return self._in_use

    def participant_stats(self) -> dict[str, int]:
        """The participant's counters (its ``stats`` hook), raising what it raises: the
        control listener reads them off the data loop and falls back on :meth:`status`."""
        return self._participant.stats()

    def status(self, *, counts: dict[str, int] | None = None) -> StatusReply:
        """The status; ``counts``: the participant's stats already read by the caller
        (None: read here, on the data loop)."""
        self._first_use()
        p = self._participant
        return StatusReply(
            kind=p.kind,
            name=p.name,
            replica=p.replica,
            mode=p.mode,
            protocol_version=PROTOCOL_VERSION,
            features=[*p.features, DETACHED_WRITE, SCOPE_KEYS],
            phase=self._phase,
            checkpoint_id=self._checkpoint_id,
            lease_expires_at=self._lease_expires_at,
            counts={
                **(call_hook("stats", p.stats) if counts is None else counts),
                "admission_closes": self._admission_closes,
            },
            retired_rollouts=len(self._marks),
            portable=p.portable,
            control_port=self.control_port,
        )

    # --- verbs -------------------------------------------------------------------------

    async def prepare(self, req: PrepareRequest) -> PrepareReply:
        cid = req.checkpoint_id
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.PREPARE, cid)
            if self._prepared is not None:
                return self._prepared
            self._check_deadline("prepare", cid, req.deadline_ts)
            if self._phase is Phase.IDLE:
                await self._move(Verb.PREPARE)
                self._checkpoint_id = cid
            self._extend_lease(req.deadline_ts)
        try:
            await self._wait_ready(cid, req.deadline_ts)
        except Exception as exc:
            async with self._lock:
                if self._checkpoint_id == cid and self._phase is Phase.PREPARING:
                    await self._move(Event.FAILED)
            raise hook_error("readiness wait", exc, RollpointError) from None
        async with self._lock:
            await self._reap_lease()
            if self._checkpoint_id != cid:
                raise StaleCheckpointError(f"checkpoint {cid} was resumed while prepare waited")
            if self._prepared is not None:
                return self._prepared
            report = _wire_report(call_hook("readiness", self._participant.readiness))
            reply = PrepareReply(
                phase=Phase.PREPARING,
                checkpoint_id=cid,
                report=report,
                lease_expires_at=self._lease(),
            )
            if report.ready:
                await self._move(Event.READY)
                self._prepared = reply = reply.model_copy(update={"phase": Phase.PREPARED})
            return reply

    async def renew(self, req: RenewRequest) -> RenewReply:
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.RENEW, req.checkpoint_id)
            self._check_deadline("renew", req.checkpoint_id, req.deadline_ts)
            self._extend_lease(req.deadline_ts)
            return RenewReply(
                phase=self._phase, checkpoint_id=req.checkpoint_id, lease_expires_at=self._lease()
            )

    async def commit(self, req: CommitRequest) -> CommitReply:
        cid = req.checkpoint_id
        directory = self._participant_dir(req.checkpoint_dir)
        scope = EpisodeScope([*req.episode_keys, *(e.key for e in req.episode_ids)])
        wanted = CheckpointWrite(cid, req.checkpoint_dir, directory, scope)
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.COMMIT, cid)
            write = self._start_capture(wanted, req)
        reply = await self._writes.captured(write, req.deadline_ts, f"commit {cid}")
        if req.wait_for_write:
            manifest = await self._writes.stored(write, req.deadline_ts, f"commit {cid}")
            reply = reply.model_copy(update={"manifest": manifest, "exported": write.exported})
        async with self._lock:
            if self._checkpoint_id != cid:
                raise StaleCheckpointError(f"checkpoint {cid} was resumed while committing")
            if self._phase is Phase.PREPARED:
                await self._move(Verb.COMMIT)
        return reply

    async def checkpoint(self, req: CheckpointRequest) -> CheckpointReply:
        """A journal-mode checkpoint (``snapshot.mode: journal``): the phase stays idle and
        admission open. In one step on the loop the participant's journal mark is taken (the
        position now, which the reply returns); the written state holds no episode record
        (a restore brings every episode from its prompt through the journal), and its
        manifest saves ``req.floor``, so retention keeps every record a restore may read.
        A participant that does not journal is refused: it keeps the cut."""
        cid = req.checkpoint_id
        directory = self._participant_dir(req.checkpoint_dir)
        p = self._participant
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.CHECKPOINT, cid)
            write = self._writes.get(cid)
            if write is not None and write.position is not None:
                if write.checkpoint_dir != req.checkpoint_dir:
                    raise CheckpointConflictError(
                        f"checkpoint {cid} already went to {write.checkpoint_dir!r}"
                    )
            else:
                self._check_deadline("checkpoint", cid, req.deadline_ts)
                if not isinstance(p, JournalingParticipant):
                    raise InvalidPhaseError(
                        f"checkpoint {cid}: {self._instance} does not journal; it takes the cut "
                        "(prepare and commit)"
                    )
                position = call_hook("journal_mark", p.journal_mark)
                if position is None:
                    raise InvalidPhaseError(
                        f"checkpoint {cid}: {self._instance} journals nothing now; it takes "
                        "the cut (prepare and commit)"
                    )
                floor = _checked_floor(cid, req.floor, position)
                write = CheckpointWrite(
                    cid,
                    req.checkpoint_dir,
                    directory,
                    EpisodeScope([]),
                    records=[],
                    journal=floor,
                    position=position,
                )
                self._writes.start_capture(write)
        manifest = await self._writes.stored(write, req.deadline_ts, f"checkpoint {cid}")
        assert write.position is not None, "a journal checkpoint records its position"
        return CheckpointReply(checkpoint_id=cid, position=write.position, manifest=manifest)

    async def confirm(self, req: ConfirmRequest) -> ConfirmReply:
        """The manifest of what a commit of ``req.checkpoint_id`` captured, once written."""
        cid = req.checkpoint_id
        self._admit(Verb.CONFIRM, None)
        write = self._writes.get(cid)
        if write is None:
            raise NotFoundError(
                f"confirm {cid}: no commit of that checkpoint here "
                f"(the last {REMEMBERED_WRITES} commits are kept)"
            )
        self._check_deadline("confirm", cid, req.deadline_ts)
        await self._writes.captured(write, req.deadline_ts, f"confirm {cid}")
        manifest = await self._writes.stored(write, req.deadline_ts, f"confirm {cid}")
        assert write.exported is not None, "a stored write has its map"
        return ConfirmReply(checkpoint_id=cid, manifest=manifest, exported=write.exported)

    async def resume(self, req: ResumeRequest) -> ResumeReply:
        cid = req.checkpoint_id
        async with self._lock:
            await self._reap_lease()
            if cid in self._resumed or self._phase is Phase.IDLE:
                # Nothing to reopen for this id; the phase reported is the current one
                # (idle, unless another checkpoint started since).
                self._remember(cid)
                return ResumeReply(phase=self._phase, checkpoint_id=cid, idempotent=True)
            self._admit(Verb.RESUME, cid)
            await self._move(Verb.RESUME)
            return ResumeReply(phase=Phase.IDLE, checkpoint_id=cid, idempotent=False)

    async def restore(self, req: RestoreRequest) -> RestoreReply:
        cid = req.checkpoint_id
        source = req.source_checkpoint_id or cid
        # One folder per source replica: an elastic restore merges several replicas' records.
        folders = {
            f"{self._participant.name}-{r}": self._participant_dir(req.checkpoint_dir, r)
            for r in dict.fromkeys(req.sources or [self._participant.replica])
        }
        scope = sorted({e.key: e for e in req.episode_ids}.values(), key=lambda e: e.key)
        key = (tuple(folders.values()), source, frozenset(e.key for e in scope))
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.RESTORE, cid)
            if self._restored is not None:
                if self._restored.key != key:
                    raise CheckpointConflictError(
                        f"restore {cid} already installed another dir, source or scope"
                    )
                return self._restored.reply
            self._check_deadline("restore", cid, req.deadline_ts)
            try:
                async with asyncio.timeout(max(req.deadline_ts - self._clock(), 0.0)):
                    restored = await self._install(cid, source, folders, scope, req.deadline_ts)
            except BaseException as exc:
                if self._phase is Phase.RESTORED:
                    await self._move(Event.FAILED)
                if isinstance(exc, TimeoutError):
                    raise DeadlineExceededError(
                        f"restore {cid}: not done by the deadline"
                    ) from None
                if isinstance(exc, Exception):
                    raise hook_error("install", exc, RestoreError) from None
                raise
            # The saved attempts are superseded by their next ones: refuse them from now on.
            self._raise_marks({e.rollout_id: e.attempt for e in scope})
            reply = RestoreReply(
                phase=self._phase,
                checkpoint_id=cid,
                source_checkpoint_id=source,
                restored=restored,
            )
            self._restored = _RestoreMemo(key, reply)
            return reply

    async def retire(self, req: RetireRequest) -> RetireReply:
        wanted: dict[str, int] = {}
        for e in req.episode_ids:
            wanted[e.rollout_id] = max(wanted.get(e.rollout_id, -1), e.attempt)
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.RETIRE, None)
            # Marks rise before the hook runs and stay risen if it fails: a retired
            # attempt must never be served again, whatever happened to its work.
            marks = self._raise_marks(wanted)
            outcomes = call_hook("retire", self._participant.retire, marks)
            return RetireReply(marks=marks, outcomes=outcomes)

    async def forget(self, req: ForgetRequest) -> ForgetReply:
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.FORGET, None)
            dropped = set(self._marks.drop(req.rollout_ids))
            known = call_hook("forget", self._participant.forget, list(req.rollout_ids))
            return ForgetReply(forgotten=sorted(dropped | set(known)))

    async def ack(self, req: AckRequest) -> AckReply:
        async with self._lock:
            self._admit(Verb.ACK, None)
            return AckReply(acked=call_hook("ack", self._participant.ack, list(req.episode_ids)))

    async def expire_lease_if_lapsed(self) -> bool:
        """Reopen now if the lease has lapsed; True if it did. The lease task calls this;
        a caller driving a fake clock may too."""
        async with self._lock:
            return await self._reap_lease()

    async def aclose(self) -> None:
        """Stop the lease task (and the participant's capturing, if it captures), and tell
        the seam's listeners this fence closed (the collector's gives its hold back and
        puts automatic full collections back unless another fence still runs). The phase
        is left as is."""
        self._closed = True
        await seam.closed(self)
        await stop_task(self._watcher)
        self._watcher = None
        if isinstance(self._participant, CapturingParticipant):
            await self._participant.aclose()  # its state image's sweep

    # --- transitions -------------------------------------------------------------------

    def _admit(self, verb: Verb, checkpoint_id: str | None) -> Phase:
        """Check ``verb`` for ``checkpoint_id`` may run now; change nothing."""
        if checkpoint_id is not None:
            if checkpoint_id in self._resumed:
                raise StaleCheckpointError(
                    f"checkpoint {checkpoint_id} was already resumed; "
                    f"this {verb} comes from a stale coordinator"
                )
            if self._checkpoint_id is not None and self._checkpoint_id != checkpoint_id:
                raise CheckpointConflictError(
                    f"checkpoint {self._checkpoint_id} is active (phase {self._phase}); "
                    f"{verb} for {checkpoint_id} refused"
                )
        return next_phase(self._phase, verb)

    async def _move(self, step: Step) -> None:
        """Apply ``step``; close or open admission when the phase leaves or returns to idle."""
        before, after = self._phase, next_phase(self._phase, step)
        if before is Phase.IDLE and after is not Phase.IDLE:
            await self._close_admission()
            if step is Verb.PREPARE and isinstance(self._participant, JournalingParticipant):
                self._journal_mark = call_hook("journal_mark", self._participant.journal_mark)
            # The pause starts (the lease bounds how long). The collector's listener pauses
            # the cyclic collector through it: the cut's own allocations (parsing the
            # scope, exporting) would otherwise trigger a full collection over every
            # session's heap (hundreds of ms at 5k sessions, measured).
            seam.hold(self)
        elif before is not Phase.IDLE and after is Phase.IDLE:
            seam.release(self)
            await await_hook("open_admission", self._participant.open_admission())
            if step in (Verb.RESUME, Event.LEASE_EXPIRED) and self._checkpoint_id is not None:
                self._remember(self._checkpoint_id)
            self._checkpoint_id = None
            self._lease_expires_at = None
            self._prepared, self._write, self._restored = None, None, None
            self._journal_mark = None
            self._lease_changed.set()
        self._phase = after

    async def _close_admission(self) -> None:
        self._admission_closes += 1
        try:
            await self._participant.close_admission()
        except Exception as exc:
            with contextlib.suppress(Exception):
                await self._participant.open_admission()
            raise hook_error("close_admission", exc, RollpointError) from None

    def _raise_marks(self, wanted: dict[str, int]) -> dict[str, int]:
        """Raise each rollout's mark to at least ``wanted``; return the marks now held."""
        return self._marks.raise_to(wanted)

    def _remember(self, checkpoint_id: str) -> None:
        self._resumed[checkpoint_id] = None
        self._resumed.move_to_end(checkpoint_id)
        while len(self._resumed) > REMEMBERED_RESUMED_IDS:
            self._resumed.popitem(last=False)

    def _check_deadline(self, verb: str, checkpoint_id: str, deadline_ts: float) -> None:
        late = self._clock() - deadline_ts
        if late >= 0:
            raise DeadlineExceededError(
                f"{verb} {checkpoint_id}: deadline {deadline_ts:.3f} passed {late:.3f}s ago"
            )
        horizon = self._settings.max_deadline_ahead_s
        if -late > horizon:
            raise BadRequestError(
                f"{verb} {checkpoint_id}: deadline_ts {deadline_ts:.3f} is {-late:.0f}s ahead, "
                f"more than this participant accepts (max_deadline_ahead_s {horizon:g}); "
                "deadline_ts is absolute Unix seconds, not a duration"
            )

    # --- prepare and commit ------------------------------------------------------------

    async def _wait_ready(self, checkpoint_id: str, deadline_ts: float) -> None:
        while self._checkpoint_id == checkpoint_id and self._phase is Phase.PREPARING:
            remaining = deadline_ts - self._clock()
            if remaining <= 0 or self._participant.readiness().ready:
                return
            await self._participant.wait_changed(min(remaining, _WAIT_SLICE_S))

    def _start_capture(self, wanted: CheckpointWrite, req: CommitRequest) -> CheckpointWrite:
        """The write for ``wanted``'s dir and scope with its capture running or done: the
        one already started, or a new one if the participant is still ready for it."""
        cid, write = wanted.checkpoint_id, self._write
        if write is not None and write.key != wanted.key:
            raise CheckpointConflictError(
                f"commit {cid} already went to {write.checkpoint_dir!r} with "
                f"{len(write.scope)} episode(s); a retry must name the same dir and scope"
            )
        if write is not None and write.capturing:
            return write
        self._check_deadline("commit", cid, req.deadline_ts)
        self._check_ready_for(cid, wanted.scope)
        if write is None:
            wanted.journal = self._journal_mark
            write = self._write = wanted
        self._writes.start_capture(write)
        self._extend_lease(req.deadline_ts)
        return write

    def _check_ready_for(self, cid: str, scope: EpisodeScope) -> None:
        report = call_hook("readiness", self._participant.readiness)
        if not report.ready:
            shown = ", ".join(report.blockers[:10])
            raise InvalidPhaseError(
                f"commit {cid}: participant is no longer ready to commit: "
                f"{max(report.blocker_count, len(report.blockers))} blocker(s): {shown}; "
                "resume and prepare again"
            )
        reported = list(report.restarts)
        if self._prepared is not None:
            reported.extend(self._prepared.report.restarts)
        # Restarts are few (usually none): key the scope only when there are some.
        restarts = {e.key for e in reported}
        restarts = restarts & scope.key_set if restarts else set()
        if restarts:
            raise InvalidCheckpointStateError(
                f"commit {cid}: the scope names episodes reported as restarts (they cannot "
                f"be captured): {', '.join(sorted(restarts))}"
            )

    # --- restore -----------------------------------------------------------------------

    async def _install(
        self,
        cid: str,
        source: str,
        folders: dict[str, str],
        scope: list[EpisodeId],
        deadline_ts: float,
    ) -> list[EpisodeId]:
        """``folders``: instance → its state folder. Records merge by episode key, which
        is unique across replicas, so the order of the folders does not matter."""
        records: list[dict[str, JsonValue]] = []
        for instance, directory in folders.items():
            read = asyncio.to_thread(
                _read_state,
                directory,
                kind=self._participant.kind.value,
                instance=instance,
                checkpoint_id=source,
                root=self._settings.snapshot_root,
            )
            _, found = await await_hook("state read", read, RestoreError)
            records.extend(found)
        await self._move(Verb.RESTORE)
        self._checkpoint_id = cid
        self._extend_lease(deadline_ts)
        return await self._participant.install(records, scope)

    # --- lease -------------------------------------------------------------------------

    def _lease(self) -> float:
        assert self._lease_expires_at is not None, "a non-idle phase always holds a lease"
        return self._lease_expires_at

    def _extend_lease(self, deadline_ts: float) -> None:
        expires = deadline_ts + self._settings.lease_grace_s
        if self._lease_expires_at is None or expires > self._lease_expires_at:
            self._lease_expires_at = expires
            self._lease_changed.set()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch_lease(), name="rollpoint-lease")
        self._first_use()

    async def _reap_lease(self) -> bool:
        """Under the lock: reopen if the lease lapsed. Every verb starts here, so a lapsed
        lease counts as expired even before the lease task wakes up."""
        expires = self._lease_expires_at
        if self._phase is Phase.IDLE or expires is None or self._clock() < expires:
            return False
        cid, phase = self._checkpoint_id, self._phase
        log.warning("lease expired; reopening (checkpoint %s, phase %s)", cid, phase)
        try:
            await self._move(Event.LEASE_EXPIRED)
        except RollpointError:
            log.exception("reopening after lease expiry failed; retrying shortly")
            self._lease_expires_at = self._clock() + _REOPEN_RETRY_S
            self._lease_changed.set()
            return False
        return True

    async def _watch_lease(self) -> None:
        while True:
            self._lease_changed.clear()
            expires = self._lease_expires_at
            if expires is None:
                await self._lease_changed.wait()
                continue
            delay = expires - self._clock()
            if delay > 0:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel
                # that lands as the event fires, and aclose would wait forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._lease_changed.wait()
                continue
            async with self._lock:
                await self._reap_lease()

    # --- first use ---------------------------------------------------------------------

    def _first_use(self) -> None:
        """A coordinator asked for the status (it discovers every participant so when a run
        starts), or a lease began: checkpoints are in use. Once, on the loop that serves
        this fence (an app factory may build it inside another): tell the seam, and tell a
        capturing participant to keep its saved form current. A closed fence does neither."""
        if self._closed or self._in_use:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._in_use = True
        seam.in_use(self)
        if isinstance(self._participant, CapturingParticipant):
            call_hook("keep_current", self._participant.keep_current)

    # --- paths -------------------------------------------------------------------------

    def _participant_dir(self, checkpoint_dir: str, replica: str | None = None) -> str:
        """``<root>/<checkpoint_dir>/<kind>/<name>-<replica>`` (its own replica by default);
        400 if it leaves the root."""
        folder = resolve_inside(self._settings.snapshot_root, checkpoint_dir)
        instance = self._instance if replica is None else f"{self._participant.name}-{replica}"
        return resolve_inside(folder, f"{self._participant.kind.value}/{instance}")


def _read_state(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str
) -> tuple[ParticipantManifest, list[dict[str, Any]]]:
    """:func:`read_participant_state`, its decoding with the cyclic collector paused: the
    records hold no cycles, but their millions of containers would trigger collections over
    the growing heap (three quarters of a restore's time, ``snapshot_io``)."""
    with collector_paused():
        return read_participant_state(
            directory, kind=kind, instance=instance, checkpoint_id=checkpoint_id, root=root
        )


def _checked_floor(cid: str, floor: JournalMark | None, position: JournalMark) -> JournalMark:
    """The mark a journal checkpoint's manifest saves: ``floor``, or the journal's first
    segment (keep it whole) when the coordinator gave none; a floor in another folder or
    past ``position`` is a 400 naming it."""
    if floor is None:
        return JournalMark(folder=position.folder, segment=1, offset=0)
    if floor.folder != position.folder:
        raise BadRequestError(
            f"checkpoint {cid}: floor names journal {floor.folder!r}, not {position.folder!r}"
        )
    if (floor.segment, floor.offset) > (position.segment, position.offset):
        raise BadRequestError(
            f"checkpoint {cid}: floor {floor.segment}:{floor.offset} is past the journal's "
            f"position {position.segment}:{position.offset}"
        )
    return floor


def _wire_report(report: Readiness) -> Readiness:
    return report.model_copy(
        update={
            "blockers": report.blockers[:MAX_REPORTED_BLOCKERS],
            "blocker_count": max(report.blocker_count, len(report.blockers)),
        }
    )
