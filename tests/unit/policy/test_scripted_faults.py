"""The scripted policy's fault setting (``policy.faults``): which calls get which bad engine
data, what the data then is (refused by rollpoint's own stream check, naming the field), and
what it logs; strict, and off by default."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError

from rollpoint.policy.engine_check import START_CHECK_PROMPT
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.policy.stream_chunk_check import check_chunk
from rollpoint.protocol.engine_faults import BAD_VALUES, PADDING, TOKEN_DATA_HOWS, EngineFault
from rollpoint.protocol.errors import TransportError
from tests.unit.policy.fake_environments import MAIL, SYNC, WORKPLACE_TOOLS, workplace_prompt

TOKENS = {"return_token_ids": True, "logprobs": True}
TOOL_CALL = {
    "model": "scripted",
    "messages": [{"role": "user", "content": workplace_prompt([SYNC], [MAIL])}],
    "tools": WORKPLACE_TOOLS,
    "seed": 7,
    **TOKENS,
}
FINAL = {"model": "scripted", "messages": [{"role": "user", "content": "What is 17 * 23?"}]}


@asynccontextmanager
async def policy(tmp_path: Path, *faults: EngineFault) -> AsyncIterator[httpx.AsyncClient]:
    settings = PolicySettings(
        error_rate=0.0, faults=list(faults), fault_log=str(tmp_path / "faults.jsonl")
    )
    app = create_policy_app(settings)
    async with app.router.lifespan_context(app):  # opens the fault log
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://policy") as client:
            yield client


async def call(client: httpx.AsyncClient, body: dict[str, Any], **more: Any) -> bytes:
    response = await client.post("/v1/chat/completions", json={**body, **more})
    assert response.status_code == 200, response.text
    return response.content


def events(raw: bytes) -> list[dict[str, Any]]:
    return [
        orjson.loads(e.removeprefix(b"data: "))
        for e in raw.split(b"\n\n")
        if e.startswith(b"data: {")
    ]


def refusal(raw: bytes) -> str | None:
    """What rollpoint's stream check says of the stream (None: every chunk passes)."""
    try:
        for event in events(raw):
            check_chunk("vllm", event)
    except TransportError as exc:
        return exc.message
    return None


def logged(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "faults.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@pytest.mark.parametrize("how", TOKEN_DATA_HOWS)
async def test_bad_token_data_spoils_only_the_streamed_call_it_names(
    tmp_path: Path, how: str
) -> None:
    fault = EngineFault(corrupt="token_data", calls=[2], how=how)  # type: ignore[arg-type]
    async with policy(tmp_path, fault) as client:
        plain = await call(client, TOOL_CALL)  # not streamed: not one of its calls
        first = await call(client, TOOL_CALL, stream=True)
        second = await call(client, TOOL_CALL, stream=True)
        third = await call(client, TOOL_CALL, stream=True)

    assert refusal(first) is None and refusal(third) is None
    assert orjson.loads(plain)["choices"][0]["token_ids"]
    said = refusal(second)
    (line,) = logged(tmp_path)
    assert line["call"] == 2 and line["corrupt"] == "token_data" and line["how"] == how
    assert said is not None and said.startswith(f"vllm reply: chunk {line['field']} ")
    field = "token_ids" if how.startswith("id_") else "logprobs.content"
    assert line["field"].startswith(f"choices[0].{field}")
    # The bad value is on the wire as JSON has it (13.0 a float, "13" a string).
    assert orjson.dumps(BAD_VALUES[how]) in second
    assert line["reply_id"] == events(second)[0]["id"]


async def test_a_tool_call_loses_its_id_on_the_streamed_tool_call_it_names(
    tmp_path: Path,
) -> None:
    async with policy(tmp_path, EngineFault(corrupt="tool_call_id", calls=[1])) as client:
        final = await call(client, FINAL, stream=True)  # no tool call: not one of its calls
        spoiled = await call(client, TOOL_CALL, stream=True)
        clean = await call(client, TOOL_CALL, stream=True)

    assert refusal(final) is None and refusal(clean) is None
    assert refusal(spoiled) == (
        "vllm reply: chunk choices[0].delta.tool_calls[0].id is missing on the call's first "
        "delta: None"
    )
    (line,) = logged(tmp_path)
    assert line["field"] == "choices[0].delta.tool_calls[0].id"


async def test_an_oversized_reply_pads_the_content_of_the_call_it_names(tmp_path: Path) -> None:
    fault = EngineFault(corrupt="oversized_reply", calls=[2, 3], pad_bytes=100_000)
    async with policy(tmp_path, fault) as client:
        # The engine start check's probe is never counted: it is not an episode's call.
        probe = await call(client, {"model": "scripted", "messages": START_CHECK_PROMPT})
        replies = [await call(client, FINAL) for _ in range(2)]
        streamed = await call(client, FINAL, stream=True)
        after = await call(client, FINAL)

    assert PADDING.encode() not in probe
    contents = [orjson.loads(r)["choices"][0]["message"]["content"] for r in replies]
    assert PADDING not in contents[0]
    assert contents[1] == contents[0] + (PADDING * 5000)[:100_000]
    streamed_content = "".join(
        c["delta"].get("content") or "" for e in events(streamed) for c in e["choices"]
    )
    assert streamed_content == contents[1]  # the third of its calls
    assert PADDING.encode() not in after
    assert [(x["call"], x["field"]) for x in logged(tmp_path)] == [
        (2, "content padded by 100000 bytes"),
        (3, "content padded by 100000 bytes"),
    ]


async def test_no_faults_by_default(tmp_path: Path) -> None:
    assert PolicySettings().faults == []
    async with policy(tmp_path) as client:
        raw = await call(client, TOOL_CALL, stream=True)
    assert refusal(raw) is None
    assert not (tmp_path / "faults.jsonl").read_bytes()


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"corrupt": "token_data", "calls": [1]}, "how is required for token_data"),
        ({"corrupt": "tool_call_id", "calls": [1], "how": "id_float"}, "only for it"),
        ({"corrupt": "oversized_reply", "calls": [1]}, "pad_bytes is required"),
        ({"corrupt": "tool_call_id", "calls": [3, 2]}, "increasing call numbers"),
        ({"corrupt": "tool_call_id", "calls": [0]}, "greater than or equal to 1"),
        ({"corrupt": "tool_call_id", "calls": []}, "at least 1 item"),
        ({"corrupt": "token_data", "calls": [1], "how": "id_huge"}, "id_too_large"),
        ({"corrupt": "tool_call_id", "calls": [1], "share": 0.5}, "Extra inputs"),
    ],
)
def test_a_fault_setting_is_strict(fields: dict[str, Any], said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        EngineFault.model_validate(fields)
