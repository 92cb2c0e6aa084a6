"""The resources server over real HTTP: tools, idempotency, errors, freeze, export/install."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from rollpoint.envs.blackjack import BlackjackEnvironment
from rollpoint.envs.workplace import WorkplaceEnvironment
from rollpoint.http.client import HttpClient
from rollpoint.protocol.episode import EpisodeStart, TaskRow, ToolCall
from rollpoint.protocol.errors import (
    BadRequestError,
    ConfigError,
    IdempotencyConflictError,
    InvalidCheckpointStateError,
    NotFoundError,
)
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.episode_service import ResourcesService
from rollpoint.servers.resources.final_state_log import read_final_states
from rollpoint.servers.resources.resources_server import create_resources_app, resources_service
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration

TASK = WorkplaceEnvironment().make_tasks(1, seed=11)[0]
SYNC = {"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}
DEMO = {"title": "Demo", "date": "2025-03-01", "start_time": "14:30", "duration_minutes": 60}


def episode(rollout_id: str = "r1", attempt: int = 0) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt": attempt}


def call(turn: int, index: int, arguments: Any, rollout_id: str = "r1") -> dict[str, Any]:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"episode": episode(rollout_id), "turn": turn, "call_index": index, "arguments": raw}


def with_gate_routes(app: FastAPI) -> FastAPI:
    """Freeze and thaw from the server's own event loop, as the participant will."""
    service = resources_service(app)

    @app.post("/test/freeze")
    async def freeze() -> dict[str, bool]:
        service.freeze()
        return {"frozen": True}

    @app.post("/test/thaw")
    async def thaw() -> dict[str, bool]:
        service.thaw()
        return {"frozen": False}

    return app


@pytest.fixture
def app() -> FastAPI:
    return with_gate_routes(
        create_resources_app("workplace", name="resources", replica="replica-0")
    )


@pytest.fixture
def base_url(app: FastAPI) -> Iterator[str]:
    with serve_app(app) as url:
        yield url


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[HttpClient]:
    # Depends on the server so its connections close before the server stops.
    async with HttpClient(timeout_s=10) as http:
        yield http


async def start(
    client: HttpClient, base_url: str, rollout_id: str = "r1", task: TaskRow = TASK
) -> bool:
    body = {"episode": episode(rollout_id), "task": task.model_dump(mode="json")}
    reply = await client.post_json(f"{base_url}/episodes/start", body)
    created: bool = reply["created"]
    return created


async def search(client: HttpClient, base_url: str, turn: int, query: str) -> list[dict[str, Any]]:
    reply = await client.post_json(
        f"{base_url}/tools/calendar_search_events", call(turn, 0, {"query": query})
    )
    assert reply["is_error"] is False
    found: list[dict[str, Any]] = json.loads(reply["content"])
    return found


async def test_tools_lists_the_environment_and_its_tool_specs(
    client: HttpClient, base_url: str
) -> None:
    reply = await client.get_json(f"{base_url}/tools")
    assert reply["environment"] == "workplace"
    assert [t["function"]["name"] for t in reply["tools"]] == [
        "calendar_create_event",
        "calendar_search_events",
        "email_send",
        "email_list_sent",
    ]
    assert all(t["type"] == "function" for t in reply["tools"])


async def test_start_is_idempotent_per_rollout(
    client: HttpClient, base_url: str, app: FastAPI
) -> None:
    assert await start(client, base_url) is True
    assert await start(client, base_url) is False
    body = {"episode": episode("r1", attempt=1), "task": TASK.model_dump(mode="json")}
    assert (await client.post_json(f"{base_url}/episodes/start", body))["created"] is False
    assert resources_service(app).episode_count == 1
    other = WorkplaceEnvironment().make_tasks(2, seed=11)[1]
    with pytest.raises(BadRequestError, match="rollout 'r1' was started with task workplace-0000"):
        await start(client, base_url, task=other)
    math_task = TaskRow(task_id="m1", environment="math", prompt="p", params={})
    with pytest.raises(BadRequestError, match="this server runs 'workplace'"):
        await start(client, base_url, "r2", task=math_task)


