"""The crash invariants (docs/design.md#invariants), checked on a finished run's workdir.

Owns reading what a run left behind (``train_data.jsonl``, ``metrics.jsonl``, the snapshot
store) and judging it against I1 to I4. Every check returns a list of :class:`Violation`
(empty when the invariant holds) instead of asserting, so ``rollpoint chaos`` and the
chaos tests report the same findings the same way. It does not run, kill or restart
anything, and it knows the ``workplace`` tools only as far as I2 needs.

- I1 every ``(group_id, row)`` of ``tasks x group_size`` is trained exactly once, and
  ``train_data.jsonl`` still verifies against every kept train checkpoint's digest;
- I2 no tool side effect applied twice, counted from the environment's own final state
  of every trained rollout (the ``final_states_log`` its resources server wrote at verify:
  for ``workplace`` the SQLite rows, emails included), and every effect applied where the
  rollout had to reach full reward; without that log, from the transcripts (no
  ``calendar_search_events`` result lists an event twice) and the rewards;
- I3 a continued rollout (attempt ≥ 1) did not regenerate turns from before the cut: one
  assistant message per turn, no ``calendar_create_event`` call repeated verbatim, and —
  when the line records them — exactly one model call per turn, the older attempts' calls
  all before the current attempt's;
- I4 snapshots still commit after the fault: if the run trained or started a snapshot
  after it, one was published, and the last one is really in the configured store.

I5 and I6 are about error replies, not workdir contents: the tests check those directly.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import orjson

from rollpoint.envs.registry import get_environment
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import NotFoundError, RestoreError, RollpointError
from rollpoint.servers.resources.final_state_log import read_final_states
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.record.train_checkpoint import TrainCheckpointStore
from rollpoint.trainer.record.train_data import TrainData
from rollpoint.trainer.record.workdir_record import CHECKPOINTS_DIR, TRAIN_DATA_FILE
from rollpoint.trainer.trainer import group_id_for

METRICS_FILE = "metrics.jsonl"
SNAPSHOT_STORE_DIR = "snapshots"
CREATE_EVENT = "calendar_create_event"
SEARCH_EVENTS = "calendar_search_events"
FULL_REWARD = 1.0

RewardScope = Literal["none", "continued", "all"]


class Invariant(StrEnum):
    EXACTLY_ONCE = "I1"
    """Every row of every group reaches training exactly once."""
    SIDE_EFFECTS_ONCE = "I2"
    """No tool side effect applies twice."""
    NO_REGENERATED_TURNS = "I3"
    """A continued episode does not redo the turns it finished before the cut."""
    SNAPSHOTS_COMMIT = "I4"
    """After the fault, the next snapshots still commit."""


@dataclass(frozen=True, slots=True)
class Violation:
    kind: Invariant
    subject: str
    """What broke it: a row, a rollout, a file."""
    detail: str

    def __str__(self) -> str:
        return f"{self.kind.value} {self.subject}: {self.detail}"


@dataclass(frozen=True, slots=True)
class ModelCallMark:
    """Which turn a model call answered and which attempt made it."""

    turn: int
    attempt: int


@dataclass(frozen=True, slots=True)
class TrainedRollout:
    """One line of ``train_data.jsonl``: the fields the invariants read."""

    line: int
    task_id: str
    group_id: str
    row: int
    rollout_id: str
    attempt: int
    reward: float
    turns: int
    messages: list[dict[str, Any]]
    model_calls: list[ModelCallMark] | None
    """None when the line does not record them (transcript checks only)."""
    policy_lag: int | None = None
    """Versions its oldest turn was behind when trained; None on lines written before
    ``train_data.jsonl`` recorded it."""

    @property
    def subject(self) -> str:
        return f"{self.group_id} row {self.row} ({self.rollout_id}#{self.attempt})"


def by_kind(violations: Iterable[Violation]) -> dict[Invariant, list[Violation]]:
    grouped: dict[Invariant, list[Violation]] = defaultdict(list)
    for v in violations:
        grouped[v.kind].append(v)
    return dict(grouped)


def report(violations: Sequence[Violation], *, limit: int = 20) -> str:
    """One line per violation (the first ``limit``), for a test failure or a CLI."""
    lines = [str(v) for v in violations[:limit]]
    if len(violations) > limit:
        lines.append(f"... and {len(violations) - limit} more")
    return "\n".join(lines)


# ---- reading the workdir ---------------------------------------------------------------------
def read_train_data(workdir: Path) -> tuple[list[TrainedRollout], list[Violation]]:
    """Every trained rollout; a missing file or a line we cannot read is an I1 violation
    (those rows did not reach training in a usable form)."""
    path = workdir / TRAIN_DATA_FILE
    if not path.exists():
        return [], [Violation(Invariant.EXACTLY_ONCE, str(path), "missing")]
    rollouts, problems = [], []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            rollouts.append(_parse_line(number, orjson.loads(raw)))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            problems.append(
                Violation(
                    Invariant.EXACTLY_ONCE, f"{path.name} line {number}", f"unreadable: {exc}"
                )
            )
    return rollouts, problems


def _parse_line(number: int, data: Any) -> TrainedRollout:
    calls = data.get("model_calls")
    return TrainedRollout(
        line=number,
        task_id=str(data["task_id"]),
        group_id=str(data["group_id"]),
        row=int(data["row"]),
        rollout_id=str(data["rollout_id"]),
        attempt=int(data["attempt"]),
        reward=float(data["reward"]),
        # ``turns`` is the list of per-call entries; lines written before token capture
        # held the count there.
        turns=len(data["turns"]) if isinstance(data["turns"], list) else int(data["turns"]),
        messages=list(data["messages"]),
        model_calls=None
        if calls is None
        else [ModelCallMark(turn=int(c["turn"]), attempt=int(c["attempt"])) for c in calls],
        policy_lag=None if data.get("policy_lag") is None else int(data["policy_lag"]),
    )


def expected_rows(tasks: Iterable[TaskRow], group_size: int) -> set[tuple[str, int]]:
    return {(group_id_for(t.task_id), row) for t in tasks for row in range(group_size)}


def created_titles(tasks: Iterable[TaskRow]) -> dict[str, list[str]]:
    """The event titles each workplace task asks to create (other tasks create none)."""
    titles: dict[str, list[str]] = {}
    for task in tasks:
        events = task.params.get("events") if task.environment == "workplace" else None
        if isinstance(events, list):
            titles[task.task_id] = [
                str(e["title"]) for e in events if isinstance(e, dict) and "title" in e
            ]
    return titles


# ---- I1 --------------------------------------------------------------------------------------
def check_exactly_once(
    rollouts: Sequence[TrainedRollout], expected: set[tuple[str, int]]
) -> list[Violation]:
    seen = Counter((r.group_id, r.row) for r in rollouts)
    found = []
    for group_id, row in sorted(expected - seen.keys()):
        found.append(Violation(Invariant.EXACTLY_ONCE, f"{group_id} row {row}", "never trained"))
    for (group_id, row), n in sorted(seen.items()):
        if n > 1:
            lines = [r.line for r in rollouts if (r.group_id, r.row) == (group_id, row)]
            found.append(
                Violation(
                    Invariant.EXACTLY_ONCE,
                    f"{group_id} row {row}",
                    f"trained {n} times (lines {lines})",
                )
            )
        elif (group_id, row) not in expected:
            found.append(
                Violation(Invariant.EXACTLY_ONCE, f"{group_id} row {row}", "not a row of this job")
            )
    return found


def check_train_data_digests(workdir: Path) -> list[Violation]:
    """Every kept train checkpoint's coverage of ``train_data.jsonl`` still verifies (its
    byte count, line count and running digest, :meth:`TrainData.verify`): a row trained
    under a checkpoint and then rewritten or cut mid-line breaks it."""
    path = workdir / TRAIN_DATA_FILE
    found = []
    for checkpoint in TrainCheckpointStore(workdir / CHECKPOINTS_DIR).available():
        try:
            TrainData.verify(path, checkpoint.coverage)
        except RestoreError as exc:
            found.append(
                Violation(
                    Invariant.EXACTLY_ONCE, f"train checkpoint step {checkpoint.step}", exc.message
                )
            )
    return found


# ---- I2 --------------------------------------------------------------------------------------
def check_side_effects_once(
    rollouts: Sequence[TrainedRollout],
    titles: Mapping[str, Sequence[str]],
    *,
    full_reward: RewardScope = "continued",
) -> list[Violation]:
    """``titles``: task id → the event titles it creates (see :func:`created_titles`).
    ``full_reward``: which rollouts must reach reward 1.0. "continued" (those that crossed a
    crash) and "all" hold for a policy that never blunders; one that does may run out of
    turns before finishing, so give "none" for it."""
    found = []
    for r in rollouts:
        wanted = set(titles.get(r.task_id, ()))
        for turn, listed in _search_results(r.messages):
            twice = sorted(t for t, n in Counter(listed).items() if n > 1 and t in wanted)
            if twice:
                found.append(
                    Violation(
                        Invariant.SIDE_EFFECTS_ONCE,
                        r.subject,
                        f"search after assistant message {turn} lists {twice} more than once",
                    )
                )
        must_succeed = full_reward == "all" or (full_reward == "continued" and r.attempt >= 1)
        if must_succeed and r.reward != FULL_REWARD:
            found.append(
                Violation(
                    Invariant.SIDE_EFFECTS_ONCE,
                    r.subject,
                    f"reward {r.reward}, want {FULL_REWARD}",
                )
            )
    return found


def check_side_effects_from_state(
    rollouts: Sequence[TrainedRollout],
    tasks: Sequence[TaskRow],
    final_states: Path,
    *,
    full_reward: RewardScope = "continued",
) -> list[Violation]:
    """I2 from the environment's own state: the final state each resources server logged
    when it verified a trained rollout (``final_states_log``), read back through the
    environment (:meth:`~rollpoint.envs.base.Environment.side_effects`). An effect the
    state holds twice was applied twice; a rollout that had to reach full reward
    (``full_reward`` as in :func:`check_side_effects_once`) must hold every effect its task
    asks for. A trained rollout whose verify left no line is a violation too."""
    states, unreadable = read_final_states(final_states)
    found = [
        Violation(Invariant.SIDE_EFFECTS_ONCE, str(final_states), f"unreadable: {problem}")
        for problem in unreadable
    ]
    by_id = {t.task_id: t for t in tasks}
    for r in rollouts:
        task = by_id.get(r.task_id)
        if task is None:
            continue  # not a row of this job: I1 says so
        entry = states.get((r.rollout_id, r.attempt))
        if entry is None:
            found.append(
                Violation(
                    Invariant.SIDE_EFFECTS_ONCE,
                    r.subject,
                    f"trained, but no resources server logged its final state in {final_states}",
                )
            )
            continue
        environment = get_environment(task.environment)
        try:
            state = environment.restore_state(task, entry.state)
        except RollpointError as exc:
            where = f"{entry.file.name} line {entry.line}"
            found.append(
                Violation(Invariant.SIDE_EFFECTS_ONCE, r.subject, f"{where}: {exc.message}")
            )
            continue
        try:
            effects = environment.side_effects(state)
        finally:
            environment.close(state)
        for effect, n in sorted(effects.items()):
            if n > 1:
                found.append(
                    Violation(
                        Invariant.SIDE_EFFECTS_ONCE, r.subject, f"applied {n} times: {effect}"
                    )
                )
        must_succeed = full_reward == "all" or (full_reward == "continued" and r.attempt >= 1)
        if must_succeed:
            for effect in environment.expected_side_effects(task):
                if effects[effect] == 0:
                    found.append(
                        Violation(
                            Invariant.SIDE_EFFECTS_ONCE, r.subject, f"never applied: {effect}"
                        )
                    )
    return found


def _search_results(messages: Sequence[dict[str, Any]]) -> list[tuple[int, list[str]]]:
    """(assistant message index, titles listed) for every search answered with a list."""
    asked: dict[str, int] = {}
    results = []
    assistant = -1
    for m in messages:
        if m.get("role") == "assistant":
            assistant += 1
            for call_id, name, _ in _tool_calls(m):
                if name == SEARCH_EVENTS:
                    asked[call_id] = assistant
        elif m.get("role") == "tool" and m.get("tool_call_id") in asked:
            try:
                listed = orjson.loads(str(m.get("content")))
            except orjson.JSONDecodeError:
                continue  # an error answer lists nothing
            if isinstance(listed, list):
                names = [str(e.get("title")) for e in listed if isinstance(e, dict)]
                results.append((asked[str(m["tool_call_id"])], names))
    return results


def _tool_calls(message: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each tool call of an assistant message."""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            calls.append((str(call.get("id")), str(fn.get("name")), str(fn.get("arguments"))))
    return calls


