"""The dispatcher: sends prompt groups to agents and handles every row's result on its own.

Owns the data-plane side of a run: which replica a group goes to (the least loaded up
replica by rows in flight, ties by name), the row-concurrency limit, one ``POST /run``
stream per send, what happens to each row as its result arrives, and what happens to a try
it gives up on. The parts live beside it: :mod:`~rollpoint.trainer.dispatch.replica_picker`,
:mod:`~rollpoint.trainer.dispatch.group_run`, :mod:`~rollpoint.trainer.dispatch.run_stream`,
:mod:`~rollpoint.trainer.dispatch.given_up_tries`; this module composes them and holds the per-row
rules. It writes every move into the
:class:`~rollpoint.trainer.state.ledger.RecoveryLedger` and hands finished replies to
``on_reply``; it does not seal or train, and it reaches participants' control routes only
through the :class:`~rollpoint.trainer.dispatch.release_batcher.ReleaseBatcher` it may be given.

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

**Giving up on a try** (docs/design.md#giving-up-on-a-try): retire it on its replica first, then
adopt its stored reply or re-send the row fresh under a new rollout id; see
:mod:`rollpoint.trainer.dispatch.given_up_tries`.

**A replica that goes down** (:meth:`Dispatcher.replica_lost`): its streams are dropped and
every try it held (in flight, or queued and pinned to it) is abandoned with no retire
(nobody is left to ask) and re-sent fresh on the other replicas, except the tries the
trainer keeps to restore from a snapshot onto the restarted replica: it re-sends those
itself (:meth:`Dispatcher.resend`) or gives them up (:meth:`Dispatcher.give_up`). With no replica up, rows
wait (queued, not in flight) until the roster marks one up again.

A replica whose stream broke (or that reported a transport failure) is *suspect* for a
few seconds (:mod:`rollpoint.trainer.dispatch.replica_picker`).

Rows waiting for the barrier, a replica or a concurrency slot stay ``queued``: not in flight.

With a :class:`~rollpoint.trainer.policy_lag.PolicyLag` (``hold``), the rows of a group
not yet sent wait while it holds (``train.max_policy_lag``); rows sent again after a try
was given up do not (they are the run's own progress), and every try sent is told to it.
"""

from __future__ import annotations

import asyncio
import logging
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
from typing import Any, cast

from rollpoint.http.client import HttpClient
from rollpoint.http.ndjson_lines import DEFAULT_MAX_LINE_BYTES, OversizedLine
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.episode import (
    RowFailure,
    RowRefused,
    RowResult,
    RunReply,
)
from rollpoint.protocol.errors import (
    BadRequestError,
    InvalidPhaseError,
    ProtocolError,
    TransportError,
)
from rollpoint.protocol.ids import EpisodeId
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.given_up_tries import RETRY_WINDOW_S, GivenUpTries
from rollpoint.trainer.dispatch.group_run import GroupOutcome, GroupRun
from rollpoint.trainer.dispatch.release_batcher import ReleaseBatcher
from rollpoint.trainer.dispatch.replica_picker import ReplicaPicker
from rollpoint.trainer.dispatch.row_deadlines import RowDeadlines
from rollpoint.trainer.dispatch.row_slots import RowSlots
from rollpoint.trainer.dispatch.run_stream import RunStream, parse_row_result
from rollpoint.trainer.policy_lag import PolicyLag
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import LedgerRecord, RolloutState

__all__ = ["Dispatcher", "GroupOutcome"]

log = logging.getLogger(__name__)

