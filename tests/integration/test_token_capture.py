"""Token capture on loopback: scripted policy (vLLM's shape) → model server → agent.

The agent sends the sampling settings and asks for token data on every policy call; every
model call of the reply, and every record of the model server's call ledger (streamed
calls too), carries exactly the ids and logprobs the engine logged for that call, with
each prompt stored as the suffix it adds. An engine reply with malformed token data fails
that call whole: the row fails as a transport failure naming the field and the engine, and
nothing of it is recorded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from rollpoint.app.config import SamplingConfig
from rollpoint.envs.registry import get_environment
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.episode import RunRow
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN, EpisodeId
from rollpoint.protocol.token_data import TokenTrace, as_float32
from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from rollpoint.servers.resources.resources_server import create_resources_app
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration

SAMPLING = SamplingConfig(
    temperature=0.7,
    top_p=0.9,
    max_tokens=256,
    stop=["</done>"],
    logprobs=True,
    top_logprobs=2,
    seed="turn",
    extra={"top_k": 20, "repetition_penalty": 1.05},
)


@contextmanager
def stack(engine_url: str, *, cut: bool = False) -> Iterator[tuple[str, str]]:
    """Model server (``cut``: with the generation cut) and agent (capture on) in front of
    ``engine_url``; their URLs."""
    with ExitStack() as servers:
        resources = servers.enter_context(serve_app(create_resources_app("workplace")))
        settings_ = ModelServerSettings(upstream_url=engine_url + "/v1", cut_generations=cut)
        model = servers.enter_context(serve_app(create_model_app(settings_)))
        settings = AgentSettings(
            model_url=model,
            resources_url=resources,
            environment="workplace",
            model_timeout_s=10,
            tool_timeout_s=5,
            sampling=SAMPLING.request_fields(),
            seed_policy=SAMPLING.seed,
            capture_tokens=True,
        )
        agent = servers.enter_context(serve_app(create_agent_app(settings)))
        yield model, agent


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "engine.jsonl"
    settings = PolicySettings(seed=2, error_rate=0.0, call_log=str(log))
    with serve_app(create_policy_app(settings)) as url:
        yield url, log


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


def rows(n: int, prefix: str) -> list[Any]:
    tasks = get_environment("workplace").make_tasks(n, seed=4)
    return [
        RunRow(
            task=t, group_id="g1", row=i, episode=EpisodeId(rollout_id=f"{prefix}{i}")
        ).model_dump(mode="json")
        for i, t in enumerate(tasks)
    ]


async def run(http: httpx.AsyncClient, agent: str, batch: list[Any]) -> list[Any]:
    async with http.stream("POST", agent + "/run", json={"rows": batch}) as reply:
        assert reply.status_code == 200
        return [orjson.loads(line) async for line in reply.aiter_lines() if line]


async def ledger(http: httpx.AsyncClient, model: str, rollout_id: str) -> list[Any]:
    reply = await http.get(model + "/rollpoint/v1/calls", params={"rollout_id": rollout_id})
    calls: list[Any] = reply.json()["calls"]
    return calls


def engine_log(log: Path) -> dict[str, Any]:
    lines = [orjson.loads(raw) for raw in log.read_bytes().splitlines()]
    return {line["id"]: line for line in lines}


def check_against_engine(calls: list[Any], logged: dict[str, Any]) -> None:
    """Each call's trace holds what the engine logged for it; prompts chain as suffixes."""
    context: list[int] = []
    for call in calls:
        entry = logged[call["completion_id"]]
        trace = TokenTrace.model_validate(call["tokens"])
        (choice,) = entry["choices"]
        assert trace.completion() == choice["token_ids"]
        assert trace.logprobs() == as_float32(choice["logprobs"])
        assert trace.prompt(context) == entry["prompt_token_ids"]
        assert trace.prompt_is_suffix == (call["turn"] > 0)
        context = [*entry["prompt_token_ids"], *choice["token_ids"]]


