"""The generation cut on loopback: scripted policy (vLLM's shape, one token a chunk) → model
server (in this test's loop, so its in-flight state can be cut while a call decodes).

A plain call streamed from the engine reaches its caller as the engine's own plain reply;
a call cut mid-generation is saved as its prefix, and after an install the replacement
call continues it: the stitched ids and logprobs equal the uninterrupted call's, the engine
decoded only the rest (its call log), and each segment carries its policy version. Each
refusal falls back to a from-scratch call, counted and recorded, never failing the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion

from rollpoint.envs.registry import get_environment
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.ids import (
    HEADER_ATTEMPT,
    HEADER_POLICY_VERSION,
    HEADER_ROLLOUT_ID,
    HEADER_TURN,
    EpisodeId,
)
from rollpoint.protocol.token_data import as_float32
from rollpoint.servers.model.generation_cut import HEADER_TOKEN_SEGMENTS, CallPrefix
from rollpoint.servers.model.model_participant import ModelParticipant
from rollpoint.servers.model.model_server import ModelServer, ModelServerSettings, create_model_app
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration

REASONING = 60
"""Stand-in reasoning tokens before the tool call: the generation to cut."""


def request(**more: Any) -> dict[str, Any]:
    env = get_environment("workplace")
    task = env.make_tasks(1, seed=3)[0]
    return {
        "model": "scripted",
        "messages": [{"role": "user", "content": task.prompt}],
        "tools": env.tools(),
        "seed": 11,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
        **more,
    }


def tags(rollout_id: str, attempt: int, turn: int = 0) -> dict[str, str]:
    return {HEADER_ROLLOUT_ID: rollout_id, HEADER_ATTEMPT: str(attempt), HEADER_TURN: str(turn)}


@contextmanager
def engine(tmp_path: Path, **settings: Any) -> Iterator[tuple[str, Path]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "engine.jsonl"
    policy = PolicySettings(
        seed=5,
        error_rate=0.0,
        call_log=str(log),
        reasoning_tokens=settings.pop("reasoning_tokens", REASONING),
        token_latency_ms=settings.pop("token_latency_ms", 10.0),
        **settings,
    )
    with serve_app(create_policy_app(policy)) as url:
        yield url, log


@dataclass
class Model:
    server: ModelServer
    participant: ModelParticipant
    http: httpx.AsyncClient


@asynccontextmanager
async def model(engine_url: str, **settings: Any) -> AsyncIterator[Model]:
    """A model server in this loop (its state is read and cut between awaits)."""
    app = create_model_app(
        ModelServerSettings(upstream_url=engine_url + "/v1", cut_generations=True, **settings)
    )
    server: ModelServer = app.state.model_server
    await server.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://model") as http:
            yield Model(server, ModelParticipant(server), http)
    finally:
        await server.stop()


def engine_log(log: Path) -> dict[str, Any]:
    return {line["id"]: line for line in map(orjson.loads, log.read_bytes().splitlines())}


async def cut_mid_generation(m: Model, body: dict[str, Any], *, tokens: int = 12) -> list[Any]:
    """Start a tagged call of r1 (attempt 0), snapshot it once ``tokens`` have arrived,
    then drop it (the crash); the snapshot's records."""
    call = asyncio.ensure_future(
        m.http.post("/v1/chat/completions", json=body, headers=tags("r1", 0), timeout=30)
    )
    for _ in range(3000):
        partials = list(m.server.partials.values())
        if partials and len(partials[0].ids) >= tokens:
            break
        await asyncio.sleep(0.002)
    else:
        raise AssertionError("the call never decoded enough tokens to cut")
    records = await m.participant.export([EpisodeId(rollout_id="r1")])
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    return records


def prefix_of(records: list[Any]) -> CallPrefix:
    (saved,) = [r for r in records if r["kind"] == "model_prefix"]
    assert saved["episode"] == {"rollout_id": "r1", "attempt": 0}
    return CallPrefix.model_validate(saved["prefix"])


async def restore_and_call(
    m: Model, records: list[Any], body: dict[str, Any], *, version: int = 0
) -> httpx.Response:
    """Install the snapshot's records in a fresh model server; the replacement call."""
    await m.participant.install(records, [EpisodeId(rollout_id="r1")])
    m.server.policy_version = version
    reply = await m.http.post("/v1/chat/completions", json=body, headers=tags("r1", 1), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply


async def test_a_plain_caller_gets_the_engines_plain_reply_byte_for_byte(tmp_path: Path) -> None:
    with engine(tmp_path, token_latency_ms=0.5) as (url, _):
        async with model(url) as m, httpx.AsyncClient() as direct:
            body = request()
            plain = await direct.post(url + "/v1/chat/completions", json=body)
            via = await m.http.post("/v1/chat/completions", json=body, headers=tags("r0", 0))
            assert via.status_code == 200
            mine, theirs = via.json(), plain.json()
            # The same call decoded twice: only the engine's id and clock differ.
            raw = via.content.replace(mine["id"].encode(), theirs["id"].encode())
            raw = raw.replace(
                f'"created":{mine["created"]}'.encode(), f'"created":{theirs["created"]}'.encode()
            )
            assert raw == plain.content
            # It was streamed from the engine: the engine's log shows a streamed request.
            assert m.server.ledger.calls("r0")[0].tokens is not None
            # The official client reads it as the same completion.
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=_app_of(m)))
            client = openai.AsyncOpenAI(base_url="http://model/v1", api_key="x", http_client=http)
            completion = await client.chat.completions.create(
                model="scripted",
                messages=body["messages"],
                tools=body["tools"],
                seed=body["seed"],
                logprobs=True,
                top_logprobs=2,
                extra_body={"return_token_ids": True},
                extra_headers=tags("r0", 0, 1),
            )
            await http.aclose()
            expected = ChatCompletion.model_validate(plain.json())
            assert completion.model_dump(exclude={"id", "created"}) == expected.model_dump(
                exclude={"id", "created"}
            )


