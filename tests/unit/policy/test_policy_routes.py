"""The scripted policy's HTTP routes, in process (``httpx.ASGITransport``)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from rollpoint.policy import scripted_policy
from rollpoint.policy.openai_wire import ChatCompletion, ChatCompletionChunk, ModelList
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.tuning import collector_schedule
from rollpoint.tuning.collector_schedule import CollectorSchedule
from tests.unit.policy.fake_environments import MAIL, SYNC, WORKPLACE_TOOLS, workplace_prompt

WORKPLACE = {
    "model": "scripted",
    "messages": [{"role": "user", "content": workplace_prompt([SYNC], [MAIL])}],
    "tools": WORKPLACE_TOOLS,
    "seed": 7,
}
MATH = {"model": "scripted", "messages": [{"role": "user", "content": "What is 17 * 23?"}]}


def client_for(settings: PolicySettings) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_policy_app(settings))
    return httpx.AsyncClient(transport=transport, base_url="http://policy")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(PolicySettings(error_rate=0.0, tokens_per_call=33)) as c:
        yield c


async def complete(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def sse_chunks(text: str) -> list[dict[str, Any]]:
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    return [orjson.loads(e.removeprefix("data: ")) for e in events[:-2]]


async def test_tool_call_is_in_openai_format(client: httpx.AsyncClient) -> None:
    before = int(time.time())
    reply = await complete(client, WORKPLACE)

    ChatCompletion.model_validate(reply)
    assert reply["id"].startswith("chatcmpl-")
    assert reply["object"] == "chat.completion"
    assert before <= reply["created"] <= time.time() + 1
    assert reply["model"] == "scripted"
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calendar_create_event"
    assert orjson.loads(call["function"]["arguments"]) == SYNC


async def test_final_answer_is_content_with_stop(client: httpx.AsyncClient) -> None:
    reply = await complete(client, MATH)
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "391"}


async def test_usage_counts_prompt_length_and_fixed_completion_tokens(
    client: httpx.AsyncClient,
) -> None:
    short = (await complete(client, MATH))["usage"]
    long_body = {**MATH, "messages": [{"role": "system", "content": "x" * 400}, *MATH["messages"]]}
    long = (await complete(client, long_body))["usage"]
    assert short["completion_tokens"] == long["completion_tokens"] == 33
    assert long["prompt_tokens"] >= short["prompt_tokens"] + 100
    for usage in (short, long):
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_same_request_same_message_new_response_id(client: httpx.AsyncClient) -> None:
    first, second = await complete(client, WORKPLACE), await complete(client, WORKPLACE)
    assert first["choices"] == second["choices"]
    assert first["id"] != second["id"]


async def test_stream_of_a_tool_call_rebuilds_the_plain_answer(client: httpx.AsyncClient) -> None:
    plain = await complete(client, WORKPLACE)
    response = await client.post("/v1/chat/completions", json={**WORKPLACE, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response.text)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        assert chunk["object"] == "chat.completion.chunk"
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "tool_calls"
    ]
    pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(pieces) > 2
    streamed = {
        "id": pieces[0]["id"],
        "type": pieces[0]["type"],
        "function": {
            "name": pieces[0]["function"]["name"],
            "arguments": "".join(p["function"]["arguments"] for p in pieces),
        },
    }
    assert [streamed] == plain["choices"][0]["message"]["tool_calls"]
    assert "usage" not in chunks[-1]


async def test_stream_of_content_with_usage_chunk(client: httpx.AsyncClient) -> None:
    body = {**MATH, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=body)
    chunks = sse_chunks(response.text)
    *answer, usage_chunk = chunks
    assert answer[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in answer) == "391"
    assert answer[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 33


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"model": "m"}', "'messages'"),
        (b'{"model": "m", "messages": "hello"}', "'messages'"),
        (b'{"model": "m", "messages": []}', "'messages'"),
        (b'{"messages": [{"content": "hi"}]}', "'messages.0.role'"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": "abc"}', "'seed'"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": 3}]}', "tools"),
        (b"not json", "'body'"),
        (b'["a", "list"]', "'body'"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "'body'"),
    ],
)
async def test_bad_request_gets_a_400_naming_the_field(
    client: httpx.AsyncClient, body: bytes, field: str
) -> None:
    response = await client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "bad_request"
    assert field in error["message"] and "\n" not in error["message"]


async def test_request_without_model_gets_the_configured_one() -> None:
    async with client_for(PolicySettings(model="tiny-scripted")) as c:
        reply = await complete(c, {"messages": MATH["messages"]})
    assert reply["model"] == "tiny-scripted"


async def test_models_lists_the_configured_model() -> None:
    async with client_for(PolicySettings(model="tiny-scripted")) as c:
        response = await c.get("/v1/models")
    assert response.status_code == 200
    listing = ModelList.model_validate(response.json())
    assert [m.id for m in listing.data] == ["tiny-scripted"]
    assert response.json()["object"] == "list"


async def test_latency_delays_each_call() -> None:
    async with client_for(PolicySettings(latency_ms=60)) as c:
        for stream in (False, True):
            started = time.perf_counter()
            response = await c.post("/v1/chat/completions", json={**MATH, "stream": stream})
            assert response.status_code == 200
            assert time.perf_counter() - started >= 0.06


async def test_zero_latency_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []

    async def record(delay: float) -> None:
        sleeps.append(delay)

    monkeypatch.setattr(scripted_policy, "asyncio", SimpleNamespace(sleep=record))
    async with client_for(PolicySettings(latency_ms=0)) as c:
        await complete(c, MATH)
    assert sleeps == []
    async with client_for(PolicySettings(latency_ms=5)) as c:
        await complete(c, MATH)
    assert sleeps == [0.005]


def test_settings_refuse_out_of_range_values() -> None:
    for bad in ({"error_rate": 1.5}, {"latency_ms": -1}, {"tokens_per_call": 0}, {"sed": 1}):
        with pytest.raises(ValueError):
            PolicySettings.model_validate(bad)


async def test_the_policy_runs_full_collections_only_while_no_call_is_in_flight(
    monkeypatch: pytest.MonkeyPatch, full_collections: list[int]
) -> None:
    monkeypatch.setattr(collector_schedule, "CHECK_EVERY_S", 0.01)
    thresholds = gc.get_threshold()
    ticks = itertools.count(step=collector_schedule.MIN_GAP_S)
    due = CollectorSchedule(lambda: next(ticks))  # a full collection is due at every check
    app = create_policy_app(PolicySettings(latency_ms=300), schedule=due)
    async with app.router.lifespan_context(app):
        assert gc.get_threshold()[2] > 10**9  # CPython's own full collections are off
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://policy"
        ) as client:
            body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
            call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.05)
            assert not call.done()
            full_collections.clear()  # any before the call arrived
            await asyncio.sleep(0.2)
            assert full_collections == []  # ~20 checks while the call sleeps
            assert (await call).status_code == 200
            for _ in range(200):
                if full_collections:
                    break
                await asyncio.sleep(0.01)
            assert full_collections, "no full collection once the call was answered"
    assert gc.get_threshold() == thresholds
