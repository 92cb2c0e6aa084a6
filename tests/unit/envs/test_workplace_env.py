"""The workplace environment: tasks, tools, verifier, and exact export/restore."""

from __future__ import annotations

import base64
import json
import re
import sqlite3
from typing import Any

import orjson
import pytest

from rollpoint.envs.base import ToolArgumentError
from rollpoint.envs.workplace import (
    WorkplaceEnvironment,
    WorkplaceParams,
    WorkplaceState,
    workplace_prompt,
)
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.participant import CheckpointMode

EVENT_LINE = re.compile(r'^- "([^"]+)" on (\d{4}-\d{2}-\d{2}) at (\d{2}:\d{2}) for (\d+) minutes$')
EMAIL_LINE = re.compile(r'^- to "([^"]+)" with subject "([^"]+)"$')

env = WorkplaceEnvironment()


def task_with(events: list[dict[str, Any]], emails: list[dict[str, Any]] | None = None) -> TaskRow:
    params = WorkplaceParams.model_validate({"events": events, "emails": emails or []})
    return TaskRow(
        task_id="workplace-9999",
        environment="workplace",
        prompt=workplace_prompt(params),
        params=params.model_dump(mode="json"),
    )


SYNC = {"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}
DEMO = {"title": "Demo", "date": "2025-03-01", "start_time": "14:30", "duration_minutes": 60}
MAIL = {"to": "ana@example.com", "subject": "Team sync scheduled"}


def create(state: WorkplaceState, **fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(env.call(state, "calendar_create_event", fields))
    return out


def send(state: WorkplaceState, to: str, subject: str, body: str = "hi") -> None:
    env.call(state, "email_send", {"to": to, "subject": subject, "body": body})


def search(state: WorkplaceState, query: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads(
        env.call(state, "calendar_search_events", {"query": query})
    )
    return out


# ---- tasks -----------------------------------------------------------------------------------
def test_tasks_are_deterministic_per_seed_and_extend_with_n() -> None:
    assert env.make_tasks(20, seed=7) == env.make_tasks(20, seed=7)
    assert env.make_tasks(5, seed=7) == env.make_tasks(20, seed=7)[:5]
    assert env.make_tasks(20, seed=7) != env.make_tasks(20, seed=8)


def test_tasks_have_one_to_three_unique_events_and_at_most_one_email() -> None:
    tasks = env.make_tasks(200, seed=1)
    assert [t.task_id for t in tasks[:2]] == ["workplace-0000", "workplace-0001"]
    counts = set()
    titles = set()
    for task in tasks:
        params = WorkplaceParams.model_validate(task.params)
        task_titles = [e.title for e in params.events]
        assert 1 <= len(task_titles) <= 3
        assert len(set(task_titles)) == len(task_titles)
        assert len(params.emails) <= 1
        counts.add((len(params.events), len(params.emails)))
        titles.update(task_titles)
    assert counts == {(n, m) for n in (1, 2, 3) for m in (0, 1)}
    assert len(titles) >= 15


def test_prompt_matches_the_documented_format_character_for_character() -> None:
    task = task_with([SYNC], [MAIL])
    assert task.prompt == (
        "Schedule these events in my calendar, then search for each one to confirm it is there:\n"
        '- "Team sync" on 2025-01-15 at 10:00 for 30 minutes\n'
        "Then send these emails:\n"
        '- to "ana@example.com" with subject "Team sync scheduled"'
    )
    assert "Then send these emails" not in task_with([SYNC]).prompt


def test_generated_prompts_parse_back_to_their_params() -> None:
    for task in env.make_tasks(50, seed=3):
        lines = task.prompt.split("\n")
        events = [EVENT_LINE.match(line) for line in lines]
        emails = [EMAIL_LINE.match(line) for line in lines]
        parsed_events = [
            {"title": m[1], "date": m[2], "start_time": m[3], "duration_minutes": int(m[4])}
            for m in events
            if m
        ]
        parsed_emails = [{"to": m[1], "subject": m[2]} for m in emails if m]
        assert {"events": parsed_events, "emails": parsed_emails} == task.params


def test_start_refuses_a_task_with_bad_params() -> None:
    bad = TaskRow(task_id="w1", environment="workplace", prompt="p", params={"events": []})
    with pytest.raises(EpisodeError, match="w1"):
        env.start(bad)


# ---- tools -----------------------------------------------------------------------------------
def test_tool_specs_name_every_tool_and_its_required_arguments() -> None:
    tools: list[dict[str, Any]] = env.tools()
    specs = {t["function"]["name"]: t["function"] for t in tools}
    assert list(specs) == [
        "calendar_create_event",
        "calendar_search_events",
        "email_send",
        "email_list_sent",
    ]
    create_params = specs["calendar_create_event"]["parameters"]
    assert create_params["required"] == ["title", "date", "start_time", "duration_minutes"]
    # The argument called "title" survives the removal of pydantic's schema titles.
    assert create_params["properties"]["title"]["type"] == "string"
    assert create_params["properties"]["duration_minutes"]["type"] == "integer"
    assert specs["email_list_sent"]["parameters"]["properties"] == {}
    assert env.checkpoint_mode is CheckpointMode.TURN


def test_create_then_search_finds_the_event_case_insensitively() -> None:
    state = env.start(task_with([SYNC]))
    reply = create(state, **SYNC)
    assert reply == {"status": "created", "event": {"id": 1, **SYNC}}
    create(state, **DEMO)
    assert search(state, "team SYNC") == [{"id": 1, **SYNC}]
    assert [e["title"] for e in search(state, "")] == ["Team sync", "Demo"]
    assert search(state, "offsite") == []


def test_email_send_and_list_sent() -> None:
    state = env.start(task_with([SYNC], [MAIL]))
    reply = json.loads(env.call(state, "email_send", {**MAIL, "body": "Done."}))
    assert reply == {"status": "sent", "email": {"id": 1, **MAIL, "body": "Done."}}
    listed = json.loads(env.call(state, "email_list_sent", {}))
    assert listed == [{"id": 1, **MAIL, "body": "Done."}]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"title": None}, "missing required argument 'title'"),
        ({"title": "  "}, "argument 'title': must not be empty"),
        ({"title": 5}, "argument 'title': input should be a valid string"),
        ({"date": "2025/01/15"}, "argument 'date': must be a valid date as YYYY-MM-DD"),
        ({"date": "2025-02-30"}, "argument 'date': must be a valid date as YYYY-MM-DD"),
        ({"date": "20250115"}, "argument 'date': must be a valid date"),
        ({"start_time": "9:00"}, "argument 'start_time': must be a time as HH:MM"),
        ({"start_time": "24:00"}, "argument 'start_time': must be a time as HH:MM"),
        ({"duration_minutes": 0}, "argument 'duration_minutes': input should be greater than"),
        ({"duration_minutes": 1441}, "argument 'duration_minutes': input should be less than"),
        ({"duration_minutes": "30"}, "argument 'duration_minutes': input should be a valid int"),
        ({"duration_minutes": 30.0}, "argument 'duration_minutes': input should be a valid int"),
        ({"duration_minutes": True}, "argument 'duration_minutes': input should be a valid int"),
        ({"room": "B2"}, "unexpected argument 'room'"),
    ],
)
def test_create_event_rejects_bad_arguments_and_changes_nothing(
    change: dict[str, Any], message: str
) -> None:
    state = env.start(task_with([SYNC]))
    args = {k: v for k, v in {**SYNC, **change}.items() if v is not None}
    with pytest.raises(ToolArgumentError, match=re.escape(message)) as info:
        env.call(state, "calendar_create_event", args)
    assert info.value.message.startswith("calendar_create_event: ")
    assert search(state, "") == []