def _app_of(m: Model) -> Any:
    transport = m.http._transport
    assert isinstance(transport, httpx.ASGITransport)
    return transport.app


async def test_a_cut_call_continues_from_its_prefix_as_if_never_cut(tmp_path: Path) -> None:
    with engine(tmp_path) as (url, log):
        body = request()
        async with httpx.AsyncClient() as direct:
            whole = (await direct.post(url + "/v1/chat/completions", json=body)).json()
        async with model(url) as first:
            first.server.policy_version = 3
            records = await cut_mid_generation(first, body)
        prefix = prefix_of(records)
        assert prefix.count >= 12 and prefix.text and prefix.digest_ok()
        assert [s.policy_version for s in prefix.segments] == [3]
        async with model(url) as second:
            reply = await restore_and_call(second, records, body, version=4)
            stitched = reply.json()
            ledger = second.server.ledger.calls("r1")
            stats = second.server.stats()["generation_cut"]
    (choice,) = stitched["choices"]
    (uninterrupted,) = whole["choices"]
    assert choice["token_ids"] == uninterrupted["token_ids"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [
        e["logprob"] for e in uninterrupted["logprobs"]["content"]
    ]
    assert choice["message"] == uninterrupted["message"]
    assert stitched["prompt_token_ids"] == whole["prompt_token_ids"]
    assert stitched["usage"] == whole["usage"]
    # The engine decoded only what followed the prefix, given the prefix as a prompt.
    continuation = engine_log(log)[stitched["id"]]
    assert continuation["prefix_token_ids"] == prefix.ids()
    assert continuation["choices"][0]["token_ids"] == uninterrupted["token_ids"][prefix.count :]
    assert continuation["request"]["continue_final_message"] is True
    assert continuation["request"]["add_generation_prompt"] is False
    # Two segments, each with its version; the reply says so, the ledger keeps it.
    rest = len(uninterrupted["token_ids"]) - prefix.count
    assert reply.headers[HEADER_TOKEN_SEGMENTS] == f"3:{prefix.count},4:{rest}"
    assert reply.headers[HEADER_POLICY_VERSION] == "4"
    (rec,) = ledger
    assert rec.tokens is not None and rec.tokens.completion() == uninterrupted["token_ids"]
    assert rec.tokens.logprobs() == as_float32(
        e["logprob"] for e in uninterrupted["logprobs"]["content"]
    )
    assert rec.segments is not None and [(s.policy_version, s.tokens) for s in rec.segments] == [
        (3, prefix.count),
        (4, rest),
    ]
    assert (rec.continued_tokens, rec.regenerated) == (prefix.count, None)
    assert stats == {"continued": 1, "continued_tokens": prefix.count, "regenerated": {}}


async def regenerated(
    tmp_path: Path,
    *,
    body: dict[str, Any] | None = None,
    replacement: dict[str, Any] | None = None,
    tamper: Any = None,
    version: int = 0,
    engine_settings: dict[str, Any] | None = None,
    model_settings: dict[str, Any] | None = None,
    cut_version: int = 0,
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Cut a call, restore, make the replacement call: (the recorded refusal, the reply,
    the uninterrupted reply). The replacement must be decoded from scratch."""
    body = body or request()
    with engine(tmp_path, **(engine_settings or {})) as (url, log):
        async with httpx.AsyncClient() as direct:
            whole = (await direct.post(url + "/v1/chat/completions", json=body)).json()
        async with model(url) as first:
            first.server.policy_version = cut_version
            records = await cut_mid_generation(first, body)
        if tamper is not None:
            records = tamper(records)
        async with model(url, **(model_settings or {})) as second:
            reply = await restore_and_call(second, records, replacement or body, version=version)
            (rec,) = second.server.ledger.calls("r1")
            stats = second.server.stats()["generation_cut"]
        logged = engine_log(log)[reply.json()["id"]]
    assert "prefix_token_ids" not in logged, "the replacement was continued"
    assert HEADER_TOKEN_SEGMENTS not in reply.headers
    assert rec.segments is None and rec.continued_tokens == 0
    assert rec.regenerated is not None
    assert stats["continued"] == 0 and stats["regenerated"] == {rec.regenerated: 1}
    return rec.regenerated, reply.json(), whole


async def test_constrained_decoding_is_regenerated(tmp_path: Path) -> None:
    for i, constraint in enumerate(
        (
            {"response_format": {"type": "json_object"}},
            {"tool_choice": {"type": "function", "function": {"name": "calendar_list_events"}}},
            {"structured_outputs": {"regex": "[a-z]+"}},
            {"regex": "[a-z]+"},
        )
    ):
        body = request(**constraint)
        reason, reply, whole = await regenerated(tmp_path / str(i), body=body)
        assert reason == "constrained_decoding", constraint
        # From scratch, the row goes on: the same completion as an uncut call.
        assert reply["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]


def _tampered(records: list[Any]) -> list[Any]:
    out = []
    for r in records:
        if r["kind"] == "model_prefix":
            r = {**r, "prefix": {**r["prefix"], "text": r["prefix"]["text"][:-4]}}
        out.append(r)
    return out


async def test_a_digest_mismatch_is_regenerated(tmp_path: Path) -> None:
    reason, reply, whole = await regenerated(tmp_path, tamper=_tampered)
    assert reason == "digest_mismatch"
    assert reply["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]


async def test_a_prefix_newer_than_the_engines_policy_is_regenerated(tmp_path: Path) -> None:
    reason, _, _ = await regenerated(tmp_path, cut_version=5, version=4)
    assert reason == "policy_newer"


async def test_an_engine_that_refuses_the_prefix_is_answered_from_scratch(tmp_path: Path) -> None:
    reason, reply, whole = await regenerated(tmp_path, engine_settings={"accept_prefix": False})
    assert reason == "engine_refused"
    assert reply["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]


async def test_an_engine_known_not_to_take_a_prefix_is_not_asked(tmp_path: Path) -> None:
    reason, _, _ = await regenerated(tmp_path, model_settings={"continue_prefixes": False})
    assert reason == "engine_unsupported"


async def test_a_prefix_inside_a_tool_call_is_regenerated(tmp_path: Path) -> None:
    # No reasoning text: the call's first tokens are its tool call.
    reason, _, _ = await regenerated(tmp_path, engine_settings={"reasoning_tokens": 0})
    assert reason == "tool_call"


def _split_character(records: list[Any]) -> list[Any]:
    """The prefix as a byte-level engine would cut it: its last token ends inside a
    character (the saved flag, with a digest that matches)."""
    out = []
    for r in records:
        if r["kind"] == "model_prefix":
            prefix = CallPrefix.model_validate(r["prefix"]).model_copy(
                update={"utf8_complete": False}
            )
            r = {**r, "prefix": prefix.model_dump(mode="json")}
        out.append(r)
    return out


async def test_a_prefix_ending_inside_a_utf8_character_is_regenerated(tmp_path: Path) -> None:
    reason, _, _ = await regenerated(tmp_path, tamper=_split_character)
    assert reason == "utf8_split"


async def test_a_prefix_that_used_the_token_budget_up_is_regenerated(tmp_path: Path) -> None:
    # (The scripted engine ignores max_tokens: the call is cut past its budget.)
    reason, _, _ = await regenerated(tmp_path, body=request(max_tokens=12))
    assert reason == "max_tokens"


async def test_a_replacement_asking_something_else_is_regenerated(tmp_path: Path) -> None:
    reason, reply, _ = await regenerated(tmp_path, replacement=request(seed=12))
    assert reason == "request_changed"
    assert reply["choices"][0]["token_ids"]


async def test_a_streamed_caller_is_cut_too_and_its_replacement_decoded_from_scratch(
    tmp_path: Path,
) -> None:
    # A caller that streams is relayed chunk by chunk; its partial output is known and saved
    # all the same, but a streamed replacement is relayed, not stitched: decoded anew.
    body = request(stream=True)
    with engine(tmp_path) as (url, log):
        async with model(url) as first:
            records = await cut_mid_generation(first, body)
        prefix = prefix_of(records)
        assert prefix.count >= 12 and prefix.digest_ok()
        async with model(url) as second:
            await second.participant.install(records, [EpisodeId(rollout_id="r1")])
            reply = await second.http.post(
                "/v1/chat/completions", json=body, headers=tags("r1", 1), timeout=30
            )
            assert reply.status_code == 200 and b"data: [DONE]" in reply.content
            (rec,) = second.server.ledger.calls("r1")
            stats = second.server.stats()["generation_cut"]
    assert (rec.regenerated, rec.segments, rec.continued_tokens) == ("streamed_caller", None, 0)
    assert stats == {"continued": 0, "continued_tokens": 0, "regenerated": {"streamed_caller": 1}}
    assert rec.completion_id is not None
    assert "prefix_token_ids" not in engine_log(log)[rec.completion_id]