REFUSED_BACKOFF_S = 0.05
REFUSED_BACKOFF_MAX_S = 1.0


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
        retry_window_s: float = RETRY_WINDOW_S,
        roster: ReplicaRoster | None = None,
        releases: ReleaseBatcher | None = None,
        down_grace_s: float = 0.0,
        down_first: bool = False,
        max_reply_bytes: int = DEFAULT_MAX_LINE_BYTES,
        hold: PolicyLag | None = None,
    ) -> None:
        """``roster`` (shared with the trainer, which marks replicas down and up) replaces
        ``deployment`` when given; ``releases`` lets a give-up retire before it decides;
        ``down_grace_s``: how long a give-up whose replica did not answer waits for it to
        be reported down before it re-sends fresh; ``down_first`` (the servers journal):
        every give-up waits that grace before it asks the agent, even when the agent is
        there to answer (:class:`GivenUpTries`); a lost row fails its group after
        ``max_tries`` fresh tries and no sooner than ``retry_window_s`` after it was first
        lost; ``max_reply_bytes``: the longest row result read (a longer one fails its row,
        see :meth:`_oversized`)."""
        if max_tries < 1:
            raise BadRequestError(f"dispatcher: max_tries must be >= 1, got {max_tries}")
        self._ledger = ledger
        self._hold = hold
        self._roster = roster if roster is not None else ReplicaRoster.of_deployment(deployment)
        self._client = client
        self._slots = RowSlots(concurrency)
        self._max_turns = max_turns
        if max_reply_bytes < 1:
            raise BadRequestError(
                f"dispatcher: max_reply_bytes must be >= 1, got {max_reply_bytes}"
            )
        self._max_reply_bytes = max_reply_bytes
        self._barrier = barrier
        self._on_reply = on_reply
        self._groups: dict[str, GroupRun] = {}
        self._streams: dict[str, set[RunStream]] = defaultdict(set)
        self._deadlines: RowDeadlines[RunStream] = RowDeadlines(
            barrier, row_timeout_s, owes=lambda s: bool(s.pending), expire=self._expire
        )
        self._waiting_rows = 0
        self._picker = ReplicaPicker(self._roster, ledger)
        self._given_up = GivenUpTries(
            ledger,
            self._roster,
            barrier,
            self._picker,
            releases=releases,
            max_tries=max_tries,
            retry_window_s=retry_window_s,
            down_grace_s=down_grace_s,
            down_first=down_first,
            send=self._send_ahead,
            fail=self._fail,
        )
        self.failed_groups: dict[str, str] = {}
        """Groups that failed, with the reason."""
        self.results_total = 0
        """Row results received (replies, failures, refusals): the stall watchdog's pulse."""
        self.resent_refused = 0
        self.failed_rows: Counter[str] = Counter()
        """Row failures by error code (the trainer's ``rollpoint_rows_failed_total``)."""

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
    def resent_fresh(self) -> int:
        """Rows re-sent under a new rollout id after their try was given up."""
        return self._given_up.resent_fresh

    @property
    def adopted(self) -> int:
        """Given-up tries whose stored reply was fetched and sealed instead of rerun."""
        return self._given_up.adopted

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
        group = GroupRun(group_id, {r.row for r in records if r.state is RolloutState.QUEUED})
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
                group.spawn(self._send(group, rollout_ids, priority=False))
            await group.done.wait()
        finally:
            del self._groups[group_id]
            await group.cancel_all()
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
            self._abandon(group_id, records, reason)
        if held:
            log.warning(
                "%s: %d tries given up and sent elsewhere",
                reason,
                sum(len(r) for r in held.values()),
            )

    def _abandon(self, group_id: str, records: list[LedgerRecord], reason: str) -> None:
        """Give these tries of one group up, to be re-sent fresh."""
        group = self._groups.get(group_id)
        if group is not None:
            self._given_up.abandon(group, records, reason)
        elif self._ledger.group(group_id).failed is None:
            for record in records:  # not running: run_group sends the fresh tries later
                self._ledger.abandon(record.rollout_id)

    def resend(self, rollout_ids: Iterable[str]) -> None:
        """Send these queued tries (restored from a snapshot, pinned to their replica) as
        part of their running groups; a try that moved meanwhile is skipped. A group that
        is not running sends its queued rows when :meth:`run_group` starts it."""
        for group_id, records in self._queued_by_group(rollout_ids).items():
            group = self._groups.get(group_id)
            if group is not None:
                group.spawn(self._send(group, [r.rollout_id for r in records], priority=True))

    def give_up(self, rollout_ids: Iterable[str], reason: str) -> None:
        """Re-send these queued tries fresh (their restore did not happen)."""
        for group_id, records in self._queued_by_group(rollout_ids).items():
            self._abandon(group_id, records, reason)

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
        self._picker.trust(name)

    async def aclose(self) -> None:
        await self._deadlines.aclose()

    async def __aenter__(self) -> Dispatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- one stream ------------------------------------------------------------------

    async def _send(self, group: GroupRun, rollout_ids: list[str], *, priority: bool) -> None:
        """Send these rows in one stream and handle each result as it arrives."""
        await self._admit(len(rollout_ids), priority=priority)
        records = [self._ledger.get(rid) for rid in rollout_ids]
        sendable = [r for r in records if r.state is RolloutState.QUEUED]
        # A row moved while it waited (its pinned replica went down and it was given up).
        self._slots.release(len(records) - len(sendable))
        if not sendable:
            return
        replica = sendable[0].replica or self._picker.least_loaded()
        if replica not in self._roster:
            self._slots.release(len(sendable))
            raise BadRequestError(f"dispatcher: {sendable[0].describe()}: no replica {replica}")
        if not self._roster.is_up(replica):
            self._slots.release(len(sendable))
            self._given_up.abandon(group, sendable, f"{replica} is down")
            return
        stream = RunStream(group, replica, asyncio.current_task())
        for record in sendable:
            stream.pending[record.rollout_id] = self._ledger.dispatch(record.rollout_id, replica)
            if self._hold is not None:
                self._hold.sent(record.group_id, record.row, record.rollout_id)
        self._streams[replica].add(stream)
        self._deadlines.add(stream)
        try:
            reason = await self._consume(stream)
        except BaseException:
            self._drop_pending(stream)
            raise
        finally:
            self._streams[replica].discard(stream)
            # Ended: what it still owes is settled just below, not by its deadline, and the
            # stream is not kept until its due time.
            self._deadlines.drop(stream)
        lost = self._drop_pending(stream)
        if lost:
            # Rows that never came back: they fail as a lot, with no code of their own.
            self.failed_rows["stream_lost"] += len(lost)
            self._given_up.lose(group, lost, reason)

    async def _admit(self, rows: int, *, priority: bool) -> None:
        """Wait for the barrier, an up replica and ``rows`` slots; return with all three."""
        self._waiting_rows += rows
        try:
            hold = None if priority else self._hold
            while True:
                if hold is not None:
                    await hold.wait_open()
                await self._barrier.wait_open()
                await self._roster.wait_any_up()
                await self._slots.acquire(rows, priority=priority)
                # Nothing can change either between this check and the caller's dispatch:
                # both run without yielding to the event loop.
                if self._barrier.is_open and self._roster.any_up and (hold is None or hold.is_open):
                    return
                self._slots.release(rows)
        finally:
            self._waiting_rows -= rows

    async def _consume(self, stream: RunStream) -> str:
        """Read the stream; return why rows it still owes were lost (if any are)."""
        url = f"{self._roster.endpoints(stream.replica).agent_url}/run"
        request = stream.request(self._ledger, self._max_turns)
        try:
            # stream_ndjson is an async generator: close it (and its connection) when we
            # stop reading early instead of leaving that to the garbage collector.
            stream_lines = cast(
                AsyncGenerator[Any, None],
                # Bounded by the row deadlines (on the pause clock: a snapshot pause may keep
                # the stream silent longer than any fixed time); they cancel this task.
                self._client.stream_ndjson(
                    url,
                    request.model_dump(mode="json"),
                    caller_deadline=True,
                    max_line_bytes=self._max_reply_bytes,
                ),
            )
            async with aclosing(stream_lines) as lines:
                async for line in lines:
                    if isinstance(line, OversizedLine):
                        self._oversized(stream, line)
                    elif not await self._handle(stream, parse_row_result(line, url)):
                        return ""
                    if not stream.pending:
                        return ""
        except TransportError as exc:
            self._picker.suspect(stream.replica)
            return f"the stream from {stream.replica} broke: {exc.message}"
        except ProtocolError as exc:
            self._fail(stream.group, f"{stream.replica} refused the /run request: {exc.message}")
            return ""
        return f"the stream from {stream.replica} ended before every row came back"

    async def _handle(self, stream: RunStream, result: RowResult) -> bool:
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
        if isinstance(result, RowFailure):
            self.failed_rows[result.code] += 1
        if isinstance(result, RowFailure) and result.transport:
            self._picker.suspect(stream.replica)
        else:
            self._picker.trust(stream.replica)
        if isinstance(result, RunReply):
            self._ledger.finish(record.rollout_id)
            await self._on_reply(result)
            group.remaining.discard(record.row)
            if not group.remaining:
                group.done.set()
        elif isinstance(result, RowRefused):
            self._refuse(stream, record, result.reason)
        elif result.transport:
            self._given_up.lose(group, [record], f"{result.code}: {result.message}")
        else:
            self._fail(group, f"row {record.row} ({record.key}): {result.code}: {result.message}")
            return False
        return True

    def _oversized(self, stream: RunStream, line: OversizedLine) -> None:
        """A row result over ``max_reply_bytes``: that row's try fails as a transport
        failure and is re-sent fresh (its stored reply is not adopted: it would be as long
        again); past the dispatcher's tries the row fails its group, naming size and cap.

        The row is the one whose rollout id the line starts with (a result names its
        episode first); a line naming none of the rows this stream owes breaks the stream."""
        owed = [r for rid, r in stream.pending.items() if rid.encode() in line.head]
        if len(owed) != 1:
            raise TransportError(
                f"{stream.replica}: {line.describe()} (max_reply_bytes) and names no row "
                "this stream owes"
            )
        (record,) = owed
        del stream.pending[record.rollout_id]
        self._slots.release(1)
        self.results_total += 1
        self.failed_rows["reply_too_large"] += 1
        reason = f"{line.describe()} (max_reply_bytes)"
        log.warning("%s: %s: re-sending it fresh", record.describe(), reason)
        self._given_up.lose(stream.group, [record], reason, adopt=False)

    def _drop_pending(self, stream: RunStream) -> list[LedgerRecord]:
        lost = list(stream.pending.values())
        stream.pending.clear()
        self._slots.release(len(lost))
        return lost

    # --- what happens to a row ---------------------------------------------------------

    def _refuse(self, stream: RunStream, record: LedgerRecord, reason: str) -> None:
        self._ledger.requeue(record.rollout_id)
        group = stream.group
        group.refusals[record.rollout_id] += 1
        self.resent_refused += 1
        log.info("%s refused by %s (%s): re-sending it alone", record.key, stream.replica, reason)
        group.spawn(self._resend_refused(group, record.rollout_id))

    async def _resend_refused(self, group: GroupRun, rollout_id: str) -> None:
        if self._barrier.is_open:
            # The environment closed admission on its own: do not hammer it.
            refusals = group.refusals[rollout_id]
            await asyncio.sleep(min(REFUSED_BACKOFF_S * 2 ** (refusals - 1), REFUSED_BACKOFF_MAX_S))
        await self._send(group, [rollout_id], priority=True)

    def _send_ahead(self, group: GroupRun, rollout_ids: list[str]) -> Coroutine[Any, Any, None]:
        """A re-send of given-up tries: ahead of new groups for the slots."""
        return self._send(group, rollout_ids, priority=True)

    def _fail(self, group: GroupRun, reason: str) -> None:
        if group.failure is None:
            group.failure = reason
            self.failed_groups[group.group_id] = reason
            log.warning("group %s failed: %s", group.group_id, reason)
            group.done.set()

    def _expire(self, stream: RunStream) -> None:
        """The rows this stream still owes ran out of time: give them up."""
        late = self._drop_pending(stream)
        if stream.task is not None:
            stream.task.cancel()  # it owes nothing now; a late answer would be ignored
        self._given_up.lose(
            stream.group,
            late,
            f"no result within {self._deadlines.timeout_s:g}s on {stream.replica} "
            "(snapshot pauses not counted)",
        )