@pytest.mark.parametrize(
    ("tool", "args", "message"),
    [
        ("email_send", {"to": "ana.example.com", "subject": "s", "body": "b"}, "containing '@'"),
        ("email_send", {"to": "a@b.c", "subject": "", "body": "b"}, "'subject': must not be empty"),
        ("email_send", {"to": "a@b.c", "subject": "s"}, "missing required argument 'body'"),
        ("email_list_sent", {"all": True}, "unexpected argument 'all'"),
        ("calendar_search_events", {}, "missing required argument 'query'"),
        ("calendar_search_events", {"query": 3}, "'query': input should be a valid string"),
        ("calendar_delete_event", {}, "unknown tool 'calendar_delete_event'"),
    ],
)
def test_other_tools_reject_bad_calls(tool: str, args: dict[str, Any], message: str) -> None:
    state = env.start(task_with([SYNC]))
    with pytest.raises(ToolArgumentError, match=re.escape(message)):
        env.call(state, tool, args)
    assert json.loads(env.call(state, "email_list_sent", {})) == []


def test_unknown_tool_error_lists_the_available_tools() -> None:
    state = env.start(task_with([SYNC]))
    with pytest.raises(ToolArgumentError, match="available tools: calendar_create_event, "):
        env.call(state, "nope", {})


