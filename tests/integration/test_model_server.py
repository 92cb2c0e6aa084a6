"""The model server on loopback in front of the scripted policy: proxy, gate, call ledger."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.ids import (
    HEADER_ATTEMPT,
    HEADER_POLICY_VERSION,
    HEADER_ROLLOUT_ID,
    HEADER_TURN,
)
from rollpoint.servers.model.model_server import (
    ModelServerSettings,
    create_model_app,
    model_server_of,
)
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration

PROMPT = (
    "Schedule these events in my calendar, then search for each one to confirm it is there:\n"
    '- "Team sync" on 2025-01-15 at 10:00 for 30 minutes'
)
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "calendar_create_event",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "date": {"type": "string"},
                    "start_time": {"type": "string"},
                    "duration_minutes": {"type": "integer"},
                },
                "required": ["title", "date", "start_time", "duration_minutes"],
            },
        },
    }
]
REQUEST: dict[str, Any] = {
    "model": "scripted",
    "messages": [{"role": "user", "content": PROMPT}],
    "tools": TOOLS,
    "seed": 3,
}


def episode_headers(rollout_id: str, attempt: int | str = 0, turn: int | str = 0) -> dict[str, str]:
    return {HEADER_ROLLOUT_ID: rollout_id, HEADER_ATTEMPT: str(attempt), HEADER_TURN: str(turn)}


def with_gate_routes(app: FastAPI) -> FastAPI:
    """Close and open the gate from the server's own event loop, as the fence will."""
    server = model_server_of(app)

    @app.post("/test/gate/{action}")
    async def gate(action: str) -> dict[str, bool]:
        server.gate.close() if action == "close" else server.gate.open()
        return {"open": server.gate.is_open}

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def policy_url() -> Iterator[str]:
    settings = PolicySettings(seed=1, error_rate=0.0, tokens_per_call=21)
    with serve_app(create_policy_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def slow_policy_url() -> Iterator[str]:
    settings = PolicySettings(seed=1, latency_ms=300, error_rate=0.0)
    with serve_app(create_policy_app(settings)) as url:
        yield url


@pytest.fixture
def model_url(policy_url: str) -> Iterator[str]:
    app = create_model_app(ModelServerSettings(upstream_url=policy_url + "/v1"))
    with serve_app(with_gate_routes(app)) as url:
        yield url


@pytest.fixture
async def http(model_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=model_url, timeout=10) as client:
        yield client


async def calls_of(http: httpx.AsyncClient, rollout_id: str) -> list[dict[str, Any]]:
    reply = await http.get("/rollpoint/v1/calls", params={"rollout_id": rollout_id})
    assert reply.status_code == 200
    calls: list[dict[str, Any]] = reply.json()["calls"]
    return calls


async def stats(http: httpx.AsyncClient) -> dict[str, Any]:
    reply = await http.get("/rollpoint/v1/stats")
    body: dict[str, Any] = reply.json()
    return body


async def test_a_call_with_episode_headers_is_proxied_and_recorded(
    http: httpx.AsyncClient, policy_url: str
) -> None:
    assert (await http.post("/rollpoint/v1/policy_version", json={"version": 7})).json() == {
        "policy_version": 7
    }
    reply = await http.post(
        "/v1/chat/completions", json=REQUEST, headers=episode_headers("r1", 2, 5)
    )
    assert reply.status_code == 200
    assert reply.headers[HEADER_POLICY_VERSION] == "7"
    direct = await http.post(policy_url + "/v1/chat/completions", json=REQUEST)
    message = reply.json()["choices"][0]["message"]
    assert message["tool_calls"] == direct.json()["choices"][0]["message"]["tool_calls"]

    (call,) = await calls_of(http, "r1")
    assert (call["rollout_id"], call["attempt"], call["turn"]) == ("r1", 2, 5)
    assert call["request_messages"] == 1
    assert call["last_message"] == REQUEST["messages"][-1]
    assert call["response"]["tool_calls"] == message["tool_calls"]
    assert call["finish_reason"] == "tool_calls"
    assert (call["completion_tokens"], call["policy_version"]) == (21, 7)
    assert call["prompt_tokens"] > 0 and call["latency_s"] > 0
    assert call["streamed"] is False


async def test_a_call_without_episode_headers_is_proxied_but_not_recorded(
    http: httpx.AsyncClient,
) -> None:
    reply = await http.post("/v1/chat/completions", json=REQUEST)
    assert reply.status_code == 200 and reply.json()["choices"]
    counts = await stats(http)
    assert (counts["calls_total"], counts["recorded_calls"]) == (1, 0)


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        (episode_headers("r1", attempt="one"), HEADER_ATTEMPT),
        (episode_headers("r1", turn="-1"), HEADER_TURN),
        ({HEADER_ATTEMPT: "0", HEADER_TURN: "0"}, HEADER_ROLLOUT_ID),
        (episode_headers("bad id!"), HEADER_ROLLOUT_ID),
    ],
)
async def test_bad_episode_headers_are_a_400_naming_the_header(
    http: httpx.AsyncClient, headers: dict[str, str], named: str
) -> None:
    reply = await http.post("/v1/chat/completions", json=REQUEST, headers=headers)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "bad_request" and named in error["message"]
    assert (await stats(http))["calls_total"] == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "scripted"}', "'messages' list"),
        (b"[1, 2]", "'messages' list"),
    ],
)
async def test_a_body_that_is_not_a_chat_request_is_a_400(
    http: httpx.AsyncClient, body: bytes, message: str
) -> None:
    reply = await http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400
    assert message in reply.json()["error"]["message"]


