"""The scripted policy on a real uvicorn server, driven by the official ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest

from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration


def _tool(name: str, properties: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in properties.items()},
                "required": list(properties),
            },
        },
    }


TOOLS: Any = [
    _tool(
        "calendar_create_event",
        {
            "title": "string",
            "date": "string",
            "start_time": "string",
            "duration_minutes": "integer",
        },
    ),
    _tool("calendar_search_events", {"query": "string"}),
    _tool("email_send", {"to": "string", "subject": "string", "body": "string"}),
    _tool("email_list_sent", {}),
]
PROMPT = (
    "Schedule these events in my calendar, then search for each one to confirm it is there:\n"
    '- "Team sync" on 2025-01-15 at 10:00 for 30 minutes'
)
EVENT = {"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    settings = PolicySettings(seed=1, error_rate=0.0, tokens_per_call=21, model="scripted-test")
    with serve_app(create_policy_app(settings)) as url:
        yield url + "/v1"


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
        yield c


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["scripted-test"]


async def test_tool_call_turn_then_final_turn(client: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    first = await client.chat.completions.create(
        model="scripted-test", messages=messages, tools=TOOLS, seed=3
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "calendar_create_event"
    assert json.loads(call.function.arguments) == EVENT
    assert first.usage is not None and first.usage.completion_tokens == 21

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"created": EVENT})},
    ]
    second = await client.chat.completions.create(
        model="scripted-test", messages=messages, tools=TOOLS, seed=3
    )
    (search,) = second.choices[0].message.tool_calls or []
    assert search.function.name == "calendar_search_events"
    assert json.loads(search.function.arguments) == {"query": "Team sync"}

    messages += [
        second.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": search.id, "content": json.dumps([EVENT])},
    ]
    final = await client.chat.completions.create(
        model="scripted-test", messages=messages, tools=TOOLS, seed=3
    )
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None
    assert "Team sync" in (final.choices[0].message.content or "")


async def _streamed(client: openai.AsyncOpenAI, **request: Any) -> tuple[str, Any, str | None]:
    """Collect a stream's deltas into (content, tool calls by index, finish reason)."""
    content, calls, finish = "", {}, None
    stream = await client.chat.completions.create(stream=True, **request)
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


async def test_stream_gives_the_same_tool_call_as_the_plain_answer(
    client: openai.AsyncOpenAI,
) -> None:
    request: Any = {
        "model": "scripted-test",
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": TOOLS,
        "seed": 3,
    }
    plain = await client.chat.completions.create(**request)
    (call,) = plain.choices[0].message.tool_calls or []
    content, calls, finish = await _streamed(client, **request)
    assert finish == "tool_calls" and content == ""
    assert calls == {
        0: {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
    }

    # The SDK's own accumulator agrees.
    async with client.chat.completions.stream(**request) as stream:
        accumulated = await stream.get_final_completion()
    (rebuilt,) = accumulated.choices[0].message.tool_calls or []
    assert (rebuilt.id, rebuilt.function.name, rebuilt.function.arguments) == (
        call.id,
        call.function.name,
        call.function.arguments,
    )
    assert accumulated.choices[0].finish_reason == "tool_calls"


async def test_stream_gives_the_same_content_as_the_plain_answer(
    client: openai.AsyncOpenAI,
) -> None:
    request: Any = {
        "model": "scripted-test",
        "messages": [{"role": "user", "content": "What is 123 * 45? Answer with the number only."}],
    }
    plain = await client.chat.completions.create(**request)
    assert plain.choices[0].message.content == "5535"
    content, calls, finish = await _streamed(client, **request)
    assert (content, calls, finish) == ("5535", {}, "stop")


async def test_bad_request_is_a_client_error_not_a_crash(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model="scripted-test", messages=[])
    assert "messages" in str(raised.value)
