"""The dispatcher: sends prompt groups to agents and handles every row's result on its own.

Owns the data-plane side of a run: which replica a group goes to (the least loaded up
replica by rows in flight, ties by name), the row-concurrency limit, one ``POST /run``
stream per send, what happens to each row as its result arrives, and what happens to a try
it gives up on. It writes every move into the
:class:`~rollpoint.trainer.ledger.RecoveryLedger` and hands finished replies to
``on_reply``; it does not seal or train, and it reaches participants' control routes only
through the :class:`~rollpoint.trainer.release_batcher.ReleaseBatcher` it may be given.

Per-row rules (a row's result never ends its siblings' stream):

- ``RunReply``: the ledger finishes the try, ``on_reply`` gets it.
- ``RowFailure`` with ``transport=True``: the dispatcher gives the try up (below).
- ``RowFailure`` with ``transport=False``: a data failure fails the whole group.
- ``RowRefused``: the row never ran. It keeps its identity, spends no try, and is re-sent
  on its own from inside the stream handling as soon as the barrier is open (with a short
  backoff when the environment refused on its own), never after the stream ends: a cohort
  verifier may hold the siblings until the refused row arrives.
- A stream that breaks or ends short: the rows that never came back are given up.
- A row with no result within ``row_timeout_s`` on the barrier's pause clock (snapshot
  pauses do not count) is given up.

**Giving up on a try** (DESIGN §5, last paragraph): the try is retired on its replica's
participants first, and the agent's answer decides. ``cancelled`` (it was still running)
or ``unknown`` (it never got there): the row is re-sent fresh under a **new** rollout id,
never under an id the agent may still run. ``finished_unacked`` (it had finished; only its
reply was lost): the row is sent again under the **same** identity, the agent returns the
stored reply without running anything, and it is sealed like any reply: no rerun. With no
release batcher, or when the replica cannot be reached, the try is abandoned and re-sent
fresh at once; it stays in :attr:`Dispatcher.retire_queue` and the batcher retires it later.
A row that has used ``max_tries`` fresh rollout ids fails its group instead.

**A replica that goes down** (:meth:`Dispatcher.replica_lost`): its streams are dropped and
every try it held (in flight, or queued and pinned to it) is abandoned with no retire
(nobody is left to ask) and re-sent fresh on the other replicas, except the tries the
trainer keeps to restore from a snapshot onto the restarted replica: it re-sends those
itself (:meth:`Dispatcher.resend`) or gives them up (:meth:`Dispatcher.give_up`). With no replica up, rows
wait (queued, not in flight) until the roster marks one up again.

A replica whose stream broke (or that reported a transport failure) is *suspect* for a
few seconds: new sends prefer the others, so re-sends do not keep hitting a dead agent.

Rows waiting for the barrier, a replica or a concurrency slot stay ``queued``: not in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterable,
)
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, cast

from pydantic import TypeAdapter, ValidationError

from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import RetireOutcomeKind
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.episode import (
    RowFailure,
    RowRefused,
    RowResult,
    RunReply,
    RunRequest,
    RunRow,
)
from rollpoint.protocol.errors import (
    AdmissionClosedError,
    BadRequestError,
    InvalidPhaseError,
    ProtocolError,
    TransportError,
)
from rollpoint.protocol.ids import EpisodeId
from rollpoint.trainer.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.ledger import LedgerRecord, RecoveryLedger, RolloutState
from rollpoint.trainer.release_batcher import ReleaseBatcher, RetireAnswer
from rollpoint.trainer.replica_roster import ReplicaRoster
from rollpoint.trainer.row_deadlines import RowDeadlines
from rollpoint.trainer.row_slots import RowSlots

log = logging.getLogger(__name__)

_ROW_RESULT: TypeAdapter[RowResult] = TypeAdapter(RowResult)
REFUSED_BACKOFF_S = 0.05
REFUSED_BACKOFF_MAX_S = 1.0
FRESH_BACKOFF_S = 0.25
FRESH_BACKOFF_MAX_S = 2.0
SUSPECT_REPLICA_S = 5.0
"""After a transport failure, a replica gets no new rows for this long unless every
replica is suspect or it answers a row meanwhile."""
RETIRE_TIMEOUT_S = 5.0
"""How long a give-up waits for the agent's retire answer before it re-sends fresh."""
RETIRE_ROUNDS = 3
_DOWN_POLL_S = 0.05
"""Retire calls refused because a snapshot began meanwhile are tried again this often."""


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    group_id: str
    failed: str | None = None
    """Why the group failed; None when every row finished."""

    @property
    def ok(self) -> bool:
        return self.failed is None


