"""The ``workplace`` environment: a calendar and a sent-mail box per episode, in SQLite.

Owns the task generator, the four tools, the verifier and the exact export of an episode's
database (``Connection.serialize`` as base64). It does not own idempotency: creating the
same event twice really creates two rows, which is exactly what the verifier punishes and
what the resources server's idempotency table prevents on retries.

Prompt format (parsed by the scripted policy, keep it character for character)::

    Schedule these events in my calendar, then search for each one to confirm it is there:
    - "Team sync" on 2025-01-15 at 10:00 for 30 minutes
    Then send these emails:
    - to "ana@example.com" with subject "Team sync scheduled"
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import random
import re
import sqlite3
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, JsonValue, ValidationError

from rollpoint.envs.base import Environment, NoArguments, Tool, ToolArguments
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TIME_RE = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")

_SCHEMA = """
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    date TEXT NOT NULL,
    start_time TEXT NOT NULL,
    duration_minutes INTEGER NOT NULL
);
CREATE TABLE sent_mail (
    id INTEGER PRIMARY KEY,
    recipient TEXT NOT NULL,
    subject TEXT NOT NULL,
    body TEXT NOT NULL
);
"""
_TABLES = frozenset({"events", "sent_mail"})

_TITLES = (
    "Team sync", "Design review", "Budget planning", "Customer call", "Sprint retro",
    "Quarterly review", "Hiring panel", "Product demo", "Security audit", "Lunch with Sam",
    "Roadmap workshop", "Vendor meeting", "One-on-one with Lee", "Release planning",
    "Board prep", "Onboarding session", "Incident postmortem", "Marketing brainstorm",
    "Team offsite planning", "Code review hour", "Data platform sync", "Sales kickoff",
    "Architecture forum", "Partner check-in", "All-hands rehearsal", "Support rotation handoff",
)  # fmt: skip
_RECIPIENTS = (
    "ana@example.com", "bo@example.com", "chen@example.com", "dara@example.com",
    "eli@example.com", "femi@example.com", "gita@example.com", "hugo@example.com",
)  # fmt: skip
_SUBJECTS = ("{title} scheduled", "Invitation: {title}", "Agenda for {title}", "Reminder: {title}")
_DURATIONS = (15, 30, 45, 60, 90, 120)


# ---- argument and parameter models ---------------------------------------------------------
def _check_date(value: str) -> str:
    try:
        if _DATE_RE.match(value):
            dt.date.fromisoformat(value)
            return value
    except ValueError:
        pass
    raise ValueError(f"must be a valid date as YYYY-MM-DD, got {value!r}")


def _check_time(value: str) -> str:
    if not _TIME_RE.match(value):
        raise ValueError(f"must be a time as HH:MM (24-hour), got {value!r}")
    return value


def _check_text(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


def _check_address(value: str) -> str:
    if "@" not in value:
        raise ValueError(f"must be an email address containing '@', got {value!r}")
    return value


DateText = Annotated[str, AfterValidator(_check_date), Field(description="YYYY-MM-DD")]
TimeText = Annotated[str, AfterValidator(_check_time), Field(description="HH:MM, 24-hour")]
Text = Annotated[str, AfterValidator(_check_text)]
Address = Annotated[str, AfterValidator(_check_address)]
Minutes = Annotated[int, Field(ge=1, le=1440, description="length in minutes, 1 to 1440")]


class CreateEventArgs(ToolArguments):
    title: Text = Field(description="the event's title, as the user wrote it")
    date: DateText
    start_time: TimeText
    duration_minutes: Minutes


class SearchEventsArgs(ToolArguments):
    query: str = Field(description="text the event title must contain (case-insensitive)")


class SendEmailArgs(ToolArguments):
    to: Address = Field(description="the recipient's email address")
    subject: Text
    body: str


class ExpectedEvent(StrictModel):
    title: Text
    date: DateText
    start_time: TimeText
    duration_minutes: Minutes


class ExpectedEmail(StrictModel):
    to: Address
    subject: Text


class WorkplaceParams(StrictModel):
    events: list[ExpectedEvent] = Field(min_length=1)
    emails: list[ExpectedEmail] = Field(default_factory=list)


# ---- episode state -------------------------------------------------------------------------
@dataclass
class WorkplaceState:
    """One episode: its own in-memory SQLite database."""

    db: sqlite3.Connection


def _sqlite_export(image: bytes) -> dict[str, JsonValue]:
    return {"sqlite": base64.b64encode(image).decode("ascii")}


def _connect() -> sqlite3.Connection:
    # Tool calls run on the server's event loop, exports may come from another thread in
    # tests; access is never concurrent, so the thread check only gets in the way.
    return sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)


def _event_row(row: tuple[Any, ...]) -> dict[str, JsonValue]:
    return {
        "id": row[0],
        "title": row[1],
        "date": row[2],
        "start_time": row[3],
        "duration_minutes": row[4],
    }


def _mail_row(row: tuple[Any, ...]) -> dict[str, JsonValue]:
    return {"id": row[0], "to": row[1], "subject": row[2], "body": row[3]}


def _event_effect(title: str, date: str, start_time: str, minutes: int) -> str:
    return f"event {title!r} on {date} at {start_time} for {minutes} min"


def _email_effect(recipient: str, subject: str) -> str:
    return f"email to {recipient} subject {subject!r}"


def _dumps(value: JsonValue) -> str:
    return json.dumps(value, ensure_ascii=False)


def _create_event(state: WorkplaceState, args: CreateEventArgs) -> str:
    cur = state.db.execute(
        "INSERT INTO events (title, date, start_time, duration_minutes) VALUES (?, ?, ?, ?)",
        (args.title, args.date, args.start_time, args.duration_minutes),
    )
    row = (cur.lastrowid, args.title, args.date, args.start_time, args.duration_minutes)
    return _dumps({"status": "created", "event": _event_row(row)})


def _search_events(state: WorkplaceState, args: SearchEventsArgs) -> str:
    rows = state.db.execute(
        "SELECT id, title, date, start_time, duration_minutes FROM events"
        " WHERE instr(lower(title), lower(?)) > 0 ORDER BY id",
        (args.query,),
    ).fetchall()
    return _dumps([_event_row(r) for r in rows])


def _send_email(state: WorkplaceState, args: SendEmailArgs) -> str:
    cur = state.db.execute(
        "INSERT INTO sent_mail (recipient, subject, body) VALUES (?, ?, ?)",
        (args.to, args.subject, args.body),
    )
    return _dumps(
        {"status": "sent", "email": _mail_row((cur.lastrowid, args.to, args.subject, args.body))}
    )


def _list_sent(state: WorkplaceState, _: NoArguments) -> str:
    rows = state.db.execute("SELECT id, recipient, subject, body FROM sent_mail ORDER BY id")
    return _dumps([_mail_row(r) for r in rows.fetchall()])


_TOOLS: dict[str, Tool[WorkplaceState, Any]] = {
    tool.name: tool
    for tool in (
        Tool(
            "calendar_create_event",
            "Create an event in the user's calendar.",
            CreateEventArgs,
            _create_event,
        ),
        Tool(
            "calendar_search_events",
            "List the calendar events whose title contains the query, as JSON.",
            SearchEventsArgs,
            _search_events,
        ),
        Tool("email_send", "Send an email from the user's mailbox.", SendEmailArgs, _send_email),
        Tool("email_list_sent", "List the emails sent so far, as JSON.", NoArguments, _list_sent),
    )
}


# ---- the environment -----------------------------------------------------------------------
def workplace_prompt(params: WorkplaceParams) -> str:
    lines = [
        "Schedule these events in my calendar, then search for each one to confirm it is there:"
    ]
    lines += [
        f'- "{e.title}" on {e.date} at {e.start_time} for {e.duration_minutes} minutes'
        for e in params.events
    ]
    if params.emails:
        lines.append("Then send these emails:")
        lines += [f'- to "{m.to}" with subject "{m.subject}"' for m in params.emails]
    return "\n".join(lines)


def _params(task: TaskRow) -> WorkplaceParams:
    try:
        return WorkplaceParams.model_validate(task.params)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise EpisodeError(f"task {task.task_id}: bad params at '{loc}': {err['msg']}") from None


class WorkplaceEnvironment(Environment[WorkplaceState]):
    """Calendar and email tools whose side effects must happen exactly once."""

    name: ClassVar[str] = "workplace"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    reproducible_start: ClassVar[bool] = True  # an empty calendar and outbox

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        titles = rng.sample(_TITLES, rng.randint(1, 3))
        events = [
            ExpectedEvent(
                title=title,
                date=(dt.date(2025, 1, 1) + dt.timedelta(days=rng.randrange(365))).isoformat(),
                start_time=f"{rng.randint(8, 17):02d}:{rng.choice((0, 30)):02d}",
                duration_minutes=rng.choice(_DURATIONS),
            )
            for title in titles
        ]
        emails = [
            ExpectedEmail(
                to=rng.choice(_RECIPIENTS),
                subject=rng.choice(_SUBJECTS).format(title=rng.choice(titles)),
            )
            for _ in range(rng.randint(0, 1))
        ]
        params = WorkplaceParams(events=events, emails=emails)
        return TaskRow(
            task_id=self.task_id(index),
            environment="workplace",
            prompt=workplace_prompt(params),
            params=params.model_dump(mode="json"),
        )

    def tool_table(self) -> Mapping[str, Tool[WorkplaceState, Any]]:
        return _TOOLS

    def start(self, task: TaskRow) -> WorkplaceState:
        _params(task)
        db = _connect()
        db.executescript(_SCHEMA)
        return WorkplaceState(db=db)

    def verify(
        self, state: WorkplaceState, task: TaskRow, final_message: str | None
    ) -> VerifyReply:
        params = _params(task)
        events = Counter(
            state.db.execute("SELECT title, date, start_time, duration_minutes FROM events")
        )
        mails = Counter(state.db.execute("SELECT recipient, subject FROM sent_mail"))
        wanted_events = [(e.title, e.date, e.start_time, e.duration_minutes) for e in params.events]
        wanted_mails = [(m.to, m.subject) for m in params.emails]
        duplicates = [list(k) for k, n in (*events.items(), *mails.items()) if n > 1]
        events_ok = sum(1 for key in wanted_events if events[key] == 1)
        emails_ok = sum(1 for key in wanted_mails if mails[key] == 1)
        total = len(wanted_events) + len(wanted_mails)
        reward = 0.0 if duplicates else (events_ok + emails_ok) / total
        detail: dict[str, Any] = {
            "events_expected": len(wanted_events),
            "events_ok": events_ok,
            "emails_expected": len(wanted_mails),
            "emails_ok": emails_ok,
            "duplicates": duplicates,
        }
        return VerifyReply(reward=reward, detail=detail)

    def side_effects(self, state: WorkplaceState) -> Counter[str]:
        effects: Counter[str] = Counter(
            _event_effect(*row)
            for row in state.db.execute(
                "SELECT title, date, start_time, duration_minutes FROM events"
            )
        )
        effects.update(
            _email_effect(*row)
            for row in state.db.execute("SELECT recipient, subject FROM sent_mail")
        )
        return effects

    def expected_side_effects(self, task: TaskRow) -> list[str]:
        params = _params(task)
        return [
            *(
                _event_effect(e.title, e.date, e.start_time, e.duration_minutes)
                for e in params.events
            ),
            *(_email_effect(m.to, m.subject) for m in params.emails),
        ]

    def export_state(self, state: WorkplaceState) -> dict[str, JsonValue]:
        return _sqlite_export(state.db.serialize())

    def capture_state(self, state: WorkplaceState) -> Callable[[], dict[str, JsonValue]]:
        # The image is a copy (bytes): tool calls after the pause change the database only.
        return partial(_sqlite_export, state.db.serialize())

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> WorkplaceState:
        _params(task)
        encoded = exported.get("sqlite")
        if set(exported) != {"sqlite"} or not isinstance(encoded, str):
            raise InvalidCheckpointStateError(
                f"workplace state of task {task.task_id}: want exactly {{'sqlite': <base64>}}"
            )
        try:
            data = base64.b64decode(encoded, validate=True)
        except binascii.Error:
            raise InvalidCheckpointStateError(
                f"workplace state of task {task.task_id}: 'sqlite' is not valid base64"
            ) from None
        db = _connect()
        try:
            db.deserialize(data)
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.Error as exc:
            db.close()
            raise InvalidCheckpointStateError(
                f"workplace state of task {task.task_id}: not a SQLite database ({exc})"
            ) from None
        if tables != _TABLES:
            db.close()
            raise InvalidCheckpointStateError(
                f"workplace state of task {task.task_id}: tables {sorted(tables)},"
                f" want {sorted(_TABLES)}"
            )
        return WorkplaceState(db=db)

    def close(self, state: WorkplaceState) -> None:
        state.db.close()