async def test_every_call_carries_the_sampling_settings_and_the_engines_tokens(
    engine: tuple[str, Path], http: httpx.AsyncClient
) -> None:
    engine_url, log = engine
    with stack(engine_url) as (model, agent):
        results = await run(http, agent, rows(3, "tc"))
        ledgers = {
            r["episode"]["rollout_id"]: await ledger(http, model, r["episode"]["rollout_id"])
            for r in results
        }
    logged = engine_log(log)
    assert {r["kind"] for r in results} == {"finished"}
    assert len(logged) == sum(r["turns"] for r in results)
    for entry in logged.values():
        asked = entry["request"]
        assert {k: asked.get(k) for k in ("temperature", "top_p", "max_tokens", "stop")} == {
            "temperature": 0.7,
            "top_p": 0.9,
            "max_tokens": 256,
            "stop": ["</done>"],
        }
        assert (asked["top_k"], asked["repetition_penalty"]) == (20, 1.05)
        assert asked["logprobs"] is True and asked["top_logprobs"] == 2
        assert asked["return_token_ids"] is True and isinstance(asked["seed"], int)
    # seed: turn gives each turn of an episode its own seed.
    for reply in results:
        seeds = [logged[c["completion_id"]]["request"]["seed"] for c in reply["model_calls"]]
        assert len(set(seeds)) == len(seeds)
        check_against_engine(reply["model_calls"], logged)
        recorded = ledgers[reply["episode"]["rollout_id"]]
        check_against_engine(recorded, logged)
        assert [c["tokens"] for c in recorded] == [c["tokens"] for c in reply["model_calls"]]
        assert [c["policy_version"] for c in recorded] == [
            c["policy_version"] for c in reply["model_calls"]
        ]
        assert all(c["logprobs"] is None for c in recorded)  # held packed in the trace


async def test_a_streamed_call_is_recorded_with_its_tokens(
    engine: tuple[str, Path], http: httpx.AsyncClient
) -> None:
    engine_url, log = engine
    body = {
        "model": "scripted",
        "messages": [{"role": "user", "content": "Book a room for Friday."}],
        "stream": True,
        "return_token_ids": True,
        "logprobs": True,
    }
    headers = {HEADER_ROLLOUT_ID: "s1", HEADER_ATTEMPT: "0", HEADER_TURN: "0"}
    with stack(engine_url) as (model, _):
        async with http.stream(
            "POST", model + "/v1/chat/completions", json=body, headers=headers
        ) as reply:
            assert reply.status_code == 200
            _ = [line async for line in reply.aiter_lines()]
        (call,) = await ledger(http, model, "s1")
    assert call["streamed"] is True
    check_against_engine([call], engine_log(log))