# ---- I3 --------------------------------------------------------------------------------------
def check_no_regenerated_turns(rollouts: Sequence[TrainedRollout]) -> list[Violation]:
    found = []
    for r in rollouts:
        if r.attempt < 1:
            continue
        found += [
            Violation(Invariant.NO_REGENERATED_TURNS, r.subject, detail)
            for detail in _transcript_problems(r) + _model_call_problems(r)
        ]
    return found


def _transcript_problems(r: TrainedRollout) -> list[str]:
    problems = []
    assistants = [m for m in r.messages if m.get("role") == "assistant"]
    if len(assistants) != r.turns:
        problems.append(f"{len(assistants)} assistant messages for {r.turns} turns")
    creates = Counter(
        arguments
        for m in assistants
        for _, name, arguments in _tool_calls(m)
        if name == CREATE_EVENT
    )
    problems += [f"{CREATE_EVENT} {args} called {n} times" for args, n in creates.items() if n > 1]
    return problems


def _model_call_problems(r: TrainedRollout) -> list[str]:
    if r.model_calls is None:
        return []
    problems = []
    turns = Counter(c.turn for c in r.model_calls)
    if sorted(turns) != list(range(r.turns)) or any(n > 1 for n in turns.values()):
        problems.append(
            f"model calls for turns {sorted(turns.elements())}, want 0..{r.turns - 1} once each"
        )
    ordered = [c.attempt for c in sorted(r.model_calls, key=lambda c: c.turn)]
    if ordered != sorted(ordered):
        problems.append(f"attempts by turn {ordered}: an older attempt made a later turn")
    if any(a > r.attempt for a in ordered):
        problems.append(f"attempts by turn {ordered}: a call from after attempt {r.attempt}")
    return problems


