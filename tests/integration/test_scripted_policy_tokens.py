"""The scripted policy speaks vLLM's token shapes to the official ``openai`` client: ``n`` > 1
choices, logprobs, ``return_token_ids`` ids, streamed and not, the same data in its call log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "list_events",
            "description": "List calendar events",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
MESSAGES: list[Any] = [{"role": "user", "content": "What is on my calendar on Monday?"}]
TOKEN_BODY = {"return_token_ids": True}


@pytest.fixture
def policy(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "calls.jsonl"
    settings = PolicySettings(seed=3, error_rate=0.0, call_log=str(log))
    with serve_app(create_policy_app(settings)) as url:
        yield url + "/v1", log


def log_lines(log: Path) -> list[Any]:
    return [orjson.loads(line) for line in log.read_bytes().splitlines()]


def test_n_choices_with_ids_and_logprobs(policy: tuple[str, Path]) -> None:
    url, log = policy
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,
        tools=TOOLS,
        n=3,
        seed=11,
        logprobs=True,
        top_logprobs=2,
        extra_body=TOKEN_BODY,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    extra = reply.model_extra or {}
    prompt = extra["prompt_token_ids"]
    assert isinstance(prompt, list) and all(isinstance(i, int) for i in prompt)
    total = 0
    for choice in reply.choices:
        ids = (choice.model_extra or {})["token_ids"]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert len(content) == len(ids) > 0
        assert all(-2.0 <= c.logprob < 0 and len(c.top_logprobs) == 2 for c in content)
        assert all(c.top_logprobs[0].logprob == c.logprob for c in content)
        total += len(ids)
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), total)
    (line,) = log_lines(log)
    assert line["id"] == reply.id and line["prompt_token_ids"] == prompt
    assert line["request"]["n"] == 3 and line["request"]["seed"] == 11
    for choice, logged in zip(reply.choices, line["choices"], strict=True):
        assert logged["token_ids"] == (choice.model_extra or {})["token_ids"]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert logged["logprobs"] == [c.logprob for c in choice.logprobs.content]


def test_logprobs_alone_and_token_id_strings(policy: tuple[str, Path]) -> None:
    url, _ = policy
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    plain = client.chat.completions.create(model="scripted", messages=MESSAGES, logprobs=True)
    choice = plain.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert "token_ids" not in (choice.model_extra or {})
    as_ids = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = as_ids.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(c.token.startswith("token_id:") for c in content)
    # Without logprobs or ids asked, nothing changes: logprobs null, no ids.
    bare = client.chat.completions.create(model="scripted", messages=MESSAGES)
    assert bare.choices[0].logprobs is None and "prompt_token_ids" not in (bare.model_extra or {})


async def test_a_stream_carries_the_same_tokens_as_the_whole_reply(
    policy: tuple[str, Path],
) -> None:
    url, _ = policy
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    asked: dict[str, Any] = {
        "model": "scripted",
        "messages": MESSAGES,
        "tools": TOOLS,
        "n": 2,
        "seed": 5,
        "logprobs": True,
        "extra_body": TOKEN_BODY,
    }
    whole = await client.chat.completions.create(**asked)
    ids: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    prompt = None
    finish: dict[int, str] = {}
    calls: dict[int, str] = {0: "", 1: ""}
    stream = await client.chat.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        prompt = prompt or (chunk.model_extra or {}).get("prompt_token_ids")
        for c in chunk.choices:
            ids[c.index] += (c.model_extra or {}).get("token_ids") or []
            if c.logprobs is not None and c.logprobs.content:
                logprobs[c.index] += [e.logprob for e in c.logprobs.content]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
            for call in c.delta.tool_calls or ():
                calls[c.index] += (call.function.arguments or "") if call.function else ""
    await client.close()
    assert prompt == (whole.model_extra or {})["prompt_token_ids"]
    for choice in whole.choices:
        assert ids[choice.index] == (choice.model_extra or {})["token_ids"]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert logprobs[choice.index] == [c.logprob for c in choice.logprobs.content]
        assert finish[choice.index] == choice.finish_reason
        if choice.message.tool_calls:
            assert calls[choice.index] == choice.message.tool_calls[0].function.arguments  # type: ignore[union-attr]


def test_the_next_prompt_extends_the_previous_prompt_and_completion(
    policy: tuple[str, Path],
) -> None:
    url, _ = policy
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    first = client.chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, seed=1, extra_body=TOKEN_BODY
    )
    message = first.choices[0].message
    following: list[Any] = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "user", "content": "And on Tuesday?"},
    ]
    second = client.chat.completions.create(
        model="scripted", messages=following, tools=TOOLS, seed=1, extra_body=TOKEN_BODY
    )
    context = (first.model_extra or {})["prompt_token_ids"] + (first.choices[0].model_extra or {})[
        "token_ids"
    ]
    prompt = (second.model_extra or {})["prompt_token_ids"]
    assert prompt[: len(context)] == context and len(prompt) > len(context)