class _GroupRun:
    """One running group: the rows it still waits for and the tasks working on them."""

    def __init__(self, group_id: str, remaining: set[int]) -> None:
        self.group_id = group_id
        self.remaining = remaining
        self.tasks: set[asyncio.Task[None]] = set()
        self.done = asyncio.Event()
        self.failure: str | None = None
        self.error: BaseException | None = None
        self.refusals: Counter[str] = Counter()


class _Stream:
    """One ``POST /run``: the replica it went to and the rows it still owes."""

    def __init__(self, group: _GroupRun, replica: str, task: asyncio.Task[Any] | None) -> None:
        self.group = group
        self.replica = replica
        self.task = task
        self.pending: dict[str, LedgerRecord] = {}


class Dispatcher:
    """Sends groups over replicas and applies the per-row rules above."""

    def __init__(
        self,
        ledger: RecoveryLedger,
        deployment: Deployment,
        client: HttpClient,
        *,
        concurrency: int,
        max_turns: int,
        row_timeout_s: float,
        barrier: DispatchBarrier,
        on_reply: Callable[[RunReply], Awaitable[None]],
        max_tries: int = 3,
        roster: ReplicaRoster | None = None,
        releases: ReleaseBatcher | None = None,
        down_grace_s: float = 0.0,
    ) -> None:
        """``roster`` (shared with the trainer, which marks replicas down and up) replaces
        ``deployment`` when given; ``releases`` lets a give-up retire before it decides;
        ``down_grace_s``: how long a give-up whose replica did not answer waits for it to
        be reported down before it re-sends fresh."""
        if max_tries < 1:
            raise BadRequestError(f"dispatcher: max_tries must be >= 1, got {max_tries}")
        self._ledger = ledger
        self._roster = roster if roster is not None else ReplicaRoster.of_deployment(deployment)
        self._releases = releases
        self._client = client
        self._slots = RowSlots(concurrency)
        self._max_turns = max_turns
        self._barrier = barrier
        self._on_reply = on_reply
        self._max_tries = max_tries
        self._down_grace_s = down_grace_s
        self._groups: dict[str, _GroupRun] = {}
        self._streams: dict[str, set[_Stream]] = defaultdict(set)
        self._deadlines: RowDeadlines[_Stream] = RowDeadlines(
            barrier, row_timeout_s, owes=lambda s: bool(s.pending), expire=self._expire
        )
        self._waiting_rows = 0
        self._suspect_until: dict[str, float] = {}
        self.failed_groups: dict[str, str] = {}
        """Groups that failed, with the reason."""
        self.results_total = 0
        """Row results received (replies, failures, refusals): the stall watchdog's pulse."""
        self.resent_fresh = 0
        self.resent_refused = 0
        self.adopted = 0
        """Given-up tries whose stored reply was fetched and sealed instead of rerun."""

    # --- public --------------------------------------------------------------------

    @property
    def in_flight_rows(self) -> int:
        return self._ledger.in_flight_count()

    @property
    def waiting_rows(self) -> int:
        """Rows waiting for the barrier, a replica or a slot: queued, not in flight."""
        return self._waiting_rows

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing waiting to be sent."""
        return self.in_flight_rows == 0 and self._waiting_rows == 0

    @property
    def roster(self) -> ReplicaRoster:
        return self._roster

    @property
    def counts(self) -> dict[str, int]:
        by_state = {str(state): n for state, n in self._ledger.counts().items()}
        return {
            **by_state,
            "in_flight": self.in_flight_rows,
            "waiting": self._waiting_rows,
            "running_groups": len(self._groups),
            "failed_groups": len(self.failed_groups),
            "resent_fresh": self.resent_fresh,
            "resent_refused": self.resent_refused,
            "adopted": self.adopted,
            "replicas_up": len(self._roster.up),
        }

    @property
    def retire_queue(self) -> set[EpisodeId]:
        """Tries given up on and not yet retired (the ledger's abandoned tries)."""
        return {record.episode for record in self._ledger.abandoned()}

    async def run_group(self, group_id: str) -> GroupOutcome:
        """Play every unfinished row of the group; return when all finished or it failed.

        Raises only for bugs and for ``on_reply`` errors; a failed group is an outcome.
        """
        if group_id in self._groups:
            raise InvalidPhaseError(f"dispatcher: group {group_id} is already running")
        failed = self._ledger.group(group_id).failed
        if failed is not None:
            return GroupOutcome(group_id, failed)
        records = self._ledger.group_records(group_id)
        if len(records) > self._slots.capacity:
            raise BadRequestError(
                f"dispatcher: group {group_id} has {len(records)} rows, more than the "
                f"concurrency of {self._slots.capacity}: it could never be sent"
            )
        busy = [r.describe() for r in records if r.state is RolloutState.DISPATCHED]
        if busy:
            raise InvalidPhaseError(f"dispatcher: group {group_id} has rows in flight: {busy}")
        group = _GroupRun(group_id, {r.row for r in records if r.state is RolloutState.QUEUED})
        if not group.remaining:
            return GroupOutcome(group_id)
        # A continued try must go back to the replica that saved it: one stream per pin.
        by_replica: dict[str | None, list[str]] = {}
        for record in records:
            if record.state is RolloutState.QUEUED:
                by_replica.setdefault(record.replica, []).append(record.rollout_id)
        self._groups[group_id] = group
        try:
            for rollout_ids in by_replica.values():
                self._spawn(group, self._send(group, rollout_ids, priority=False))
            await group.done.wait()
        finally:
            del self._groups[group_id]
            await _cancel_all(group.tasks)
        if group.error is not None:
            raise group.error
        if group.failure is not None:
            self._ledger.fail_group(group_id, group.failure)
            return GroupOutcome(group_id, group.failure)
        return GroupOutcome(group_id)

    def replica_lost(self, name: str, *, keep: Collection[str] = ()) -> None:
        """``name`` went down with everything it held: give up its tries without asking it.

        Call after marking it down in the roster. Tries in flight there and tries queued
        to go back there are abandoned (the release batcher retires them in the ledger:
        their processes are gone) and their rows re-sent fresh on the replicas still up.
        The tries in ``keep`` (rollout ids) are left where they are: the caller restores
        them from a snapshot and then calls :meth:`resend` or :meth:`give_up`.
        """
        reason = f"{name} went down"
        for stream in list(self._streams.get(name, ())):
            self._drop_pending(stream)
            if stream.task is not None:
                stream.task.cancel()  # it owes nothing now; its connection is dead anyway
        held: dict[str, list[LedgerRecord]] = defaultdict(list)
        for record in self._ledger.in_flight(name):
            if record.rollout_id not in keep:
                held[record.group_id].append(record)
        for record in list(self._ledger.live_records()):
            if (
                record.state is RolloutState.QUEUED
                and record.replica == name
                and record.rollout_id not in keep
            ):
                held[record.group_id].append(record)
        for group_id, records in held.items():
            group = self._groups.get(group_id)
            if group is not None:
                self._abandon(group, records, reason)
            elif self._ledger.group(group_id).failed is None:
                for record in records:  # not running: run_group sends the fresh tries later
                    self._ledger.abandon(record.rollout_id)
        if held:
            log.warning(
                "%s: %d tries given up and sent elsewhere",
                reason,
                sum(len(r) for r in held.values()),
            )

    def resend(self, rollout_ids: Iterable[str]) -> None:
        """Send these queued tries (restored from a snapshot, pinned to their replica) as
        part of their running groups; a try that moved meanwhile is skipped. A group that
        is not running sends its queued rows when :meth:`run_group` starts it."""
        for group_id, records in self._queued_by_group(rollout_ids).items():
            group = self._groups.get(group_id)
            if group is not None:
                self._spawn(
                    group, self._send(group, [r.rollout_id for r in records], priority=True)
                )

    def give_up(self, rollout_ids: Iterable[str], reason: str) -> None:
        """Re-send these queued tries fresh (their restore did not happen)."""
        for group_id, records in self._queued_by_group(rollout_ids).items():
            group = self._groups.get(group_id)
            if group is not None:
                self._abandon(group, records, reason)
            elif self._ledger.group(group_id).failed is None:
                for record in records:  # not running: run_group sends the fresh tries later
                    self._ledger.abandon(record.rollout_id)

    def _queued_by_group(self, rollout_ids: Iterable[str]) -> dict[str, list[LedgerRecord]]:
        by_group: dict[str, list[LedgerRecord]] = defaultdict(list)
        for rollout_id in rollout_ids:
            record = self._ledger.get(rollout_id)
            if record.state is RolloutState.QUEUED:
                by_group[record.group_id].append(record)
        return by_group

    def replica_back(self, name: str) -> None:
        """``name`` serves again (new, empty servers): send to it as to any healthy replica.

        Call after marking it up in the roster."""
        self._suspect_until.pop(name, None)

    async def aclose(self) -> None:
        await self._deadlines.aclose()

    async def __aenter__(self) -> Dispatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- one stream ------------------------------------------------------------------

    async def _send(self, group: _GroupRun, rollout_ids: list[str], *, priority: bool) -> None:
        """Send these rows in one stream and handle each result as it arrives."""
        await self._admit(len(rollout_ids), priority=priority)
        records = [self._ledger.get(rid) for rid in rollout_ids]
        sendable = [r for r in records if r.state is RolloutState.QUEUED]
        # A row moved while it waited (its pinned replica went down and it was given up).
        self._slots.release(len(records) - len(sendable))
        if not sendable:
            return
        replica = sendable[0].replica or self._least_loaded()
        if replica not in self._roster:
            self._slots.release(len(sendable))
            raise BadRequestError(f"dispatcher: {sendable[0].describe()}: no replica {replica}")
        if not self._roster.is_up(replica):
            self._slots.release(len(sendable))
            self._abandon(group, sendable, f"{replica} is down")
            return
        stream = _Stream(group, replica, asyncio.current_task())
        for record in sendable:
            stream.pending[record.rollout_id] = self._ledger.dispatch(record.rollout_id, replica)
        self._streams[replica].add(stream)
        self._deadlines.add(stream)
        try:
            reason = await self._consume(stream)
        except BaseException:
            self._drop_pending(stream)
            raise
        finally:
            self._streams[replica].discard(stream)
        lost = self._drop_pending(stream)
        if lost:
            self._lose(group, lost, reason)

    async def _admit(self, rows: int, *, priority: bool) -> None:
        """Wait for the barrier, an up replica and ``rows`` slots; return with all three."""
        self._waiting_rows += rows
        try:
            while True:
                await self._barrier.wait_open()
                await self._roster.wait_any_up()
                await self._slots.acquire(rows, priority=priority)
                # Nothing can change either between this check and the caller's dispatch:
                # both run without yielding to the event loop.
                if self._barrier.is_open and self._roster.any_up:
                    return
                self._slots.release(rows)
        finally:
            self._waiting_rows -= rows

    async def _consume(self, stream: _Stream) -> str:
        """Read the stream; return why rows it still owes were lost (if any are)."""
        url = f"{self._roster.endpoints(stream.replica).agent_url}/run"
        request = RunRequest(
            rows=[
                RunRow(
                    task=self._ledger.task(r.task_id),
                    group_id=r.group_id,
                    row=r.row,
                    episode=r.episode,
                    max_turns=self._max_turns,
                )
                for r in stream.pending.values()
            ]
        )
        try:
            # stream_ndjson is an async generator: close it (and its connection) when we
            # stop reading early instead of leaving that to the garbage collector.
            stream_lines = cast(
                AsyncGenerator[Any, None],
                self._client.stream_ndjson(url, request.model_dump(mode="json")),
            )
            async with aclosing(stream_lines) as lines:
                async for line in lines:
                    if not await self._handle(stream, _parse(line, url)):
                        return ""
                    if not stream.pending:
                        return ""
        except AdmissionClosedError as exc:
            # The agent refused the whole request: no row of it ran.
            for record in self._drop_pending(stream):
                self._refuse(stream, record, exc.message)
            return ""
        except TransportError as exc:
            self._suspect(stream.replica)
            return f"the stream from {stream.replica} broke: {exc.message}"
        except ProtocolError as exc:
            self._fail(stream.group, f"{stream.replica} refused the /run request: {exc.message}")
            return ""
        return f"the stream from {stream.replica} ended before every row came back"

    async def _handle(self, stream: _Stream, result: RowResult) -> bool:
        """Apply one row's result; False when the group failed and the stream can stop."""
        record = stream.pending.get(result.episode.rollout_id)
        if record is None or record.attempt != result.episode.attempt:
            log.warning("ignoring a result for %s: this stream does not owe it", result.episode)
            return True
        if (result.group_id, result.row) != (record.group_id, record.row):
            raise TransportError(
                f"{stream.replica} answered {result.episode} as row {result.row} of "
                f"{result.group_id}; it was sent as {record.describe()}"
            )
        del stream.pending[record.rollout_id]
        self._slots.release(1)
        self.results_total += 1
        group = stream.group
        if isinstance(result, RowFailure) and result.transport:
            self._suspect(stream.replica)
        else:
            self._suspect_until.pop(stream.replica, None)
        if isinstance(result, RunReply):
            self._ledger.finish(record.rollout_id)
            await self._on_reply(result)
            group.remaining.discard(record.row)
            if not group.remaining:
                group.done.set()
        elif isinstance(result, RowRefused):
            self._refuse(stream, record, result.reason)
        elif result.transport:
            self._lose(group, [record], f"{result.code}: {result.message}")
        else:
            self._fail(group, f"row {record.row} ({record.key}): {result.code}: {result.message}")
            return False
        return True

    def _drop_pending(self, stream: _Stream) -> list[LedgerRecord]:
        lost = list(stream.pending.values())
        stream.pending.clear()
        self._slots.release(len(lost))
        return lost

    # --- what happens to a row ---------------------------------------------------------

    def _refuse(self, stream: _Stream, record: LedgerRecord, reason: str) -> None:
        self._ledger.requeue(record.rollout_id)
        group = stream.group
        group.refusals[record.rollout_id] += 1
        self.resent_refused += 1
        log.info("%s refused by %s (%s): re-sending it alone", record.key, stream.replica, reason)
        self._spawn(group, self._resend_refused(group, record.rollout_id))

    async def _resend_refused(self, group: _GroupRun, rollout_id: str) -> None:
        if self._barrier.is_open:
            # The environment closed admission on its own: do not hammer it.
            refusals = group.refusals[rollout_id]
            await asyncio.sleep(min(REFUSED_BACKOFF_S * 2 ** (refusals - 1), REFUSED_BACKOFF_MAX_S))
        await self._send(group, [rollout_id], priority=True)

    def _lose(self, group: _GroupRun, records: list[LedgerRecord], reason: str) -> None:
        """Give up on tries of one replica that may still run there."""
        if group.failure is not None or not records:
            return
        if self._releases is None:
            self._abandon(group, records, reason)
        else:
            self._spawn(group, self._give_up(group, records, reason))

    async def _give_up(self, group: _GroupRun, records: list[LedgerRecord], reason: str) -> None:
        """Retire the tries first; then adopt the finished ones and re-send the others."""
        answer = await self._retire(records)
        if answer is None:
            await self._await_down_report(records[0].replica)
        # While we waited the replica may have gone down (and its tries with it).
        still = [r for r in records if self._still_dispatched(r)]
        if answer is None:
            self._abandon(group, still, reason)  # the release batcher retires them later
            return
        adopt = [
            r for r in still if answer.outcomes.get(r.key) is RetireOutcomeKind.FINISHED_UNACKED
        ]
        if adopt:
            for record in adopt:
                # Same identity, pinned to the agent holding the reply: it answers at once.
                self._ledger.requeue(record.rollout_id, keep_replica=True)
            self.adopted += len(adopt)
            log.info(
                "%s had finished on %s (%s): fetching the stored replies, no rerun",
                ", ".join(r.key for r in adopt),
                adopt[0].replica,
                reason,
            )
            self._spawn(group, self._send(group, [r.rollout_id for r in adopt], priority=True))
        fresh = [r for r in still if r not in adopt]
        self._abandon(group, fresh, reason, retired=answer.everywhere)

    async def _retire(self, records: list[LedgerRecord]) -> RetireAnswer | None:
        """The agent's answer to retiring these tries, or None when there is none to get."""
        replica = records[0].replica
        if self._releases is None or replica is None or not self._roster.is_up(replica):
            return None
        episodes = [r.episode for r in records]
        for _ in range(RETIRE_ROUNDS):
            await self._barrier.wait_open()  # participants refuse retire during a save
            try:
                async with asyncio.timeout(RETIRE_TIMEOUT_S):
                    answer = await self._releases.retire_now(replica, episodes)
            except TimeoutError:
                return None
            if answer is not None or self._barrier.is_open:
                return answer
        return None

    async def _await_down_report(self, replica: str | None) -> None:
        """An unreachable replica may be dying: give the runtime ``down_grace_s`` to say
        so, and the tries a snapshot saved there are restored on its restart (the trainer
        holds them) instead of being re-sent fresh from here."""
        give_up_at = time.monotonic() + self._down_grace_s
        while replica is not None and self._roster.is_up(replica):
            if time.monotonic() >= give_up_at:
                return
            await asyncio.sleep(_DOWN_POLL_S)

    def _still_dispatched(self, record: LedgerRecord) -> bool:
        now = self._ledger.get(record.rollout_id)
        return now.state is RolloutState.DISPATCHED and now.attempt == record.attempt

    def _abandon(
        self,
        group: _GroupRun,
        records: list[LedgerRecord],
        reason: str,
        *,
        retired: bool = False,
    ) -> None:
        """Re-send these rows fresh; ``retired``: their old tries are retired everywhere."""
        if group.failure is not None or not records:
            return
        fresh: list[str] = []
        for record in records:
            if record.tries >= self._max_tries:
                self._fail(
                    group,
                    f"row {record.row} gave up after {record.tries} fresh tries; "
                    f"last: {record.key}: {reason}",
                )
                return
            fresh.append(self._ledger.abandon(record.rollout_id).rollout_id)
            if retired:
                self._ledger.retire(record.rollout_id)
        self.resent_fresh += len(fresh)
        log.info(
            "%s lost (%s): re-sending under new rollout ids",
            ", ".join(r.key for r in records),
            reason,
        )
        self._spawn(
            group, self._resend_fresh(group, fresh, tries=1 + max(r.tries for r in records))
        )

    async def _resend_fresh(self, group: _GroupRun, rollout_ids: list[str], *, tries: int) -> None:
        if self._all_suspect():
            # No healthy replica to go to: give a restarting agent a moment before the
            # row spends another of its tries on it.
            await asyncio.sleep(min(FRESH_BACKOFF_S * 2 ** (tries - 2), FRESH_BACKOFF_MAX_S))
        await self._send(group, rollout_ids, priority=True)

    def _fail(self, group: _GroupRun, reason: str) -> None:
        if group.failure is None:
            group.failure = reason
            self.failed_groups[group.group_id] = reason
            log.warning("group %s failed: %s", group.group_id, reason)
            group.done.set()

    # --- tasks, replicas, deadlines ----------------------------------------------------

    def _spawn(self, group: _GroupRun, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work, name=f"dispatch-{group.group_id}")
        group.tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(group, t))

    @staticmethod
    def _task_done(group: _GroupRun, task: asyncio.Task[None]) -> None:
        group.tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and group.error is None:
            group.error = error
            group.done.set()

    def _least_loaded(self) -> str:
        """The healthy up replica with the fewest rows in flight; ties go by name."""
        now = time.monotonic()
        return min(
            self._roster.up,
            key=lambda name: (
                self._suspect_until.get(name, 0.0) > now,
                self._ledger.in_flight_count(name),
                name,
            ),
        )

    def _all_suspect(self) -> bool:
        now = time.monotonic()
        return all(self._suspect_until.get(name, 0.0) > now for name in self._roster.up)

    def _suspect(self, replica: str) -> None:
        self._suspect_until[replica] = time.monotonic() + SUSPECT_REPLICA_S

    def _expire(self, stream: _Stream) -> None:
        """The rows this stream still owes ran out of time: give them up."""
        late = self._drop_pending(stream)
        if stream.task is not None:
            stream.task.cancel()  # it owes nothing now; a late answer would be ignored
        self._lose(
            stream.group,
            late,
            f"no result within {self._deadlines.timeout_s:g}s on {stream.replica} "
            "(snapshot pauses not counted)",
        )


def _parse(line: Any, url: str) -> RowResult:
    try:
        return _ROW_RESULT.validate_python(line)
    except ValidationError as exc:
        raise TransportError(f"POST {url}: a stream line is not a row result: {exc}") from None


async def _cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
