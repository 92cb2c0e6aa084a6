"""``rollpoint run`` with token capture, end to end: the scripted policy in vLLM's and in
SGLang's shape gives every trained row per-turn ids, logprobs and policy versions; an
engine whose replies sometimes carry malformed token data costs only those rows' tries,
which the dispatcher re-sends, and the run still trains every row once."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.trainer.train_hooks import TrainTurn, token_segments
from tests.integration.test_cli_run import rollpoint, train_lines, write_config
from tests.support.live_server import serve_app
from tests.support.train_schema import check_train_rows

pytestmark = pytest.mark.integration


def turns_of(line: dict[str, Any]) -> list[TrainTurn]:
    return [TrainTurn(**t) for t in line["turns"]]


def check_tokens(lines: list[dict[str, Any]]) -> None:
    check_train_rows(lines)  # the shipped schema, with token capture
    for line in lines:
        turns = turns_of(line)
        assert [t.turn for t in turns] == list(range(line["turn_count"]))
        for t in turns:
            assert t.completion_token_ids and t.completion_logprobs
            assert len(t.completion_token_ids) == len(t.completion_logprobs)
            assert isinstance(t.policy_version, int) and t.completion_id
        # The stand-in template extends every prompt: one sequence per episode.
        ((ids, mask),) = token_segments(turns)
        assert sum(mask) == sum(len(t.completion_token_ids or ()) for t in turns)
        assert len(ids) == len(mask)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_trained_row_carries_its_turns_tokens(tmp_path: Path, engine: str) -> None:
    config = write_config(
        tmp_path,
        replicas=1,
        policy={"latency_ms": 0, "error_rate": 0.1, "engine": engine, "capture_tokens": "required"},
    )
    done = rollpoint("run", str(config))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = train_lines(tmp_path / "run")
    assert len(lines) == 8
    check_tokens(lines)  # type: ignore[arg-type]


def corrupting_proxy(upstream: str, calls: set[int]) -> FastAPI:
    """Forwards to ``upstream``; the episode calls numbered in ``calls`` (from 1) get a
    non-integer id."""
    app = FastAPI()
    counter = itertools.count(1)
    app.state.corrupted = []

    @app.get("/v1/models")
    async def models() -> Response:
        async with httpx.AsyncClient() as client:
            reply = await client.get(upstream + "/v1/models")
        return Response(reply.content, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Response:
        # A plain-only engine: it answers a streamed request (the model server streams
        # every call for the generation cut) with plain JSON, which is what it corrupts.
        asked = orjson.loads(await request.body())
        asked.pop("stream", None)
        asked.pop("stream_options", None)
        body = orjson.dumps(asked)
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(
                upstream + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
        data = reply.json()
        probe = orjson.loads(body)["messages"][0]["content"] == "Say OK."
        if not probe and next(counter) in calls:
            data["choices"][0]["token_ids"][0] = "x"
            app.state.corrupted.append(data["id"])
        return Response(orjson.dumps(data), media_type="application/json")

    return app


@pytest.fixture
def engine_url() -> Iterator[str]:
    with serve_app(create_policy_app(PolicySettings(seed=1, error_rate=0.0))) as url:
        yield url


def test_malformed_token_data_fails_only_those_tries_and_they_are_sent_again(
    tmp_path: Path, engine_url: str
) -> None:
    # Two bad replies: a row hit by both still has a fresh try left (the dispatcher gives a
    # row three before it fails the group).
    proxy = corrupting_proxy(engine_url, {3, 11})
    with serve_app(proxy) as proxy_url:
        config = write_config(
            tmp_path,
            tasks=6,
            policy={"base_url": proxy_url + "/v1", "capture_tokens": "required"},
        )
        done = rollpoint("run", str(config))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    lines = train_lines(tmp_path / "run")
    rows = Counter((line["group_id"], line["row"]) for line in lines)
    assert len(rows) == 12 and set(rows.values()) == {1}, rows
    check_tokens(lines)  # type: ignore[arg-type]
    corrupted = set(proxy.state.corrupted)
    assert len(corrupted) == 2, "the proxy did not corrupt two replies"
    kept = {t["completion_id"] for line in lines for t in line["turns"]}  # type: ignore[union-attr]
    assert not corrupted & kept, "a call with malformed token data was kept"
    log = (tmp_path / "run" / "rollpoint.log").read_text()
    lost = [line for line in log.splitlines() if "re-sending under new rollout ids" in line]
    assert len(lost) == 2, lost
    assert all("vllm reply: choices[0].token_ids[0] is not a token id: 'x'" in x for x in lost)