# ---- verifier --------------------------------------------------------------------------------
def test_reward_is_one_when_everything_is_done_exactly_once() -> None:
    task = task_with([SYNC, DEMO], [MAIL])
    state = env.start(task)
    create(state, **SYNC)
    create(state, **DEMO)
    create(state, **{**DEMO, "title": "Unrelated extra"})
    send(state, MAIL["to"], MAIL["subject"])
    reply = env.verify(state, task, "done")
    assert reply.reward == 1.0
    assert reply.detail["events_ok"] == 2
    assert reply.detail["emails_ok"] == 1


def test_reward_is_the_fraction_satisfied_when_something_is_missing_or_wrong() -> None:
    task = task_with([SYNC, DEMO], [MAIL])
    state = env.start(task)
    assert env.verify(state, task, None).reward == 0.0
    create(state, **SYNC)
    create(state, **{**DEMO, "duration_minutes": 45})  # wrong field: does not count
    assert env.verify(state, task, None).reward == pytest.approx(1 / 3)
    send(state, MAIL["to"], MAIL["subject"])
    assert env.verify(state, task, None).reward == pytest.approx(2 / 3)


@pytest.mark.parametrize("duplicate", ["event", "email", "unexpected event"])
def test_any_duplicate_gives_zero(duplicate: str) -> None:
    task = task_with([SYNC], [MAIL])
    state = env.start(task)
    create(state, **SYNC)
    send(state, MAIL["to"], MAIL["subject"])
    assert env.verify(state, task, None).reward == 1.0
    if duplicate == "event":
        create(state, **SYNC)
    elif duplicate == "email":
        send(state, MAIL["to"], MAIL["subject"], body="again")
    else:
        create(state, **DEMO)
        create(state, **DEMO)
    reply = env.verify(state, task, None)
    assert reply.reward == 0.0
    assert reply.detail["duplicates"]


# ---- export / restore ------------------------------------------------------------------------
def play(state: WorkplaceState, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [env.call(state, tool, args) for tool, args in calls]


def test_export_restore_continues_exactly_like_the_original() -> None:
    task = task_with([SYNC, DEMO], [MAIL])
    first: list[tuple[str, dict[str, Any]]] = [
        ("calendar_create_event", SYNC),
        ("calendar_search_events", {"query": "sync"}),
    ]
    rest: list[tuple[str, dict[str, Any]]] = [
        ("calendar_create_event", DEMO),
        ("email_send", {**MAIL, "body": "Booked."}),
        ("calendar_search_events", {"query": ""}),
        ("email_list_sent", {}),
    ]
    original = env.start(task)
    play(original, first)
    exported = orjson.loads(orjson.dumps(env.export_state(original)))
    restored = env.restore_state(task, exported)

    assert play(restored, rest) == play(original, rest)
    assert env.verify(restored, task, "ok") == env.verify(original, task, "ok")
    assert env.verify(restored, task, "ok").reward == 1.0
    # The two databases are independent copies.
    create(restored, **{**SYNC, "title": "Only in the copy"})
    assert search(original, "copy") == []
    env.close(original)
    env.close(restored)


def test_a_captured_state_is_the_state_at_the_capture_even_when_made_after_a_change() -> None:
    env = WorkplaceEnvironment()
    task = task_with([SYNC])
    state = env.start(task)
    create(state, **SYNC)
    at_capture = env.export_state(state)
    make = env.capture_state(state)  # what a checkpoint takes inside its pause
    create(state, **{**SYNC, "title": "After the cut"})  # tool calls go on after it
    assert make() == at_capture != env.export_state(state)
    restored = env.restore_state(task, orjson.loads(orjson.dumps(make())))
    assert search(restored, "After the cut") == [] and len(search(restored, "")) == 1
    env.close(state)
    env.close(restored)


@pytest.mark.parametrize(
    ("exported", "message"),
    [
        ({}, "want exactly"),
        ({"sqlite": "AAAA", "extra": 1}, "want exactly"),
        ({"sqlite": 5}, "want exactly"),
        ({"sqlite": "not base64!"}, "not valid base64"),
        ({"sqlite": "aGVsbG8gd29ybGQgdGhpcyBpcyBub3QgYSBkYg=="}, "not a SQLite database"),
    ],
)
def test_restore_refuses_malformed_state(exported: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidCheckpointStateError, match=message):
        env.restore_state(task_with([SYNC]), exported)


def test_restore_refuses_a_database_without_the_workplace_tables() -> None:
    empty = sqlite3.connect(":memory:")
    empty.execute("CREATE TABLE other (x INTEGER)")
    exported = {"sqlite": base64.b64encode(empty.serialize()).decode()}
    empty.close()
    message = re.escape("tables ['other'], want ['events', 'sent_mail']")
    with pytest.raises(InvalidCheckpointStateError, match=message):
        env.restore_state(task_with([SYNC]), exported)
