"""The checkpoint fence: one participant's phase machine, lease, replays and retire marks.

Owns everything a control verb does to a participant apart from the participant's own
state: which verb is legal in which phase (the transition table of
:mod:`rollpoint.participant.phase_table`, applied by its :func:`next_phase`), which
checkpoint id is active, the ids already resumed (the last 64, a
:class:`~rollpoint.participant.resumed_ids.ResumedIds`: a late call naming one is stale),
the recorded replies that make prepare, commit and restore replayable, the lease that
reopens a participant whose coordinator went away (its deadline checks, expiry and task are
a :class:`~rollpoint.participant.fence_lease.FenceLease`; the reopening is the fence's), and
the retire marks every data-plane route checks with one call (:meth:`Fence.check_attempt`;
the marks are a :class:`~rollpoint.participant.retire_marks.RetireMarks` this fence alone
writes, and servers that read them directly hold :attr:`Fence.marks`). It does not own the
participant's state (the :class:`~rollpoint.participant.participant.Participant` hooks), its
settings (:mod:`rollpoint.participant.control_settings`), the wire shapes
(:mod:`rollpoint.protocol.control`), the routes (:mod:`rollpoint.participant.control_routes`),
where its state folders are and reading them back (:mod:`rollpoint.participant.state_folders`)
or the file format (:mod:`rollpoint.store.participant_state`)::

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
few kept for ``confirm``, are :mod:`rollpoint.participant.checkpoint_write`'s; what a
journal-mode checkpoint writes is :mod:`rollpoint.participant.journal_checkpoint`'s, and
what commit checks of a readiness report :mod:`rollpoint.participant.readiness_checks`'s.

**Checkpoint events.** The fence holds no performance trick: its
:class:`~rollpoint.participant.fence_hold.FenceHold` tells the process's listeners on
:mod:`rollpoint.tuning.seam` that checkpoints are in use here (its first status or lease,
on its loop), that a checkpoint holds it (the phase leaves idle), that the hold ended (the
phase is back to idle) and that it closed, and closes and opens the participant's
admission as the phase leaves and returns to idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollpoint.participant.checkpoint_write import (
    REMEMBERED_WRITES,
    CheckpointWrite,
    CheckpointWrites,
)
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.episode_scope import EpisodeScope
from rollpoint.participant.fence_hold import FenceHold
from rollpoint.participant.fence_lease import FenceLease
from rollpoint.participant.journal_checkpoint import journal_write
from rollpoint.participant.participant import (
    CapturingParticipant,
    JournalingParticipant,
    Participant,
    call_hook,
    hook_error,
)
from rollpoint.participant.phase_table import Event, Step, next_phase
from rollpoint.participant.readiness_checks import check_ready_for, wire_report
from rollpoint.participant.resumed_ids import REMEMBERED_RESUMED_IDS, ResumedIds
from rollpoint.participant.retire_marks import RetireMarks
from rollpoint.participant.state_folders import StateFolders
from rollpoint.protocol.control import (
    DETACHED_WRITE,
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
    CheckpointConflictError,
    ConfigError,
    DeadlineExceededError,
    NotFoundError,
    RestoreError,
    RollpointError,
    StaleCheckpointError,
)
from rollpoint.protocol.ids import EpisodeId, is_identifier
from rollpoint.protocol.manifest import JournalMark

# ControlSettings moved to control_settings and REMEMBERED_RESUMED_IDS to resumed_ids;
# importers of this module keep working.
__all__ = ["REMEMBERED_RESUMED_IDS", "ControlSettings", "Fence"]

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 1.0
"""Longest single wait on the participant while preparing (a resume is noticed this fast)."""


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
        self._lease = FenceLease(settings, clock)
        self._resumed = ResumedIds()
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
        self._folders = StateFolders(participant, self._instance, root=settings.snapshot_root)
        self._restored: _RestoreMemo | None = None
        self._marks = RetireMarks()
        self._hold = FenceHold(participant)
        """The participant's admission and the seam's events, as the phase moves."""
        self.control_port: int | None = None
        """The port of the control listener serving this fence on its own loop, if one
        runs (:mod:`rollpoint.participant.control_listener` sets it); status reports it."""

    # --- read side ---------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def checkpoint_id(self) -> str | None:
        return self._checkpoint_id

    @property
    def lease_expires_at(self) -> float | None:
        return self._lease.expires_at

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
        return self._hold.in_use

    def participant_stats(self) -> dict[str, int]:
        """The participant's counters (its ``stats`` hook), raising what it raises: the
        control listener reads them off the data loop and falls back on :meth:`status`."""
        return self._participant.stats()

    def status(self, *, counts: dict[str, int] | None = None) -> StatusReply:
        """The status; ``counts``: the participant's stats already read by the caller
        (None: read here, on the data loop)."""
        self._hold.first_use(self)
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
            lease_expires_at=self._lease.expires_at,
            counts={
                **(call_hook("stats", p.stats) if counts is None else counts),
                "admission_closes": self._hold.admission_closes,
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
            self._lease.check_deadline("prepare", cid, req.deadline_ts)
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
            report = wire_report(call_hook("readiness", self._participant.readiness))
            reply = PrepareReply(
                phase=Phase.PREPARING,
                checkpoint_id=cid,
                report=report,
                lease_expires_at=self._lease.held(),
            )
            if report.ready:
                await self._move(Event.READY)
                self._prepared = reply = reply.model_copy(update={"phase": Phase.PREPARED})
            return reply

    async def renew(self, req: RenewRequest) -> RenewReply:
        async with self._lock:
            await self._reap_lease()
            self._admit(Verb.RENEW, req.checkpoint_id)
            self._lease.check_deadline("renew", req.checkpoint_id, req.deadline_ts)
            self._extend_lease(req.deadline_ts)
            return RenewReply(
                phase=self._phase,
                checkpoint_id=req.checkpoint_id,
                lease_expires_at=self._lease.held(),
            )

    async def commit(self, req: CommitRequest) -> CommitReply:
        cid = req.checkpoint_id
        directory = self._folders.folder(req.checkpoint_dir)
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
        admission open. In one step on the loop the participant's journal mark is taken and
        its write started (:func:`~rollpoint.participant.journal_checkpoint.journal_write`:
        no episode record, ``req.floor`` saved); a participant that does not journal is
        refused: it keeps the cut."""
        cid = req.checkpoint_id
        directory = self._folders.folder(req.checkpoint_dir)
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
                self._lease.check_deadline("checkpoint", cid, req.deadline_ts)
                write = journal_write(self._participant, self._instance, req, directory)
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
        self._lease.check_deadline("confirm", cid, req.deadline_ts)
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
                self._resumed.remember(cid)
                return ResumeReply(phase=self._phase, checkpoint_id=cid, idempotent=True)
            self._admit(Verb.RESUME, cid)
            await self._move(Verb.RESUME)
            return ResumeReply(phase=Phase.IDLE, checkpoint_id=cid, idempotent=False)

    async def restore(self, req: RestoreRequest) -> RestoreReply:
        cid = req.checkpoint_id
        source = req.source_checkpoint_id or cid
        folders = self._folders.sources(req.checkpoint_dir, req.sources)
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
            self._lease.check_deadline("restore", cid, req.deadline_ts)
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
        await self._hold.close(self)
        await self._lease.aclose()
        if isinstance(self._participant, CapturingParticipant):
            await self._participant.aclose()  # its state image's sweep

    # --- transitions -------------------------------------------------------------------

    def _admit(self, verb: Verb, checkpoint_id: str | None) -> Phase:
        """Check ``verb`` for ``checkpoint_id`` may run now; change nothing."""
        if checkpoint_id is not None:
            self._resumed.check(verb, checkpoint_id)
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
            await self._hold.close_admission()
            if step is Verb.PREPARE and isinstance(self._participant, JournalingParticipant):
                self._journal_mark = call_hook("journal_mark", self._participant.journal_mark)
            self._hold.hold(self)  # the pause starts (the lease bounds how long)
        elif before is not Phase.IDLE and after is Phase.IDLE:
            await self._hold.release(self)
            if step in (Verb.RESUME, Event.LEASE_EXPIRED) and self._checkpoint_id is not None:
                self._resumed.remember(self._checkpoint_id)
            self._checkpoint_id = None
            self._prepared, self._write, self._restored = None, None, None
            self._journal_mark = None
            self._lease.end()
        self._phase = after

    def _raise_marks(self, wanted: dict[str, int]) -> dict[str, int]:
        """Raise each rollout's mark to at least ``wanted``; return the marks now held."""
        return self._marks.raise_to(wanted)

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
        self._lease.check_deadline("commit", cid, req.deadline_ts)
        report = call_hook("readiness", self._participant.readiness)
        check_ready_for(cid, report, self._prepared, wanted.scope)
        if write is None:
            wanted.journal = self._journal_mark
            write = self._write = wanted
        self._writes.start_capture(write)
        self._extend_lease(req.deadline_ts)
        return write

    # --- restore -----------------------------------------------------------------------

    async def _install(
        self,
        cid: str,
        source: str,
        folders: dict[str, str],
        scope: list[EpisodeId],
        deadline_ts: float,
    ) -> list[EpisodeId]:
        """``folders``: instance → its state folder (:meth:`StateFolders.read`)."""
        records = await self._folders.read(folders, source)
        await self._move(Verb.RESTORE)
        self._checkpoint_id = cid
        self._extend_lease(deadline_ts)
        return await self._participant.install(records, scope)

    # --- lease -------------------------------------------------------------------------

    def _extend_lease(self, deadline_ts: float) -> None:
        self._lease.extend(deadline_ts, self.expire_lease_if_lapsed)
        self._hold.first_use(self)

    async def _reap_lease(self) -> bool:
        """Under the lock: reopen if the lease lapsed. Every verb starts here, so a lapsed
        lease counts as expired even before the lease task wakes up."""
        if self._phase is Phase.IDLE or not self._lease.lapsed():
            return False
        cid, phase = self._checkpoint_id, self._phase
        log.warning("lease expired; reopening (checkpoint %s, phase %s)", cid, phase)
        try:
            await self._move(Event.LEASE_EXPIRED)
        except RollpointError:
            log.exception("reopening after lease expiry failed; retrying shortly")
            self._lease.retry_later()
            return False
        return True