async def test_an_upstream_refusal_passes_through_with_its_status_and_body(
    http: httpx.AsyncClient, policy_url: str
) -> None:
    bad = {"model": "scripted", "messages": [], "seed": "not a number"}
    direct = await http.post(policy_url + "/v1/chat/completions", json=bad)
    assert 400 <= direct.status_code < 500
    reply = await http.post("/v1/chat/completions", json=bad, headers=episode_headers("r1"))
    assert (reply.status_code, reply.json()) == (direct.status_code, direct.json())
    assert await calls_of(http, "r1") == []


def test_an_upstream_that_is_down_is_a_502_transport_error() -> None:
    settings = ModelServerSettings(upstream_url=f"http://127.0.0.1:{free_port()}/v1")
    with serve_app(create_model_app(settings)) as url:
        for path, method in (("/v1/chat/completions", "POST"), ("/v1/models", "GET")):
            reply = httpx.request(method, url + path, json=REQUEST)
            assert reply.status_code == 502
            assert reply.json()["error"]["code"] == "transport_error"
        streamed = httpx.post(url + "/v1/chat/completions", json={**REQUEST, "stream": True})
        assert streamed.status_code == 502
        stats = httpx.get(url + "/rollpoint/v1/stats").json()
        assert stats["in_flight"] == 0


async def test_models_are_passed_through(http: httpx.AsyncClient, policy_url: str) -> None:
    reply = await http.get("/v1/models")
    assert reply.status_code == 200
    assert reply.json() == (await http.get(policy_url + "/v1/models")).json()


async def test_the_openai_client_works_through_the_proxy_plain_and_streamed(
    model_url: str, http: httpx.AsyncClient
) -> None:
    async with openai.AsyncOpenAI(base_url=model_url + "/v1", api_key="x", max_retries=0) as client:
        plain = await client.chat.completions.create(
            **REQUEST, extra_headers=episode_headers("plain")
        )
        (call,) = plain.choices[0].message.tool_calls or []
        assert call.function.name == "calendar_create_event"

        stream = await client.chat.completions.create(
            **REQUEST,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=episode_headers("streamed", 1, 0),
        )
        deltas: dict[int, dict[str, Any]] = {}
        finish = None
        async for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    entry = deltas.setdefault(delta.index, {"id": None, "arguments": ""})
                    entry["id"] = delta.id or entry["id"]
                    if delta.function is not None:
                        entry["name"] = delta.function.name or entry.get("name")
                        entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert json.loads(deltas[0]["arguments"]) == json.loads(call.function.arguments)

    (recorded,) = await calls_of(http, "streamed")
    assert recorded["streamed"] is True and recorded["attempt"] == 1
    assert recorded["finish_reason"] == "tool_calls"
    (tool_call,) = recorded["response"]["tool_calls"]
    assert tool_call["id"] == deltas[0]["id"]
    assert tool_call["function"] == {"name": deltas[0]["name"], "arguments": deltas[0]["arguments"]}
    assert recorded["completion_tokens"] > 0
    assert (await stats(http))["in_flight"] == 0


async def _wait_for(http: httpx.AsyncClient, **expected: Any) -> dict[str, Any]:
    for _ in range(500):
        current = await stats(http)
        if all(current[k] == v for k, v in expected.items()):
            return current
        await asyncio.sleep(0.01)
    raise AssertionError(f"stats never reached {expected}: {current}")


async def test_a_closed_gate_holds_new_calls_while_running_calls_finish(
    slow_policy_url: str,
) -> None:
    app = create_model_app(ModelServerSettings(upstream_url=slow_policy_url + "/v1"))
    with serve_app(with_gate_routes(app)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            running = asyncio.create_task(
                http.post("/v1/chat/completions", json=REQUEST, headers=episode_headers("a"))
            )
            await _wait_for(http, in_flight=1)
            await http.post("/test/gate/close")
            held = asyncio.create_task(
                http.post("/v1/chat/completions", json=REQUEST, headers=episode_headers("b"))
            )
            streamed = asyncio.create_task(
                http.post(
                    "/v1/chat/completions",
                    json={**REQUEST, "stream": True},
                    headers=episode_headers("c"),
                )
            )
            await _wait_for(http, waiting=2)
            assert (await running).status_code == 200  # admitted before the close: finishes
            closed = await _wait_for(http, in_flight=0, waiting=2)
            assert closed["gate_open"] is False
            assert not held.done() and not streamed.done()
            assert await calls_of(http, "b") == []

            await http.post("/test/gate/open")
            assert (await held).status_code == 200
            assert (await streamed).status_code == 200
            assert len(await calls_of(http, "b")) == 1
            assert len(await calls_of(http, "c")) == 1
            await _wait_for(http, in_flight=0, waiting=0, calls_total=3)