# ---- I4 --------------------------------------------------------------------------------------
def check_snapshots_commit(
    workdir: Path, *, since: float, store: str | None = None
) -> list[Violation]:
    """Snapshots still commit from ``since`` on (a Unix time: a rerun's start, or the end of
    a fault): if a step was trained or a snapshot started since, one was published since,
    and the last one published is in the store (``store``: the run's ``snapshot.store``,
    a path or fsspec URL; None: ``WORKDIR/snapshots``), its sealed manifest loading. A
    rerun that found nothing left to do takes none. A snapshot that was under way when
    ``since`` came is the fault's own and does not count: an event is stamped as the save
    ends, its pause is how long it ran."""
    path = workdir / METRICS_FILE
    tried = [e for e in _events(path) if e.get("event") == "snapshot" and _started(e) >= since]
    trained = [
        c.step
        for c in TrainCheckpointStore(workdir / CHECKPOINTS_DIR).available()
        if c.written_at >= since
    ]
    published = [str(e["snapshot_id"]) for e in tried if e.get("outcome") == "published"]
    if not published:
        if not tried and not trained:
            return []
        did = f"trained steps {sorted(trained)}" if trained else f"tried {len(tried)} snapshot(s)"
        return [Violation(Invariant.SNAPSHOTS_COMMIT, str(path), f"{did} but published none")]
    root = store if store is not None else str(workdir / SNAPSHOT_STORE_DIR)
    try:
        SnapshotStore(root, clean_leftovers=False).load(published[-1])
    except NotFoundError:
        return [
            Violation(Invariant.SNAPSHOTS_COMMIT, published[-1], f"published but not in {root}")
        ]
    except RollpointError as exc:
        return [
            Violation(
                Invariant.SNAPSHOTS_COMMIT,
                published[-1],
                f"published but unreadable: {exc.message}",
            )
        ]
    return []