def broken_engine(change: Any) -> FastAPI:
    """An engine whose replies carry vLLM token fields, changed by ``change``."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Response:
        reply: dict[str, Any] = {
            "id": "chatcmpl-broken",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "done"},
                    "finish_reason": "stop",
                    "token_ids": [5, 6],
                    "logprobs": {
                        "content": [
                            {"token": "do", "logprob": -0.5, "bytes": None, "top_logprobs": []},
                            {"token": "ne", "logprob": -0.25, "bytes": None, "top_logprobs": []},
                        ]
                    },
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
        change(reply)
        return Response(orjson.dumps(reply), media_type="application/json")

    return app


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r["choices"][0]["token_ids"].append(7), "choices[0].logprobs.content"),
        (lambda r: r["choices"][0]["token_ids"].__setitem__(1, "6"), "choices[0].token_ids[1]"),
    ],
)
async def test_malformed_token_data_fails_the_row_and_records_nothing(
    http: httpx.AsyncClient, change: Any, field: str
) -> None:
    with serve_app(broken_engine(change)) as engine_url, stack(engine_url) as (model, agent):
        (result,) = await run(http, agent, rows(1, "bad"))
        recorded = await ledger(http, model, "bad0")
    assert result["kind"] == "failed" and result["transport"] is True, result
    assert f"vllm reply: {field}" in result["message"], result["message"]
    assert recorded == []


def _said_nothing(reply: dict[str, Any]) -> None:
    reply["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": []}


@pytest.mark.parametrize("cut", [False, True])
async def test_a_reply_with_neither_content_nor_tool_calls_fails_the_call_unrecorded(
    http: httpx.AsyncClient, cut: bool
) -> None:
    with (
        serve_app(broken_engine(_said_nothing)) as engine_url,
        stack(engine_url, cut=cut) as (
            model,
            agent,
        ),
    ):
        (result,) = await run(http, agent, rows(1, "empty"))
        recorded = await ledger(http, model, "empty0")
        # Untagged (no episode): the engine's reply is passed through as it came.
        plain = await http.post(model + "/v1/chat/completions", json={"messages": []})
    # A transport failure: the dispatcher re-sends the row; no turn holds an empty reply.
    assert result["kind"] == "failed" and result["transport"] is True, result
    assert "neither content nor tool calls" in result["message"], result["message"]
    assert recorded == []
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] is None


def _without_tokens(reply: dict[str, Any]) -> None:
    del reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    reply["choices"][0]["logprobs"] = None


def plain_engine() -> FastAPI:
    """An OpenAI-compatible engine that ignores the token fields (returns no ids)."""
    return broken_engine(_without_tokens)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


async def test_the_start_check_names_an_engine_without_ids(
    engine: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from rollpoint.policy.engine_check import check_token_capture
    from rollpoint.protocol.errors import LaunchError

    scripted, _ = engine
    kw: dict[str, Any] = {"engine": "vllm", "model": "scripted", "api_key": None}
    assert await check_token_capture(scripted + "/v1", required=True, **kw) is True
    with serve_app(plain_engine()) as url:
        assert await check_token_capture(url + "/v1", required=False, **kw) is False
        # Once: the CLI shows the library's warnings on the console (no print as well).
        (err,) = warnings_of(caplog)
        assert f"policy engine 'vllm' at {url}/v1 returns no token ids" in err
        with pytest.raises(LaunchError, match="capture_tokens is 'required'"):
            await check_token_capture(url + "/v1", required=True, **kw)


def slow_engine(delay_s: float) -> FastAPI:
    """An engine that answers with token ids, after ``delay_s`` (a long policy latency)."""
    app = FastAPI()
    inner = broken_engine(lambda reply: None)

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Response:
        await asyncio.sleep(delay_s)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=inner), base_url="http://engine"
        ) as client:
            reply = await client.post("/v1/chat/completions", content=await request.body())
        return Response(reply.content, media_type="application/json")

    return app


async def test_an_engine_slower_than_the_start_check_is_not_called_one_without_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rollpoint.policy.engine_check import check_token_capture
    from rollpoint.protocol.errors import LaunchError

    kw: dict[str, Any] = {"engine": "vllm", "model": "m", "api_key": None, "timeout_s": 0.3}
    with serve_app(slow_engine(1.0)) as url:
        assert await check_token_capture(url + "/v1", required=False, **kw) is None
        (err,) = warnings_of(caplog)
        assert f"could not check whether policy engine 'vllm' at {url}/v1 returns token ids" in err
        assert "no answer within 0.3s" in err and "token capture stays on" in err
        assert "returns no token ids" not in err
        with pytest.raises(
            LaunchError, match=r"could not check .*; policy.capture_tokens is 'required'"
        ):
            await check_token_capture(url + "/v1", required=True, **kw)
        # Given the time, the same engine is found to return ids.
        assert (
            await check_token_capture(url + "/v1", required=True, **{**kw, "timeout_s": 5}) is True
        )


@pytest.mark.parametrize("attempt", ["1" + "0" * 23, str(2**53 + 1), "1e23", "-1"])
async def test_an_episode_header_out_of_range_is_refused_with_a_400_naming_it(
    engine: tuple[str, Path], http: httpx.AsyncClient, attempt: str
) -> None:
    """Issue 33: ``x-rollpoint-attempt`` of 10**23 was taken, and broke every later commit
    of its rollout (an attempt an EpisodeId cannot hold)."""
    engine_url, _ = engine
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    headers = {HEADER_ROLLOUT_ID: "s9", HEADER_ATTEMPT: attempt, HEADER_TURN: "0"}
    with stack(engine_url) as (model, _):
        reply = await http.post(model + "/v1/chat/completions", json=body, headers=headers)
        assert reply.status_code == 400, reply.text
        assert HEADER_ATTEMPT in reply.json()["error"]["message"]
        assert await ledger(http, model, "s9") == []