async def test_same_idempotency_key_replays_the_first_result_and_applies_once(
    client: HttpClient, base_url: str
) -> None:
    await start(client, base_url)
    url = f"{base_url}/tools/calendar_create_event"
    first = await client.post_json(url, call(0, 0, SYNC))
    assert first["is_error"] is False and first["replayed"] is False
    # Another attempt of the same rollout, the same call (key order and spacing do not
    # count): the stored first result.
    again = call(0, 0, json.dumps(dict(reversed(SYNC.items())), indent=2))
    again["episode"]["attempt"] = 1
    second = await client.post_json(url, again)
    assert second == {**first, "replayed": True}
    assert [e["title"] for e in await search(client, base_url, 1, "")] == ["Team sync"]
    # A new key applies again.
    await client.post_json(url, call(2, 0, DEMO))
    assert [e["title"] for e in await search(client, base_url, 3, "")] == ["Team sync", "Demo"]


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("email_send", {"to": "b@example.com", "subject": "s", "body": "b"}),  # another tool
        ("calendar_create_event", DEMO),  # other arguments
        ("calendar_create_event", '{"title": "Team sync"'),  # malformed arguments
    ],
)
async def test_same_idempotency_key_other_tool_or_arguments_is_409_and_runs_nothing(
    client: HttpClient, base_url: str, tool: str, arguments: Any
) -> None:
    await start(client, base_url)
    first = await client.post_json(f"{base_url}/tools/calendar_create_event", call(0, 0, SYNC))
    assert first["is_error"] is False
    async with httpx.AsyncClient() as raw:
        reply = await raw.post(f"{base_url}/tools/{tool}", json=call(0, 0, arguments))
    assert reply.status_code == 409
    error = reply.json()["error"]
    assert error["code"] == "idempotency_conflict" and error["retryable"] is False
    assert "rollout 'r1', turn 0, call 0" in error["message"]
    # Nothing ran: no second event, no email sent.
    assert [e["title"] for e in await search(client, base_url, 1, "")] == ["Team sync"]
    sent = await client.post_json(f"{base_url}/tools/email_list_sent", call(2, 0, {}))
    assert json.loads(sent["content"]) == []


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        (
            "calendar_create_event",
            {**SYNC, "date": "2025-13-01"},
            "argument 'date': must be a valid date",
        ),
        ("calendar_create_event", {"title": "x"}, "missing required argument 'date'"),
        ("email_send", {"to": "nobody", "subject": "s", "body": "b"}, "containing '@'"),
        ("calendar_teleport", {}, "unknown tool 'calendar_teleport'"),
        ("calendar_search_events", '{"query": "sync"', "arguments are not valid JSON: "),
        ("calendar_search_events", "[1, 2]", "arguments must be a JSON object, got list"),
    ],
)
async def test_bad_calls_are_tool_errors_for_the_model_not_server_errors(
    client: HttpClient, base_url: str, tool: str, arguments: Any, message: str
) -> None:
    await start(client, base_url)
    reply = await client.post_json(f"{base_url}/tools/{tool}", call(0, 0, arguments))
    assert reply["is_error"] is True
    assert message in reply["content"]
    # The error is the first result of its key, like any other.
    replay = await client.post_json(f"{base_url}/tools/{tool}", call(0, 0, arguments))
    assert replay == {**reply, "replayed": True}
    assert await search(client, base_url, 1, "") == []


async def test_empty_arguments_mean_none(client: HttpClient, base_url: str) -> None:
    await start(client, base_url)
    reply = await client.post_json(f"{base_url}/tools/email_list_sent", call(0, 0, ""))
    assert reply == {"content": "[]", "is_error": False, "replayed": False}