def _started(event: Mapping[str, Any]) -> float:
    return float(event.get("ts", 0)) - float(event.get("pause_seconds", 0))


def snapshot_outcomes(workdir: Path) -> Counter[str]:
    """Snapshot attempts of every run in ``workdir`` by outcome (``published``, ``failed``)."""
    return Counter(
        str(e.get("outcome"))
        for e in _events(workdir / METRICS_FILE)
        if e.get("event") == "snapshot"
    )


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for raw in path.read_bytes().splitlines():
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue  # a line torn by the crash is no claim about snapshots
        if isinstance(event, dict):
            events.append(event)
    return events


# ---- all of them -----------------------------------------------------------------------------
def check_workdir(
    workdir: Path,
    tasks: Sequence[TaskRow],
    group_size: int,
    *,
    resumed_since: float,
    full_reward: RewardScope = "continued",
    final_states: Path | None = None,
    store: str | None = None,
) -> list[Violation]:
    """I1 to I4 on a run that finished after a crash; ``resumed_since`` and ``store`` as in
    :func:`check_snapshots_commit`. With ``final_states`` (the run's ``final_states_log``)
    I2 is counted from the environment's own state; without, from the transcripts."""
    rollouts, unreadable = read_train_data(workdir)
    side_effects = (
        check_side_effects_once(rollouts, created_titles(tasks), full_reward=full_reward)
        if final_states is None
        else check_side_effects_from_state(rollouts, tasks, final_states, full_reward=full_reward)
    )
    return [
        *unreadable,
        *check_exactly_once(rollouts, expected_rows(tasks, group_size)),
        *check_train_data_digests(workdir),
        *side_effects,
        *check_no_regenerated_turns(rollouts),
        *check_snapshots_commit(workdir, since=resumed_since, store=store),
    ]
