"""The agent server on loopback: scripted policy → model server → agent ← resources server.

Every server is real (uvicorn on 127.0.0.1, port 0). Checkpoint hooks the fence will drive
(gate, boundaries, export, install) are reached through test-only routes that run on each
server's own event loop, as the control routes will.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from rollpoint.envs.registry import get_environment
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.episode import RunRow
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.agent.agent_server import AgentSettings, agent_server_of, create_agent_app
from rollpoint.servers.model.model_server import (
    ModelServerSettings,
    create_model_app,
    model_server_of,
)
from rollpoint.servers.resources.resources_server import create_resources_app
from tests.support.live_server import serve_app
from tests.support.records import read_back

pytestmark = pytest.mark.integration

JsonDict = dict[str, Any]


# --- servers ------------------------------------------------------------------------------


def model_app(policy_url: str) -> FastAPI:
    app = create_model_app(ModelServerSettings(upstream_url=policy_url + "/v1"))
    server = model_server_of(app)

    @app.post("/test/gate/{action}")
    async def gate(action: str) -> JsonDict:
        server.gate.close() if action == "close" else server.gate.open()
        return {"open": server.gate.is_open}

    @app.post("/test/ledger/export")
    async def export(rollout_ids: list[str]) -> list[JsonDict]:
        return server.ledger.export(rollout_ids)

    @app.post("/test/ledger/install")
    async def install(records: list[JsonDict]) -> list[str]:
        return server.ledger.install(records)

    return app


def agent_app(settings: AgentSettings) -> FastAPI:
    app = create_agent_app(settings)
    book = agent_server_of(app).book

    @app.post("/test/boundaries/{action}")
    async def boundaries(action: str) -> JsonDict:
        book.close_boundaries() if action == "close" else book.open_boundaries()
        return {"open": book.boundaries_open}

    @app.post("/test/export")
    async def export(scope: list[EpisodeId]) -> list[Any]:
        records: list[Any] = read_back(book.export(scope))
        return records

    @app.post("/test/retire")
    async def retire(marks: dict[str, int]) -> list[Any]:
        return [o.model_dump(mode="json") for o in book.retire(marks)]

    @app.post("/test/install")
    async def install(records: list[JsonDict]) -> list[EpisodeId]:
        return book.install(records)

    return app


@dataclass
class Stack:
    resources: str
    model: str
    agent: str


@contextmanager
def serve_stack(
    policy_url: str,
    environment: str,
    *,
    resources_url: str | None = None,
    model_url: str | None = None,
    mode: CheckpointMode = CheckpointMode.TURN,
) -> Iterator[Stack]:
    with ExitStack() as stack:
        resources = resources_url or stack.enter_context(
            serve_app(create_resources_app(environment))
        )
        model = model_url or stack.enter_context(serve_app(model_app(policy_url)))
        settings = AgentSettings(
            model_url=model,
            resources_url=resources,
            environment=environment,  # type: ignore[arg-type]
            checkpoint_mode=mode,
            model_timeout_s=10,
            tool_timeout_s=5,
        )
        agent = stack.enter_context(serve_app(agent_app(settings)))
        yield Stack(resources, model, agent)


@pytest.fixture(scope="module")
def policy_url() -> Iterator[str]:
    settings = PolicySettings(seed=0, latency_ms=0, error_rate=0.0, tokens_per_call=8)
    with serve_app(create_policy_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def slow_policy_url() -> Iterator[str]:
    settings = PolicySettings(seed=0, latency_ms=150, error_rate=0.0, tokens_per_call=8)
    with serve_app(create_policy_app(settings)) as url:
        yield url


@pytest.fixture
def workplace(policy_url: str) -> Iterator[Stack]:
    with serve_stack(policy_url, "workplace") as stack:
        yield stack


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20) as client:
        yield client


# --- helpers ------------------------------------------------------------------------------


def rows(environment: str, n: int, *, prefix: str = "r", seed: int = 1) -> list[JsonDict]:
    tasks = get_environment(environment).make_tasks(n, seed=seed)
    return [
        RunRow(
            task=task, group_id="g1", row=i, episode=EpisodeId(rollout_id=f"{prefix}{i}")
        ).model_dump(mode="json")
        for i, task in enumerate(tasks)
    ]


def with_attempt(row: JsonDict, attempt: int) -> JsonDict:
    return {**row, "episode": {**row["episode"], "attempt": attempt}}


async def run(http: httpx.AsyncClient, agent: str, batch: list[JsonDict]) -> list[JsonDict]:
    async with http.stream("POST", agent + "/run", json={"rows": batch}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("application/x-ndjson")
        return [orjson.loads(line) async for line in reply.aiter_lines() if line]


async def ledger(http: httpx.AsyncClient, model: str, rollout_id: str) -> list[JsonDict]:
    reply = await http.get(model + "/rollpoint/v1/calls", params={"rollout_id": rollout_id})
    calls: list[JsonDict] = reply.json()["calls"]
    return calls


async def sessions(http: httpx.AsyncClient, agent: str) -> JsonDict:
    body: JsonDict = (await http.get(agent + "/rollpoint/v1/sessions")).json()
    return body


async def wait_sessions(http: httpx.AsyncClient, agent: str, **expected: Any) -> JsonDict:
    for _ in range(500):
        state = await sessions(http, agent)
        merged = {**state, **state["counts"]}
        if all(merged[k] == v for k, v in expected.items()):
            return state
        await asyncio.sleep(0.01)
    raise AssertionError(f"agent never reached {expected}: {state}")


async def wait_model(http: httpx.AsyncClient, model: str, **expected: Any) -> JsonDict:
    for _ in range(500):
        stats: JsonDict = (await http.get(model + "/rollpoint/v1/stats")).json()
        if all(stats[k] == v for k, v in expected.items()):
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"model server never reached {expected}: {stats}")


def check_transcript(reply: JsonDict) -> None:
    """user first; every assistant tool call answered by one tool message, in order."""
    messages = reply["messages"]
    assert messages[0]["role"] == "user"
    i = 1
    while i < len(messages):
        assert messages[i]["role"] == "assistant"
        calls = messages[i].get("tool_calls") or []
        answers = messages[i + 1 : i + 1 + len(calls)]
        assert [m["role"] for m in answers] == ["tool"] * len(calls)
        assert [m["tool_call_id"] for m in answers] == [c["id"] for c in calls]
        i += 1 + len(calls)
    assert not messages[-1].get("tool_calls")  # a final answer ends the episode


# --- tests --------------------------------------------------------------------------------


async def test_three_workplace_rows_finish_with_full_reward(
    workplace: Stack, http: httpx.AsyncClient
) -> None:
    batch = rows("workplace", 3)
    results = await run(http, workplace.agent, batch)
    assert sorted(r["episode"]["rollout_id"] for r in results) == ["r0", "r1", "r2"]
    for reply in results:
        assert reply["kind"] == "finished", reply
        assert (reply["reward"], reply["finish_reason"]) == (1.0, "final")
        check_transcript(reply)
        assistant = [m for m in reply["messages"] if m["role"] == "assistant"]
        assert len(reply["model_calls"]) == reply["turns"] == len(assistant)
        assert [c["turn"] for c in reply["model_calls"]] == list(range(reply["turns"]))

        calls = await ledger(http, workplace.model, reply["episode"]["rollout_id"])
        assert [(c["attempt"], c["turn"]) for c in calls] == [(0, t) for t in range(reply["turns"])]
        assert [c["response"] for c in calls] == [c["response"] for c in reply["model_calls"]]
    state = await sessions(http, workplace.agent)
    assert state["counts"]["finished_unacked"] == 3 and state["counts"]["live"] == 0


async def test_a_finished_row_sent_again_replays_its_reply_without_model_calls(
    workplace: Stack, http: httpx.AsyncClient
) -> None:
    batch = rows("workplace", 1)
    (first,) = await run(http, workplace.agent, batch)
    before = (await http.get(workplace.model + "/rollpoint/v1/stats")).json()["calls_total"]
    (again,) = await run(http, workplace.agent, batch)
    assert again == first
    after = (await http.get(workplace.model + "/rollpoint/v1/stats")).json()["calls_total"]
    assert after == before

    acked = await http.post(
        workplace.agent + "/rollpoint/v1/ack", json={"episodes": [first["episode"]]}
    )
    assert acked.json() == {"acked": [first["episode"]]}
    assert (await sessions(http, workplace.agent))["counts"]["finished_unacked"] == 0


async def test_a_client_that_goes_away_cancels_nothing(
    workplace: Stack, http: httpx.AsyncClient
) -> None:
    batch = rows("workplace", 1)
    await http.post(workplace.model + "/test/gate/close")
    async with http.stream("POST", workplace.agent + "/run", json={"rows": batch}) as reply:
        assert reply.status_code == 200
        await wait_sessions(http, workplace.agent, awaiting_model=1)
    # The stream is closed; the session keeps waiting for its policy call, then finishes.
    await http.post(workplace.model + "/test/gate/open")
    await wait_sessions(http, workplace.agent, finished_unacked=1, live=0)
    (reply_again,) = await run(http, workplace.agent, batch)
    assert reply_again["kind"] == "finished" and reply_again["reward"] == 1.0
    calls = await ledger(http, workplace.model, "r0")
    assert len(calls) == reply_again["turns"]


async def test_a_closed_model_gate_holds_sessions_at_a_boundary(
    workplace: Stack, http: httpx.AsyncClient
) -> None:
    await http.post(workplace.model + "/test/gate/close")
    streaming = asyncio.create_task(run(http, workplace.agent, rows("workplace", 2)))
    await wait_model(http, workplace.model, waiting=2)
    state = await wait_sessions(http, workplace.agent, awaiting_model=2)
    assert state["ready"] is True and state["blocker_count"] == 0
    assert not streaming.done()
    await http.post(workplace.model + "/test/gate/open")
    results = await asyncio.wait_for(streaming, 10)
    assert [r["kind"] for r in results] == ["finished", "finished"]


async def test_closed_boundaries_hold_replies_and_refuse_new_rows_until_reopened(
    workplace: Stack, http: httpx.AsyncClient
) -> None:
    await http.post(workplace.model + "/test/gate/close")
    streaming = asyncio.create_task(run(http, workplace.agent, rows("workplace", 2)))
    await wait_model(http, workplace.model, waiting=2)
    await http.post(workplace.agent + "/test/boundaries/close")
    await http.post(workplace.model + "/test/gate/open")
    # The replies arrive while boundaries are closed: held unapplied, the sessions stay
    # awaiting the model (a boundary), so the agent is ready to be cut.
    await wait_model(http, workplace.model, in_flight=0)
    assert len(await ledger(http, workplace.model, "r0")) == 1
    state = await wait_sessions(http, workplace.agent, awaiting_model=2, ready=True)
    assert state["counts"]["parked"] == 0

    (refused,) = await run(http, workplace.agent, rows("workplace", 1, prefix="late"))
    assert refused["kind"] == "refused" and refused["episode"]["rollout_id"] == "late0"
    assert not streaming.done()

    await http.post(workplace.agent + "/test/boundaries/open")
    results = await asyncio.wait_for(streaming, 10)
    assert [(r["kind"], r["reward"]) for r in results] == [("finished", 1.0)] * 2


async def test_a_resources_server_that_is_down_is_a_transport_failure(
    policy_url: str, http: httpx.AsyncClient
) -> None:
    with serve_app(create_resources_app("workplace")) as gone:
        pass  # served once, now closed: nothing listens there any more
    with serve_stack(policy_url, "workplace", resources_url=gone) as stack:
        (failure,) = await run(http, stack.agent, rows("workplace", 1))
    assert failure["kind"] == "failed"
    assert (failure["transport"], failure["code"]) == (True, "transport_error")


async def test_a_row_of_another_environment_fails_alone(
    workplace: Stack, http: httpx.AsyncClient
) -> None:
    batch = rows("workplace", 1) + rows("math", 1, prefix="m")
    results = {r["episode"]["rollout_id"]: r for r in await run(http, workplace.agent, batch)}
    assert results["m0"]["kind"] == "failed" and results["m0"]["transport"] is False
    assert "'math'" in results["m0"]["message"]
    assert (results["r0"]["kind"], results["r0"]["reward"]) == ("finished", 1.0)


async def cut_after_first_turns(http: httpx.AsyncClient, stack: Stack) -> None:
    """Let at least one turn finish, then close the gate and the boundaries."""
    for _ in range(500):
        if await ledger(http, stack.model, "r0"):
            break
        await asyncio.sleep(0.01)
    await http.post(stack.model + "/test/gate/close")
    await http.post(stack.agent + "/test/boundaries/close")


async def cut_during_a_call(http: httpx.AsyncClient, stack: Stack) -> None:
    """Hold turn 0 at the gate, close the boundaries, then let its reply arrive: the model
    records the call, the agent holds the reply unapplied (a generation cut)."""
    await wait_model(http, stack.model, waiting=1)
    await http.post(stack.agent + "/test/boundaries/close")
    await http.post(stack.model + "/test/gate/open")
    await wait_model(http, stack.model, in_flight=0, waiting=0)
    await http.post(stack.model + "/test/gate/close")


@pytest.mark.parametrize("cut", ["mid_episode", "reply_held"])
async def test_export_install_and_continue_does_not_redo_pre_cut_model_calls(
    cut: str, policy_url: str, slow_policy_url: str, http: httpx.AsyncClient
) -> None:
    (row,) = rows("workplace", 1, seed=1)  # 3 events and an email: many turns to cut between
    policy = slow_policy_url if cut == "mid_episode" else policy_url
    held = cut == "reply_held"
    with serve_app(create_resources_app("workplace")) as resources:
        # Before the crash: cut the episode at a turn boundary and export both servers.
        with serve_stack(policy, "workplace", resources_url=resources) as first:
            if held:
                await http.post(first.model + "/test/gate/close")
            streaming = asyncio.create_task(run(http, first.agent, [row]))
            if held:
                await cut_during_a_call(http, first)
            else:
                await cut_after_first_turns(http, first)
            await wait_model(http, first.model, in_flight=0)
            await wait_sessions(http, first.agent, ready=True)
            scope = [row["episode"]]
            agent_records = (await http.post(first.agent + "/test/export", json=scope)).json()
            model_records = (
                await http.post(first.model + "/test/ledger/export", json=["r0"])
            ).json()
            # "Crash": the old attempt stops for good (no side effect after the cut).
            retired = await http.post(first.agent + "/test/retire", json={"r0": 0})
            assert retired.json() == [{"episode": row["episode"], "outcome": "cancelled"}]
            await http.post(first.model + "/test/gate/open")
            (stopped,) = await asyncio.wait_for(streaming, 10)
            assert (stopped["kind"], stopped["code"]) == ("failed", "cancelled")
        (saved,) = [r for r in agent_records if r["kind"] == "session"]
        pre_cut = saved["turn"]
        assert saved["pending_response"] is None
        # The model may hold one call more than the agent applied: the cut turn's, whose
        # reply the agent held. The next attempt makes that call again and supersedes it.
        assert pre_cut <= len(model_records) <= pre_cut + 1
        if held:
            assert (pre_cut, len(model_records)) == (0, 1)
        else:
            assert pre_cut >= 1

        # After the crash: fresh model and agent servers, state installed, attempt 1 sent.
        with serve_stack(policy, "workplace", resources_url=resources) as second:
            await http.post(second.model + "/test/ledger/install", json=model_records)
            restored = await http.post(second.agent + "/test/install", json=agent_records)
            assert restored.json() == [{"rollout_id": "r0", "attempt": 1}]
            assert (await sessions(http, second.agent))["counts"]["restored"] == 1
            (reply,) = await run(http, second.agent, [with_attempt(row, 1)])
            calls = await ledger(http, second.model, "r0")

    # Reward 1.0 also proves no tool side effect ran twice: a duplicate event scores 0.
    assert reply["kind"] == "finished" and reply["reward"] == 1.0
    assert reply["episode"] == {"rollout_id": "r0", "attempt": 1}
    check_transcript(reply)
    turns = [(c["turn"], c["attempt"]) for c in reply["model_calls"]]
    assert turns == [(t, 0 if t < pre_cut else 1) for t in range(reply["turns"])]
    assert [(c["turn"], c["attempt"]) for c in calls] == turns  # each turn called once


async def test_a_blackjack_hand_is_played_to_the_end(
    policy_url: str, http: httpx.AsyncClient
) -> None:
    with serve_stack(policy_url, "blackjack") as stack:
        (reply,) = await run(http, stack.agent, rows("blackjack", 1))
    assert reply["kind"] == "finished", reply
    assert reply["finish_reason"] == "final" and reply["reward"] in (0.0, 0.5, 1.0)
    assert reply["turns"] >= 2  # status first, then at least one move
    check_transcript(reply)


async def test_a_math_row_is_answered_in_one_turn(policy_url: str, http: httpx.AsyncClient) -> None:
    with serve_stack(policy_url, "math", mode=CheckpointMode.RESTART_ONLY) as stack:
        (reply,) = await run(http, stack.agent, rows("math", 1))
    assert reply["kind"] == "finished", reply
    assert (reply["reward"], reply["turns"], reply["finish_reason"]) == (1.0, 1, "final")
    assert [m["role"] for m in reply["messages"]] == ["user", "assistant"]


async def test_tool_errors_reach_the_model_marked_and_the_policy_recovers(
    http: httpx.AsyncClient,
) -> None:
    # A policy that gets a third of its tool calls wrong: each wrong call must come back to
    # it as an error, so it retries the step and still completes the task.
    settings = PolicySettings(seed=3, latency_ms=0, error_rate=0.34, tokens_per_call=8)
    with serve_app(create_policy_app(settings)) as url, serve_stack(url, "workplace") as stack:
        replies = await run(http, stack.agent, rows("workplace", 6))
    tool_messages = [m for r in replies for m in r["messages"] if m["role"] == "tool"]
    errors = [m for m in tool_messages if str(m["content"]).startswith("error")]
    assert errors, "an error rate of 1/3 produced no tool error"
    unmarked = [
        m["content"]
        for m in tool_messages
        if not str(m["content"]).startswith(("error", "{", "["))  # results are JSON
    ]
    assert unmarked == [], f"tool errors reached the model unmarked: {unmarked[:3]}"
    assert all(r["kind"] == "finished" for r in replies)
    assert sum(r["reward"] for r in replies) / len(replies) > 0.8