async def test_an_episode_never_started_is_404_naming_the_rollout(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as raw:
        reply = await raw.post("/tools/email_list_sent", json=call(0, 0, {}, rollout_id="r404"))
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["code"] == "not_found"
        assert "'r404'" in error["message"]
        verify = await raw.post("/episodes/verify", json={"episode": episode("r404")})
        assert verify.status_code == 404


async def test_unknown_episode_comes_back_typed_through_the_client(
    client: HttpClient, base_url: str
) -> None:
    with pytest.raises(NotFoundError, match="r404"):
        await client.post_json(
            f"{base_url}/tools/email_list_sent", call(0, 0, {}, rollout_id="r404")
        )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"episode": episode(), "call_index": 0, "arguments": "{}"}, "turn"),
        ({**call(0, 0, {}), "call_index": -1}, "call_index"),
        ({**call(0, 0, {}), "episode": {"rollout_id": "bad id!"}}, "episode.rollout_id"),
        ({**call(0, 0, {}), "arguments": {"query": "x"}}, "arguments"),
        ({**call(0, 0, {}), "extra": 1}, "extra"),
    ],
)
async def test_a_malformed_body_is_400_naming_the_field(
    base_url: str, body: dict[str, Any], field: str
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as raw:
        reply = await raw.post("/tools/email_list_sent", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "bad_request"
    assert f"'{field}'" in error["message"]


async def test_verify_scores_the_episode_and_release_drops_it(
    client: HttpClient, base_url: str, app: FastAPI
) -> None:
    task = TaskRow(
        task_id="w1",
        environment="workplace",
        prompt="p",
        params={"events": [SYNC], "emails": []},
    )
    await start(client, base_url, task=task)
    verify_url = f"{base_url}/episodes/verify"
    assert (await client.post_json(verify_url, {"episode": episode()}))["reward"] == 0.0
    await client.post_json(f"{base_url}/tools/calendar_create_event", call(0, 0, SYNC))
    reply = await client.post_json(verify_url, {"episode": episode(), "final_message": "Done."})
    assert reply["reward"] == 1.0
    assert reply["detail"]["events_ok"] == 1

    release_url = f"{base_url}/episodes/release"
    assert await client.post_json(release_url, {"rollout_ids": ["r1", "r-unknown"]}) == {
        "released": 1
    }
    assert resources_service(app).episode_count == 0
    with pytest.raises(NotFoundError):
        await client.post_json(verify_url, {"episode": episode()})
    assert await client.post_json(release_url, {"rollout_ids": ["r1"]}) == {"released": 0}


async def test_a_frozen_server_holds_tool_calls_until_thawed(
    client: HttpClient, base_url: str, app: FastAPI
) -> None:
    service = resources_service(app)
    await start(client, base_url)
    await client.post_json(f"{base_url}/test/freeze", {})
    pending = asyncio.create_task(
        client.post_json(f"{base_url}/tools/calendar_create_event", call(0, 0, SYNC))
    )
    for _ in range(500):
        if service.waiting == 1:
            break
        await asyncio.sleep(0.005)
    assert service.waiting == 1
    await asyncio.sleep(0.05)
    assert not pending.done()
    assert service.frozen and service.in_flight == 0
    # While frozen, nothing was applied.
    assert (
        WorkplaceEnvironment()
        .verify(service._episodes["r1"].state, TASK, None)
        .detail["duplicates"]
        == []
    )
    await client.post_json(f"{base_url}/test/thaw", {})
    reply = await asyncio.wait_for(pending, timeout=5)
    assert reply["is_error"] is False
    assert service.waiting == 0
    assert [e["title"] for e in await search(client, base_url, 1, "sync")] == ["Team sync"]


async def test_export_then_install_into_a_fresh_server_reproduces_state_and_idempotency(
    client: HttpClient, base_url: str, app: FastAPI
) -> None:
    await start(client, base_url, "r1")
    await start(client, base_url, "r2")
    create_url = f"{base_url}/tools/calendar_create_event"
    first = await client.post_json(create_url, call(0, 0, SYNC))
    await client.post_json(create_url, call(0, 1, DEMO))
    await client.post_json(create_url, call(0, 0, DEMO, rollout_id="r2"))
    before = await search(client, base_url, 1, "")

    records = orjson.loads(orjson.dumps(resources_service(app).export(["r1", "r2"])))
    assert [r["rollout_id"] for r in records] == ["r1", "r2"]
    fresh = create_resources_app("workplace", replica="replica-1")
    assert resources_service(fresh).install(records) == ["r1", "r2"]
    with serve_app(fresh) as other_url:
        assert await search(client, other_url, 1, "") == before
        replay = await client.post_json(
            f"{other_url}/tools/calendar_create_event", call(0, 0, SYNC)
        )
        assert replay == {**first, "replayed": True}
        # The fingerprint came back with the table: the same key for another call is refused.
        with pytest.raises(IdempotencyConflictError, match="turn 0, call 0"):
            await client.post_json(f"{other_url}/tools/calendar_create_event", call(0, 0, DEMO))
        assert await search(client, other_url, 5, "") == before
        # The copy and the original are independent from here on.
        await client.post_json(
            f"{other_url}/tools/calendar_create_event", call(6, 0, {**SYNC, "title": "New"})
        )
        assert len(await search(client, other_url, 7, "")) == 3
    assert await search(client, base_url, 7, "") == before


def _start(rollout_id: str) -> EpisodeStart:
    return EpisodeStart(episode=EpisodeId(rollout_id=rollout_id), task=TASK)


def _tool_call(rollout_id: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall.model_validate(call(0, 0, arguments, rollout_id=rollout_id))


def test_export_of_an_unknown_rollout_names_it() -> None:
    service = ResourcesService(WorkplaceEnvironment())
    with pytest.raises(NotFoundError, match="r9"):
        service.export(["r9"])


async def test_install_is_all_or_nothing() -> None:
    source = ResourcesService(WorkplaceEnvironment())
    for rollout_id in ("r1", "r2"):
        await source.start(_start(rollout_id))
    await source.call_tool("calendar_create_event", _tool_call("r1", SYNC))
    good = source.export(["r1", "r2"])
    target = ResourcesService(WorkplaceEnvironment())
    await target.start(_start("r1"))
    live = target.export(["r1"])

    broken_state = {**good[1], "state": {"sqlite": base64.b64encode(b"garbage").decode()}}
    cases: list[tuple[list[dict[str, Any]], str]] = [
        ([good[0], broken_state], "record 1 (rollout r2): workplace state"),
        ([good[0], good[0]], "records repeat rollouts r1"),
        ([good[0], {**good[1], "environment": "math"}], "record 1 (rollout r2) is for 'math'"),
        ([good[0], {**good[1], "surprise": True}], "record 1: field 'surprise'"),
        ([{**good[0], "tool_results": good[0]["tool_results"] * 2}], "repeats an idempotency key"),
    ]
    for records, message in cases:
        with pytest.raises(InvalidCheckpointStateError, match=re.escape(message)):
            target.install(records)
        assert target.rollout_ids() == ["r1"]
        assert target.export(["r1"]) == live

    assert target.install(good) == ["r1", "r2"]
    assert target.export(["r1", "r2"]) == good


def test_an_unknown_environment_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="valid: blackjack, math, workplace"):
        create_resources_app("chess")


async def test_blackjack_plays_over_http_and_a_finished_hand_is_a_tool_error() -> None:
    task = BlackjackEnvironment().make_tasks(1, seed=0)[0]
    with serve_app(create_resources_app("blackjack")) as url:
        async with HttpClient(timeout_s=10) as client:
            await _play_one_blackjack_hand(client, url, task)


async def _play_one_blackjack_hand(client: HttpClient, url: str, task: TaskRow) -> None:
    await start(client, url, task=task)
    stand = await client.post_json(f"{url}/tools/blackjack_stand", call(0, 0, "{}"))
    assert json.loads(stand["content"])["done"] is True
    hit = await client.post_json(f"{url}/tools/blackjack_hit", call(1, 0, "{}"))
    assert hit["is_error"] is True and "the hand is over" in hit["content"]
    verdict = await client.post_json(f"{url}/episodes/verify", {"episode": episode()})
    outcome = json.loads(stand["content"])["outcome"]
    assert verdict["reward"] == {"win": 1.0, "draw": 0.5, "lose": 0.0}[outcome]


async def test_with_a_final_state_log_every_verify_logs_the_state_it_scored(
    tmp_path: Path,
) -> None:
    app = create_resources_app("workplace", replica="replica-3", final_states_dir=tmp_path)
    task = TaskRow(
        task_id="w1", environment="workplace", prompt="p", params={"events": [SYNC], "emails": []}
    )
    with serve_app(app) as url:
        async with HttpClient(timeout_s=10) as http:
            await start(http, url, task=task)
            verify_url = f"{url}/episodes/verify"
            await http.post_json(verify_url, {"episode": episode()})  # nothing created yet
            await http.post_json(f"{url}/tools/calendar_create_event", call(0, 0, SYNC))
            # A retried call under the same key is replayed, not applied again.
            await http.post_json(f"{url}/tools/calendar_create_event", call(0, 0, SYNC))
            await http.post_json(verify_url, {"episode": episode()})

    lines = (tmp_path / "resources-replica-3.jsonl").read_bytes().splitlines()
    assert len(lines) == 2
    states, unreadable = read_final_states(tmp_path)
    assert unreadable == []
    entry = states[("r1", 0)]  # the last verify of the attempt
    assert (entry.task_id, entry.environment, entry.line) == ("w1", "workplace", 2)
    env = WorkplaceEnvironment()
    state = env.restore_state(task, entry.state)
    assert env.side_effects(state) == {e: 1 for e in env.expected_side_effects(task)}
    first = env.restore_state(task, orjson.loads(lines[0])["state"])
    assert env.side_effects(first) == {}
