"""The recovery ledger: the single source of truth for every row of every prompt group.

Owns one record per *try* of a row (task, group, row, rollout id, attempt, state, the
replica that holds it, and how many fresh rollout ids the row has used), the indices that
make every lookup the hot paths need O(1), and the versioned document a snapshot saves.
The record's type, its states and the legal moves between them (one transition table) are
:mod:`.ledger_record`'s, and stay importable from here. It does not send anything (that
is :mod:`..dispatch.dispatcher`), hold replies (that is :mod:`.finished_queue`) or talk to
participants (the snapshot coordinator does, and drives :meth:`RecoveryLedger.retire`).

Scale: a snapshot's scope is :meth:`RecoveryLedger.in_flight`, kept as a per-replica
index, so it costs O(in flight) and never looks at finished work. Sealed and retired
tries are final: they leave the live store for a compact archive (one tuple each) that
only :meth:`RecoveryLedger.get`, :meth:`RecoveryLedger.current` and the document read, and
that is kept on disk but for its newest chunk (:mod:`.final_tries`), so the ledger's memory
does not grow with rows trained. What else grows with the run (tasks, groups, failures:
what the run was given to train) is kept in append-only logs of immutable chunks
(:mod:`.append_log`), and first tries nothing has happened to are implied by their group,
so :meth:`RecoveryLedger.capture` costs O(live tries that moved + chunks) however many
rollouts finished or wait queued.

The saved document's schema, its versions and migrations live in :mod:`.ledger_document`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import (
    BadRequestError,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    NotFoundError,
)
from rollpoint.protocol.ids import new_rollout_id
from rollpoint.protocol.manifest import load_versioned
from rollpoint.trainer.state.append_log import AppendLog
from rollpoint.trainer.state.final_tries import FinalTries
from rollpoint.trainer.state.ledger_document import (
    LEDGER_MIGRATIONS,
    LEDGER_SCHEMA_VERSION,
    ArchivedEntry,
    FailureEntry,
    GroupEntry,
    LedgerCapture,
    LedgerDocument,
    TaskEntry,
)
from rollpoint.trainer.state.ledger_record import (
    ARCHIVED_STATES,
    TRANSITIONS,
    LedgerGroup,
    LedgerMove,
    LedgerRecord,
    RolloutState,
)
from rollpoint.tuning.collector_pause import collector_paused

__all__ = ["TRANSITIONS", "LedgerMove", "LedgerRecord", "RecoveryLedger", "RolloutState"]

_STATES = {state.value: state for state in RolloutState}

# An archived try, kept small: (state, group_id, row, rollout_id, attempt, replica, tries).
_Archived = ArchivedEntry


class RecoveryLedger:
    """Every try of every row of every prompt group, indexed for O(1) lookups."""

    def __init__(self) -> None:
        self._tasks: dict[str, TaskRow] = {}
        self._groups: dict[str, LedgerGroup] = {}
        self._live: dict[str, LedgerRecord] = {}
        self._touched: dict[str, LedgerRecord] = {}
        """Live tries except untouched first tries: what a capture copies one by one."""
        self._final = FinalTries()
        """Sealed and retired tries: their look-ups and their chunks, on disk but the newest."""
        # What grows with the run again, in append-only chunked logs that a capture shares
        # instead of copying (the dicts above are the lookup indices over the same data).
        self._task_log: AppendLog[TaskEntry] = AppendLog()
        self._group_log: AppendLog[GroupEntry] = AppendLog()
        self._failure_log: AppendLog[FailureEntry] = AppendLog()
        # (group_id, row) -> (rollout_id, tries) of the row's newest try.
        self._current: dict[tuple[str, int], tuple[str, int]] = {}
        self._in_flight: dict[str, dict[str, LedgerRecord]] = {}
        self._in_flight_total = 0
        self._abandoned: dict[str, LedgerRecord] = {}
        self._counts: Counter[RolloutState] = Counter()

    # --- groups ----------------------------------------------------------------------

    def add_group(self, task: TaskRow, group_id: str, group_size: int) -> list[LedgerRecord]:
        """Create the rows of a new prompt group, each queued under a fresh rollout id."""
        if group_id in self._groups:
            raise BadRequestError(f"ledger: group {group_id} already exists")
        if group_size < 1:
            raise BadRequestError(f"ledger: group {group_id}: group_size must be >= 1")
        known = self._tasks.get(task.task_id)
        if known is None:
            self._add_task(task)
        elif known != task:
            raise BadRequestError(f"ledger: task {task.task_id} was added with other contents")
        self._groups[group_id] = LedgerGroup(task_id=task.task_id, group_size=group_size)
        records = []
        for row in range(group_size):
            record = LedgerRecord(
                task_id=task.task_id,
                group_id=group_id,
                row=row,
                rollout_id=new_rollout_id(),
                attempt=0,
                state=RolloutState.QUEUED,
                replica=None,
                tries=1,
            )
            self._insert(record)
            records.append(record)
        first = tuple(r.rollout_id for r in records)
        self._group_log.append((group_id, task.task_id, group_size, first))
        return records

    def _add_task(self, task: TaskRow) -> None:
        self._tasks[task.task_id] = task
        self._task_log.append((task.task_id, task))

    def group(self, group_id: str) -> LedgerGroup:
        try:
            return self._groups[group_id]
        except KeyError:
            raise NotFoundError(f"ledger: no group {group_id}") from None

    def group_ids(self) -> list[str]:
        return list(self._groups)

    def has_group(self, group_id: str) -> bool:
        return group_id in self._groups

    def task(self, task_id: str) -> TaskRow:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise NotFoundError(f"ledger: no task {task_id}") from None

    def group_records(self, group_id: str) -> list[LedgerRecord]:
        """The current try of every row of the group, by row."""
        size = self.group(group_id).group_size
        return [self.current(group_id, row) for row in range(size)]

    def fail_group(self, group_id: str, reason: str) -> list[LedgerRecord]:
        """Mark the group failed and abandon its unfinished tries, with no replacement.

        Returns the tries it abandoned: those the environment may still be running wait
        in the retire queue like any other abandoned try.
        """
        group = self.group(group_id)
        if group.failed is None:
            self._groups[group_id] = replace(group, failed=reason)
            self._failure_log.append((group_id, reason))
        abandoned = []
        for record in self.group_records(group_id):
            if (record.state, LedgerMove.ABANDON) in TRANSITIONS:
                abandoned.append(self._move(record.rollout_id, LedgerMove.ABANDON))
        return abandoned

    def failed_groups(self) -> dict[str, str]:
        return {gid: g.failed for gid, g in self._groups.items() if g.failed is not None}

    # --- moves -----------------------------------------------------------------------

    def dispatch(self, rollout_id: str, replica: str) -> LedgerRecord:
        record = self._live_record(rollout_id)
        if record.replica is not None and record.replica != replica:
            raise InvalidPhaseError(
                f"ledger: {record.describe()} must go back to {record.replica}, not {replica}"
            )
        return self._move(rollout_id, LedgerMove.DISPATCH, replica=replica)

    def requeue(
        self, rollout_id: str, *, keep_replica: bool = False, pin: str | None = None
    ) -> LedgerRecord:
        """Send the same try again: same identity, no try spent.

        After a refusal at admission a first try may go to any replica; a continued try
        (attempt > 0) stays pinned to its replica, the only one holding its saved state.
        ``keep_replica`` pins any try: a restored snapshot holds its finished reply there.
        ``pin`` pins it to another replica instead (an elastic restore put the reply there).
        """
        record = self._live_record(rollout_id)
        replica = record.replica if (record.attempt > 0 or keep_replica) else None
        return self._move(rollout_id, LedgerMove.REQUEUE, replica=pin or replica)

    def continue_attempt(self, rollout_id: str, *, pin: str | None = None) -> LedgerRecord:
        """A snapshot saved the try: it continues as ``attempt + 1`` on the same replica,
        or on ``pin`` when an elastic restore installed its state there."""
        record = self._live_record(rollout_id)
        return self._move(
            rollout_id,
            LedgerMove.CONTINUE,
            attempt=record.attempt + 1,
            replica=pin or record.replica,
        )

    def pin(self, rollout_id: str, replica: str) -> LedgerRecord:
        """Send a queued try (same identity) to ``replica``: its journals hold its work."""
        return self._move(rollout_id, LedgerMove.PIN, replica=replica)

    def finish(self, rollout_id: str) -> LedgerRecord:
        return self._move(rollout_id, LedgerMove.FINISH)

    def seal(self, rollout_id: str) -> LedgerRecord:
        return self._move(rollout_id, LedgerMove.SEAL)

    def abandon(self, rollout_id: str) -> LedgerRecord:
        """Give up on a try and queue the row again, fresh, under a new rollout id.

        The old try waits in :meth:`abandoned` until it is retired. Returns the new try.
        """
        old = self._live_record(rollout_id)
        if self._groups[old.group_id].failed is not None:
            raise InvalidPhaseError(
                f"ledger: {old.describe()}: group {old.group_id} failed; nothing to re-send"
            )
        self._move(rollout_id, LedgerMove.ABANDON)
        fresh = replace(
            old,
            rollout_id=new_rollout_id(),
            attempt=0,
            state=RolloutState.QUEUED,
            replica=None,
            tries=old.tries + 1,
        )
        self._insert(fresh)
        return fresh

    def retire(self, rollout_id: str) -> LedgerRecord:
        """The participants retired the abandoned try: it is final, and archived."""
        return self._move(rollout_id, LedgerMove.RETIRE)

    # --- lookups ---------------------------------------------------------------------

    def get(self, rollout_id: str) -> LedgerRecord:
        record = self._live.get(rollout_id)
        if record is not None:
            return record
        archived = self._final.get(rollout_id)
        if archived is None:
            raise NotFoundError(f"ledger: no rollout {rollout_id}")
        return self._unarchive(archived)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._live or rollout_id in self._final

    def current(self, group_id: str, row: int) -> LedgerRecord:
        """The row's current try: the newest one (an abandoned try is never current
        unless its group failed)."""
        try:
            rollout_id, _ = self._current[(group_id, row)]
        except KeyError:
            raise NotFoundError(f"ledger: no row {row} in group {group_id}") from None
        return self.get(rollout_id)

    def in_flight(self, replica: str | None = None) -> list[LedgerRecord]:
        """Dispatched tries, of one replica or all: O(in flight), never O(finished)."""
        if replica is not None:
            return list(self._in_flight.get(replica, {}).values())
        return [r for by_id in self._in_flight.values() for r in by_id.values()]

    def in_flight_count(self, replica: str | None = None) -> int:
        if replica is None:
            return self._in_flight_total
        return len(self._in_flight.get(replica, ()))

    def abandoned(self) -> list[LedgerRecord]:
        """Tries given up on and not yet retired: what the next checkpoint retires."""
        return list(self._abandoned.values())

    def counts(self) -> dict[RolloutState, int]:
        return {state: self._counts[state] for state in RolloutState}

    def live_records(self) -> Iterator[LedgerRecord]:
        """Every try that is not final (not sealed, not retired)."""
        return iter(self._live.values())

    @property
    def archived_count(self) -> int:
        return len(self._final)

    # --- the one place a move happens -------------------------------------------------

    def _live_record(self, rollout_id: str) -> LedgerRecord:
        record = self._live.get(rollout_id)
        if record is not None:
            return record
        archived = self._final.get(rollout_id)
        if archived is not None:
            final = self._unarchive(archived)
            raise InvalidPhaseError(f"ledger: {final.describe()} is final; no move is legal")
        raise NotFoundError(f"ledger: no rollout {rollout_id}")

    def _move(self, rollout_id: str, move: LedgerMove, **changes: Any) -> LedgerRecord:
        old = self._live_record(rollout_id)
        new_state = TRANSITIONS.get((old.state, move))
        if new_state is None:
            legal = ", ".join(m for (s, m) in TRANSITIONS if s == old.state) or "none"
            raise InvalidPhaseError(
                f"ledger: cannot {move} {old.describe()}; legal moves from {old.state}: {legal}"
            )
        new = replace(old, state=new_state, **changes)
        self._remove(old)
        self._insert(new, new_id=True)  # it was live a moment ago: no final try's id
        return new

    def _insert(self, record: LedgerRecord, *, new_id: bool = False) -> None:
        """``new_id``: the caller knows the rollout id is used by no final try."""
        rid = record.rollout_id
        if record.state in ARCHIVED_STATES:
            self._insert_final(
                (
                    record.state.value,
                    record.group_id,
                    record.row,
                    rid,
                    record.attempt,
                    record.replica,
                    record.tries,
                ),
                new_id=new_id,
            )
            return
        self._claim(rid, record.state, record.group_id, record.row, record.tries, new_id=new_id)
        self._live[rid] = record
        if not record.untouched:
            self._touched[rid] = record
        if record.state is RolloutState.DISPATCHED:
            assert record.replica is not None
            self._in_flight.setdefault(record.replica, {})[rid] = record
            self._in_flight_total += 1
        elif record.state is RolloutState.ABANDONED:
            self._abandoned[rid] = record

    def _insert_final(self, archived: _Archived, *, new_id: bool = False) -> None:
        """Archive a final try given as its tuple (a loader has it in that form already)."""
        state, group_id, row, rid, _, _, tries = archived
        self._claim(rid, _STATES[state], group_id, row, tries, new_id=new_id)
        self._final.add(archived)

    def _claim(
        self, rid: str, state: RolloutState, group_id: str, row: int, tries: int, *, new_id: bool
    ) -> None:
        """Count a new try and make it its row's current one if it is the newest.

        ``new_id``: the id is known not to be a final try's, so the look-up on disk is
        skipped (a restore checks a million saved ids at once, not one query each)."""
        if rid in self._live or (not new_id and rid in self._final):
            raise BadRequestError(f"ledger: rollout id {rid} is already used")
        self._counts[state] += 1
        key = (group_id, row)
        newest = self._current.get(key)
        if newest is None or newest[1] <= tries:
            self._current[key] = (rid, tries)

    def _remove(self, record: LedgerRecord) -> None:
        rid = record.rollout_id
        self._counts[record.state] -= 1
        del self._live[rid]
        self._touched.pop(rid, None)
        if record.state is RolloutState.DISPATCHED:
            assert record.replica is not None
            del self._in_flight[record.replica][rid]
            self._in_flight_total -= 1
        elif record.state is RolloutState.ABANDONED:
            del self._abandoned[rid]

    def _unarchive(self, archived: _Archived) -> LedgerRecord:
        state, group_id, row, rollout_id, attempt, replica, tries = archived
        return LedgerRecord(
            task_id=self._groups[group_id].task_id,
            group_id=group_id,
            row=row,
            rollout_id=rollout_id,
            attempt=attempt,
            state=RolloutState(state),
            replica=replica,
            tries=tries,
        )

    # --- document --------------------------------------------------------------------

    def capture(self) -> LedgerCapture:
        """The ledger frozen at this instant, in O(touched live tries + chunks).

        Nothing of it changes afterwards, so it may be encoded later from another thread.
        """
        return LedgerCapture(
            tasks=self._task_log.capture(),
            groups=self._group_log.capture(),
            failed=self._failure_log.capture(),
            records=tuple(self._touched.values()),
            archived=self._final.capture(),
        )

    def to_document(self) -> dict[str, Any]:
        """The ledger as a JSON-ready dict at the current schema version."""
        return self.capture().to_document()

    @classmethod
    def from_document(cls, doc: dict[str, Any], *, what: str = "ledger") -> RecoveryLedger:
        """Rebuild a ledger from :meth:`to_document` output of this or an older version."""
        # A million-rollout ledger is millions of cycle-free objects (collector_pause).
        with collector_paused():
            parsed = load_versioned(
                doc, LedgerDocument, LEDGER_MIGRATIONS, LEDGER_SCHEMA_VERSION, what
            )
            return _build(parsed, what)


def _build(doc: LedgerDocument, what: str) -> RecoveryLedger:
    ledger = RecoveryLedger()
    for task_id, task in doc.tasks.items():
        if task.task_id != task_id:
            raise InvalidCheckpointStateError(f"{what}: task {task_id} holds task {task.task_id}")
        ledger._add_task(task)
    for gid, g in doc.groups.items():
        if g.task_id not in ledger._tasks:
            raise InvalidCheckpointStateError(f"{what}: group {gid} names unknown task {g.task_id}")
        ledger._groups[gid] = LedgerGroup(g.task_id, g.group_size)
        ledger._group_log.append((gid, g.task_id, g.group_size, tuple(g.rollout_ids)))
    for gid, reason in doc.failed.items():
        group = ledger._groups.get(gid)
        if group is None:
            raise InvalidCheckpointStateError(f"{what}: failed group {gid} is not a group")
        ledger._groups[gid] = replace(group, failed=reason)
        ledger._failure_log.append((gid, reason))
    live = list(_saved_live(doc))
    named: set[str] = set()
    for rid in (
        *(record.rollout_id for record in live),
        *(final[3] for chunk in doc.archived for final in chunk),
    ):
        if rid in named:
            raise InvalidCheckpointStateError(f"{what}: rollout id {rid} appears twice")
        named.add(rid)
    # A first try left out of the document is one nothing had happened to yet.
    untouched = [
        LedgerRecord(g.task_id, gid, row, rid, 0, RolloutState.QUEUED, None, 1)
        for gid, g in doc.groups.items()
        for row, rid in enumerate(g.rollout_ids)
        if rid not in named
    ]
    seen: set[tuple[str, int, int]] = set()
    rid = ""
    try:
        for chunk in doc.archived:
            for final in chunk:
                rid = final[3]
                _check_final(ledger, final, seen, what)
                ledger._insert_final(final, new_id=True)  # every id was checked above
        for record in (*live, *untouched):
            rid = record.rollout_id
            _check_record(ledger, record, seen, what)
            ledger._insert(record, new_id=True)
    except BadRequestError:
        raise InvalidCheckpointStateError(f"{what}: rollout id {rid} appears twice") from None
    for gid, built in ledger._groups.items():
        missing = [row for row in range(built.group_size) if (gid, row) not in ledger._current]
        if missing:
            raise InvalidCheckpointStateError(
                f"{what}: group {gid} has no record of rows {missing}"
            )
    return ledger


def _saved_live(doc: LedgerDocument) -> Iterator[LedgerRecord]:
    for r in doc.records:
        state = RolloutState(r.state)
        yield LedgerRecord(
            r.task_id, r.group_id, r.row, r.rollout_id, r.attempt, state, r.replica, r.tries
        )


def _check_final(
    ledger: RecoveryLedger, final: _Archived, seen: set[tuple[str, int, int]], what: str
) -> None:
    """:func:`_check_record` for a final try in its saved tuple form, without building a
    record unless it is refused (a restore loads a million of them)."""
    state, gid, row, rid, attempt, replica, tries = final
    group = ledger._groups.get(gid)
    if group is None or row >= group.group_size or (gid, row, tries) in seen:
        task_id = group.task_id if group is not None else ""
        record = LedgerRecord(task_id, gid, row, rid, attempt, _STATES[state], replica, tries)
        _check_record(ledger, record, seen, what)  # raises, naming what is wrong
    seen.add((gid, row, tries))


def _check_record(
    ledger: RecoveryLedger, record: LedgerRecord, seen: set[tuple[str, int, int]], what: str
) -> None:
    group = ledger._groups.get(record.group_id)
    if group is None:
        raise InvalidCheckpointStateError(
            f"{what}: {record.describe()} names unknown group {record.group_id}"
        )
    if record.row >= group.group_size or (record.task_id or group.task_id) != group.task_id:
        raise InvalidCheckpointStateError(
            f"{what}: {record.describe()} does not fit group {record.group_id}"
        )
    if record.state is RolloutState.DISPATCHED and record.replica is None:
        raise InvalidCheckpointStateError(f"{what}: {record.describe()} names no replica")
    try_key = (record.group_id, record.row, record.tries)
    if try_key in seen:
        raise InvalidCheckpointStateError(
            f"{what}: two tries numbered {record.tries} for row {record.row} of {record.group_id}"
        )
    seen.add(try_key)
