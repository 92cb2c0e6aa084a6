"""The control routes over HTTP (in-process ASGI): auth, strict bodies, the error envelope."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi.routing import APIRoute

from rollpoint.http.app import create_app
from rollpoint.participant.control_routes import mount_control_routes
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence import Fence
from rollpoint.protocol.control import CONTROL_PREFIX, MAX_CONTROL_BODY_BYTES, Phase, Verb
from rollpoint.protocol.errors import error_class_for
from tests.unit.participant.fake_participant import FakeParticipant

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def participant() -> FakeParticipant:
    p = FakeParticipant()
    p.state = {"r1#0": 4}
    return p


@pytest.fixture
async def fence(participant: FakeParticipant, tmp_path: Path) -> AsyncIterator[Fence]:
    f = Fence(participant, ControlSettings(token=TOKEN, snapshot_root=str(tmp_path)))
    yield f
    await f.aclose()


@pytest.fixture
async def client(fence: Fence, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app("participant")
    mount_control_routes(app, fence, ControlSettings(TOKEN, str(tmp_path)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://participant") as c:
        yield c


async def post(
    client: httpx.AsyncClient, verb: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    return await client.post(f"{CONTROL_PREFIX}/{verb}", json=body, headers=AUTH | (headers or {}))


def prepare_body(cid: str = "c1") -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 5}


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def test_every_verb_is_an_app_route_under_the_versioned_prefix(
    fence: Fence, tmp_path: Path
) -> None:
    # On the app's own router, built now: an included router would be built on the first
    # request (FastAPI >= 0.165), racing other servers in the process, and not listed here.
    app = create_app("participant")
    mount_control_routes(app, fence, ControlSettings(TOKEN, str(tmp_path)))
    paths = {r.path for r in app.routes if isinstance(r, APIRoute)}
    assert {p for p in paths if p.startswith(CONTROL_PREFIX)} == {
        f"{CONTROL_PREFIX}/{verb}" for verb in Verb
    }


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}, {"authorization": "Basic x"}],
)
async def test_without_the_token_every_verb_is_401_and_nothing_changes(
    client: httpx.AsyncClient, fence: Fence, participant: FakeParticipant, headers: dict[str, str]
) -> None:
    status = await client.get(f"{CONTROL_PREFIX}/status", headers=headers)
    assert status.status_code == 401 and error_of(status)["code"] == "unauthorized"
    reply = await client.post(f"{CONTROL_PREFIX}/prepare", json=prepare_body(), headers=headers)
    assert reply.status_code == 401 and error_of(reply)["code"] == "unauthorized"
    assert TOKEN not in reply.text
    assert fence.phase is Phase.IDLE and participant.calls["close_admission"] == 0


async def test_status_reports_the_participant(client: httpx.AsyncClient) -> None:
    reply = await client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)
    assert reply.status_code == 200
    body = reply.json()
    assert body["kind"] == "agent" and body["phase"] == "idle"
    assert body["protocol_version"] == 1 and body["counts"]["sessions"] == 1


async def test_a_save_over_http_prepares_commits_and_resumes(
    client: httpx.AsyncClient, fence: Fence, participant: FakeParticipant, tmp_path: Path
) -> None:
    prepared = await post(client, "prepare", prepare_body())
    assert prepared.status_code == 200 and prepared.json()["phase"] == "prepared"
    commit = prepare_body() | {"checkpoint_dir": "snap", "episode_ids": [{"rollout_id": "r1"}]}
    committed = await post(client, "commit", commit)
    assert committed.status_code == 200, committed.text
    assert committed.json()["manifest"]["count"] == 1
    assert (tmp_path / "snap" / "agent" / "agent-replica-0" / "manifest.json").exists()
    resumed = await post(client, "resume", {"checkpoint_id": "c1"})
    assert resumed.json() == {"phase": "idle", "checkpoint_id": "c1", "idempotent": False}
    again = await post(client, "resume", {"checkpoint_id": "c1"})
    assert again.json()["idempotent"] is True
    assert participant.admission_open


async def test_a_refusal_is_409_with_code_and_message(
    client: httpx.AsyncClient, fence: Fence
) -> None:
    await post(client, "prepare", prepare_body("c1"))
    reply = await post(client, "prepare", prepare_body("c2"))
    assert reply.status_code == 409
    assert error_of(reply)["code"] == "checkpoint_conflict" and "c1" in error_of(reply)["message"]
    renew = await post(client, "renew", prepare_body("c1") | {"deadline_ts": time.time() - 1})
    assert (renew.status_code, error_of(renew)["code"]) == (409, "deadline_exceeded")
    assert fence.checkpoint_id == "c1"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"checkpoint_id": "c1"}, "deadline_ts"),
        ({"checkpoint_id": "../x", "deadline_ts": 1e10}, "checkpoint_id"),
        ({"checkpoint_id": "c1", "deadline_ts": 1e10, "extra": 1}, "extra"),
        ({"checkpoint_id": "c1", "deadline_ts": "soon"}, "deadline_ts"),
    ],
)
async def test_malformed_bodies_are_400_naming_the_field_and_change_nothing(
    client: httpx.AsyncClient,
    fence: Fence,
    participant: FakeParticipant,
    body: dict[str, Any],
    field: str,
) -> None:
    reply = await post(client, "prepare", body)
    assert reply.status_code == 400 and field in error_of(reply)["message"]
    assert error_of(reply)["code"] == "bad_request"
    assert fence.phase is Phase.IDLE and participant.calls["close_admission"] == 0


@pytest.mark.parametrize(
    ("verb", "body", "field"),
    [
        ("prepare", {"checkpoint_id": "c1", "deadline_ts": "4000000000"}, "deadline_ts"),
        ("prepare", {"checkpoint_id": "c1", "deadline_ts": True}, "deadline_ts"),
        ("prepare", {"checkpoint_id": 7, "deadline_ts": 4e9}, "checkpoint_id"),
        ("ack", {"episode_ids": [{"rollout_id": "r1", "attempt": "1"}]}, "attempt"),
        ("ack", {"episode_ids": [{"rollout_id": "r1", "attempt": True}]}, "attempt"),
        ("ack", {"episode_ids": [{"rollout_id": "r1", "attempt": 1.0}]}, "attempt"),
        (
            "commit",
            {
                "checkpoint_id": "c1",
                "deadline_ts": 4e9,
                "checkpoint_dir": "d",
                "wait_for_write": "yes",
            },
            "wait_for_write",
        ),
        (
            "commit",
            {"checkpoint_id": "c1", "deadline_ts": 4e9, "checkpoint_dir": "d", "wait_for_write": 0},
            "wait_for_write",
        ),
    ],
)
async def test_the_strict_wire_coerces_nothing(
    client: httpx.AsyncClient,
    fence: Fence,
    participant: FakeParticipant,
    verb: str,
    body: dict[str, Any],
    field: str,
) -> None:
    reply = await post(client, verb, body)
    assert reply.status_code == 400, reply.text
    assert error_of(reply)["code"] == "bad_request" and field in error_of(reply)["message"]
    assert fence.phase is Phase.IDLE and participant.calls["close_admission"] == 0


@pytest.mark.parametrize(
    ("content", "headers", "code"),
    [
        (b'{"checkpoint_id": "c1"}', AUTH, "bad_request"),  # a missing field
        (b'{"checkpoint_id": "c1", "deadline_ts": "soon"}', AUTH, "bad_request"),
        (b'{"checkpoint_id": "c1", "deadl', AUTH, "bad_request"),  # cut short
        (b'{"checkpoint_id": "c1", "deadline_ts": 1e12}', AUTH, "bad_request"),  # horizon
        (
            b'{"checkpoint_id": "c1"}',
            {**AUTH, "content-type": "text/plain"},
            "unsupported_media_type",
        ),
        (b"{not json", {}, "unauthorized"),
    ],
)
async def test_a_malformed_request_gets_the_status_the_error_tree_gives_its_code(
    client: httpx.AsyncClient, content: bytes, headers: dict[str, str], code: str
) -> None:
    # One status per code: what the wire says is the tree's status for the code it sends.
    headers = {"content-type": "application/json"} | headers
    reply = await client.post(f"{CONTROL_PREFIX}/prepare", content=content, headers=headers)
    assert error_of(reply)["code"] == code, reply.text
    assert reply.status_code == error_class_for(code).status


async def test_the_openapi_document_gives_a_bad_body_the_wires_status_and_shape(
    client: httpx.AsyncClient,
) -> None:
    schema = (await client.get("/openapi.json")).json()
    prepare = schema["paths"][f"{CONTROL_PREFIX}/prepare"]["post"]["responses"]
    assert "422" not in prepare
    assert prepare[str(error_class_for("bad_request").status)]["content"]["application/json"]
    statuses = {
        s for item in schema["paths"].values() for op in item.values() for s in op["responses"]
    }
    assert "422" not in statuses and "HTTPValidationError" not in schema["components"]["schemas"]


async def test_a_json_integer_is_a_valid_deadline(client: httpx.AsyncClient, fence: Fence) -> None:
    reply = await post(
        client, "prepare", {"checkpoint_id": "c1", "deadline_ts": int(time.time()) + 5}
    )
    assert reply.status_code == 200, reply.text
    assert fence.phase is Phase.PREPARED


@pytest.mark.parametrize(
    ("content", "content_type", "status", "says"),
    [
        (
            b'{"checkpoint_id": "c1", "deadl',
            "application/json",
            400,
            "not valid JSON (truncated?): EOF",
        ),
        (b"{not json", "application/json", 400, "not valid JSON: key must be a string"),
        (b"", "application/json", 400, "(truncated?)"),
        ('{"checkpoint_id": "c1"}'.encode("utf-16"), "application/json", 400, "is not UTF-8"),
        (b'\xef\xbb\xbf{"checkpoint_id": "c1"}', "application/json", 400, "byte order mark"),
        (b'{"checkpoint_id": "c1"}', None, 415, "has no Content-Type"),
        (b'{"checkpoint_id": "c1"}', "text/plain", 415, "Content-Type is 'text/plain'"),
        (
            b'{"checkpoint_id": "c1"}',
            "application/json; charset=utf-16",
            415,
            "charset is 'utf-16'",
        ),
    ],
)
async def test_a_body_that_is_not_utf8_json_says_so_and_changes_nothing(
    client: httpx.AsyncClient,
    fence: Fence,
    participant: FakeParticipant,
    content: bytes,
    content_type: str | None,
    status: int,
    says: str,
) -> None:
    headers = AUTH | ({} if content_type is None else {"content-type": content_type})
    reply = await client.post(f"{CONTROL_PREFIX}/prepare", content=content, headers=headers)
    assert reply.status_code == status, reply.text
    code = "unsupported_media_type" if status == 415 else "bad_request"
    assert error_of(reply)["code"] == code and says in error_of(reply)["message"]
    assert fence.phase is Phase.IDLE and participant.calls["close_admission"] == 0


async def test_a_charset_of_utf8_is_fine(client: httpx.AsyncClient, fence: Fence) -> None:
    headers = AUTH | {"content-type": "application/json; charset=UTF-8"}
    content = orjson.dumps(prepare_body())
    reply = await client.post(f"{CONTROL_PREFIX}/prepare", content=content, headers=headers)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("deadline_ts", [1e12, 1796000000000.0])
async def test_a_deadline_past_the_horizon_is_refused_naming_it(
    client: httpx.AsyncClient, fence: Fence, participant: FakeParticipant, deadline_ts: float
) -> None:
    reply = await post(client, "prepare", {"checkpoint_id": "c1", "deadline_ts": deadline_ts})
    assert reply.status_code == 400, reply.text
    message = error_of(reply)["message"]
    assert "deadline_ts" in message and "max_deadline_ahead_s 3600" in message
    assert fence.phase is Phase.IDLE and participant.calls["close_admission"] == 0
    # Within the horizon it is taken.
    ok = await post(client, "prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 3000})
    assert ok.status_code == 200, ok.text


async def test_a_path_outside_the_root_is_400_naming_it(
    client: httpx.AsyncClient, fence: Fence, participant: FakeParticipant
) -> None:
    await post(client, "prepare", prepare_body())
    commit = prepare_body() | {"checkpoint_dir": "../../etc", "episode_ids": []}
    reply = await post(client, "commit", commit)
    assert reply.status_code == 400
    assert error_of(reply)["code"] == "bad_request" and "../../etc" in error_of(reply)["message"]
    assert fence.phase is Phase.PREPARED and participant.calls["export"] == 0


async def test_retire_forget_and_ack_over_http(
    client: httpx.AsyncClient, fence: Fence, participant: FakeParticipant
) -> None:
    retired = await post(client, "retire", {"episode_ids": [{"rollout_id": "r1", "attempt": 1}]})
    assert retired.json() == {"marks": {"r1": 1}, "outcomes": []}
    empty = await post(client, "retire", {"episode_ids": []})
    assert empty.status_code == 400 and "episode_ids" in error_of(empty)["message"]
    forgot = await post(client, "forget", {"rollout_ids": ["r1"]})
    assert forgot.json() == {"forgotten": ["r1"]}
    acked = await post(client, "ack", {"episode_ids": [{"rollout_id": "r9"}]})
    assert acked.json() == {"acked": []}


async def test_a_control_body_over_the_cap_is_413_and_is_not_read_whole(
    client: httpx.AsyncClient, fence: Fence, participant: FakeParticipant
) -> None:
    # Issue 33: an authenticated 400 MiB body was read whole and parsed.
    ids = b",".join(b'{"rollout_id":"r1","attempt":0}' for _ in range(1024))
    chunk = ids + b","
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"episode_ids":['
        while sent < 4 * MAX_CONTROL_BODY_BYTES:
            sent += len(chunk)
            yield chunk

    headers = AUTH | {"content-type": "application/json"}
    reply = await client.post(f"{CONTROL_PREFIX}/retire", content=endless(), headers=headers)
    assert reply.status_code == 413, reply.text[:300]
    assert error_of(reply)["code"] == "payload_too_large"
    assert f"over the {MAX_CONTROL_BODY_BYTES} bytes" in error_of(reply)["message"]
    assert sent < MAX_CONTROL_BODY_BYTES + 2 * len(chunk), "the body was read past the cap"
    declared = b" " * (MAX_CONTROL_BODY_BYTES + 1)
    reply = await client.post(f"{CONTROL_PREFIX}/prepare", content=declared, headers=headers)
    assert reply.status_code == 413, reply.text[:300]
    assert f"is {MAX_CONTROL_BODY_BYTES + 1} bytes" in error_of(reply)["message"]
    assert fence.phase is Phase.IDLE and participant.calls["close_admission"] == 0
    # A body under the cap is read as before.
    assert (await post(client, "prepare", prepare_body())).status_code == 200


async def test_a_client_that_hangs_up_mid_body_costs_one_line_not_a_traceback(
    fence: Fence, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 33: the server logged "Exception in ASGI application" with a traceback, which
    # uvicorn prints for any exception the app lets out; the app must not let one out.
    app = create_app("participant")
    mount_control_routes(app, fence, ControlSettings(TOKEN, str(tmp_path)))
    messages = [
        {"type": "http.request", "body": b'{"checkpoint_id":', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []
    path = f"{CONTROL_PREFIX}/prepare"

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"authorization", AUTH["authorization"].encode()),
            (b"content-type", b"application/json"),
            (b"content-length", b"1000"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    with caplog.at_level("INFO"):
        await app(scope, receive, send)  # raises ClientDisconnect without the handler
    assert any("went away before its request was read" in r.message for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= 40 or r.exc_info]
    assert fence.phase is Phase.IDLE
