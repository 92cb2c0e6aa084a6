"""The model, agent and resources servers as checkpoint participants, over real HTTP.

Every server is real (uvicorn on 127.0.0.1, port 0) behind the real scripted policy; the
tests drive the control routes with the bearer token as a coordinator would: a staged cut
by hand (prepare model → agent → resources, commit, resume in reverse), a restore into
fresh servers, retire and forget, auth, and a restart-only agent.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from rollpoint.envs.registry import get_environment
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.participant.control_mount import control_fence
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.control import CONTROL_PREFIX
from rollpoint.protocol.episode import RunRow, TaskRow
from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN, EpisodeId
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.agent.agent_server import AgentSettings, agent_server_of, create_agent_app
from rollpoint.servers.agent.session_parts import join_parts
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from rollpoint.servers.resources.episode_record import EpisodeRecord
from rollpoint.servers.resources.resources_server import create_resources_app
from rollpoint.store.participant_state import read_participant_state
from tests.support.live_server import serve_app
from tests.support.polling import eventually

pytestmark = pytest.mark.integration

JsonDict = dict[str, Any]
TOKEN = "participants-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CUT_DIR = "cut1/participants"


# --- servers ------------------------------------------------------------------------------


@dataclass
class Replica:
    model: str
    agent: str
    resources: str
    agent_app: FastAPI

    def url(self, kind: str) -> str:
        url: str = getattr(self, kind)
        return url

    def live_episodes(self, rollout_ids: list[str]) -> list[EpisodeId]:
        """The attempts live on the agent (read while it is parked: nothing moves)."""
        book = agent_server_of(self.agent_app).book
        sessions = [book.session(r) for r in rollout_ids]
        return [s.episode for s in sessions if s is not None and s.is_live]


STAGES = ("model", "agent", "resources")
"""Prepare order; resume runs it backwards."""


@contextmanager
def serve_replica(
    policy_url: str,
    environment: str,
    root: Path,
    *,
    mode: CheckpointMode = CheckpointMode.TURN,
) -> Iterator[Replica]:
    snapshot_root = str(root)
    with ExitStack() as stack:
        resources = stack.enter_context(
            serve_app(create_resources_app(environment, snapshot_root=snapshot_root))
        )
        model_settings = ModelServerSettings(
            upstream_url=policy_url + "/v1", snapshot_root=snapshot_root
        )
        model = stack.enter_context(serve_app(create_model_app(model_settings)))
        agent_settings = AgentSettings(
            model_url=model,
            resources_url=resources,
            environment=environment,
            checkpoint_mode=mode,
            model_timeout_s=10,
            tool_timeout_s=5,
            snapshot_root=snapshot_root,
        )
        agent_app = create_agent_app(agent_settings)
        agent = stack.enter_context(serve_app(agent_app))
        yield Replica(model, agent, resources, agent_app)


def _policy(latency_ms: float) -> Iterator[str]:
    settings = PolicySettings(seed=0, latency_ms=latency_ms, error_rate=0.0, tokens_per_call=8)
    with serve_app(create_policy_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def slow_policy_url() -> Iterator[str]:
    yield from _policy(150)


@pytest.fixture(scope="module")
def policy_url() -> Iterator[str]:
    yield from _policy(0)


@pytest.fixture(autouse=True)
def control_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20) as client:
        yield client


# --- helpers ------------------------------------------------------------------------------


def rows(environment: str, n: int, *, prefix: str = "r", seed: int = 1) -> list[JsonDict]:
    tasks = get_environment(environment).make_tasks(n, seed=seed)
    return [
        RunRow(
            task=task,
            group_id="g1",
            row=i,
            episode=EpisodeId(rollout_id=f"{prefix}{i}"),
            max_turns=12,
        ).model_dump(mode="json")
        for i, task in enumerate(tasks)
    ]


def rollout_ids(batch: list[JsonDict]) -> list[str]:
    return [row["episode"]["rollout_id"] for row in batch]


def with_attempt(row: JsonDict, attempt: int) -> JsonDict:
    return {**row, "episode": {**row["episode"], "attempt": attempt}}


def deadline(seconds: float = 5.0) -> float:
    return time.time() + seconds


def wire(episodes: list[EpisodeId]) -> list[JsonDict]:
    return [e.model_dump(mode="json") for e in episodes]


async def control(
    http: httpx.AsyncClient, url: str, verb: str, body: JsonDict, *, token: str = TOKEN
) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"}
    return await http.post(f"{url}{CONTROL_PREFIX}/{verb}", json=body, headers=headers)


async def ok(http: httpx.AsyncClient, url: str, verb: str, body: JsonDict) -> JsonDict:
    reply = await control(http, url, verb, body)
    assert reply.status_code == 200, (verb, url, reply.text)
    payload: JsonDict = reply.json()
    return payload


async def status(http: httpx.AsyncClient, url: str) -> JsonDict:
    reply = await http.get(f"{url}{CONTROL_PREFIX}/status", headers=AUTH)
    assert reply.status_code == 200, reply.text
    payload: JsonDict = reply.json()
    return payload


async def prepare_all(
    http: httpx.AsyncClient, replica: Replica, cid: str, *, lease_s: float = 5.0
) -> dict[str, JsonDict]:
    """The staged prepare: each stage must be prepared before the next one starts.

    lease_s is the prepare deadline: a test that reads the servers' live state after the cut
    passes one long enough that the gates cannot reopen (deadline + lease grace) before it has.
    """
    due = deadline(lease_s)
    replies = {}
    for kind in STAGES:
        replies[kind] = await ok(
            http, replica.url(kind), "prepare", {"checkpoint_id": cid, "deadline_ts": due}
        )
        assert replies[kind]["phase"] == "prepared", (kind, replies[kind])
    return replies


async def resume_all(http: httpx.AsyncClient, replica: Replica, cid: str) -> None:
    for kind in reversed(STAGES):
        reply = await ok(http, replica.url(kind), "resume", {"checkpoint_id": cid})
        assert reply["phase"] == "idle"


async def commit_all(
    http: httpx.AsyncClient,
    replica: Replica,
    cid: str,
    scope: list[EpisodeId],
    *,
    lease_s: float = 5.0,
) -> dict[str, JsonDict]:
    body = {
        "checkpoint_id": cid,
        "deadline_ts": deadline(lease_s),
        "checkpoint_dir": CUT_DIR,
        "episode_ids": wire(scope),
    }
    return {kind: await ok(http, replica.url(kind), "commit", body) for kind in STAGES}


def saved(root: Path, kind: str, cid: str = "cut1") -> list[JsonDict]:
    instance = f"{kind}-replica-0"
    directory = str(root / CUT_DIR / kind / instance)
    _, records = read_participant_state(
        directory, kind=kind, instance=instance, checkpoint_id=cid, root=str(root)
    )
    return records


async def run(http: httpx.AsyncClient, agent: str, batch: list[JsonDict]) -> list[JsonDict]:
    async with http.stream("POST", agent + "/run", json={"rows": batch}) as reply:
        assert reply.status_code == 200
        return [orjson.loads(line) async for line in reply.aiter_lines() if line]


async def ledger(http: httpx.AsyncClient, model: str, rollout_id: str) -> list[JsonDict]:
    reply = await http.get(model + "/rollpoint/v1/calls", params={"rollout_id": rollout_id})
    calls: list[JsonDict] = reply.json()["calls"]
    return calls


async def every_rollout_called(http: httpx.AsyncClient, model: str, ids: list[str]) -> None:
    async def called() -> bool:
        return all([await ledger(http, model, r) for r in ids])

    await eventually(called, "every rollout made a policy call")


async def model_stats(http: httpx.AsyncClient, model: str) -> JsonDict:
    stats: JsonDict = (await http.get(model + "/rollpoint/v1/stats")).json()
    return stats


def tool_call(episode: JsonDict, turn: int, name: str, arguments: JsonDict) -> JsonDict:
    return {"episode": episode, "turn": turn, "call_index": 0, "arguments": json.dumps(arguments)}


def chat(prompt: str) -> JsonDict:
    return {"model": "scripted", "messages": [{"role": "user", "content": prompt}]}


def episode_headers(rollout_id: str, attempt: int, turn: int) -> dict[str, str]:
    return {HEADER_ROLLOUT_ID: rollout_id, HEADER_ATTEMPT: str(attempt), HEADER_TURN: str(turn)}


def calendar_titles(record: JsonDict) -> list[str]:
    db = sqlite3.connect(":memory:")
    try:
        state = EpisodeRecord.model_validate(record).exported_state()
        assert isinstance(state["sqlite"], str)
        db.deserialize(base64.b64decode(state["sqlite"]))
        return sorted(title for (title,) in db.execute("SELECT title FROM events"))
    finally:
        db.close()


def applied_creates(session: JsonDict) -> list[str]:
    """Titles of the calendar_create_event calls the session applied (answered, not errors)."""
    answered = {
        m["tool_call_id"]
        for m in session["messages"]
        if m["role"] == "tool" and not m["content"].startswith("error")
    }
    return sorted(
        json.loads(call["function"]["arguments"])["title"]
        for m in session["messages"]
        for call in m.get("tool_calls") or ()
        if call["function"]["name"] == "calendar_create_event" and call["id"] in answered
    )


def error_code(reply: httpx.Response) -> str:
    code: str = reply.json()["error"]["code"]
    return code


# --- a staged cut -------------------------------------------------------------------------


async def test_a_staged_cut_saves_what_the_servers_hold_and_the_rows_finish_after_resume(
    slow_policy_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with serve_replica(slow_policy_url, "workplace", tmp_path) as replica:
        batch = rows("workplace", 4)
        ids = rollout_ids(batch)
        running = asyncio.create_task(run(http, replica.agent, batch))
        await every_rollout_called(http, replica.model, ids)

        # The checks below read the model server's LIVE ledger: the lease must outlast them
        # on a loaded machine, or the gate reopens (deadline + grace) and further calls are
        # filed. Resume ends it early.
        await prepare_all(http, replica, "cut1", lease_s=120)
        scope = replica.live_episodes(ids)
        assert sorted(e.rollout_id for e in scope) == ids  # none could finish before the cut
        commits = await commit_all(http, replica, "cut1", scope, lease_s=120)
        assert {c["phase"] for c in commits.values()} == {"committed"}

        sessions = {r["episode"]["rollout_id"]: r for r in join_parts(saved(tmp_path, "agent"))}
        assert sorted(sessions) == ids and {r["kind"] for r in sessions.values()} == {"session"}
        model_records = saved(tmp_path, "model")
        assert {r["kind"] for r in model_records} == {"model_call"}
        resources = {r["rollout_id"]: r for r in saved(tmp_path, "resources")}
        assert sorted(resources) == ids
        for rollout_id, session in sessions.items():
            calls = [r["call"] for r in model_records if r["episode"]["rollout_id"] == rollout_id]
            # A call still running at the model's prepare (the generation cut lets it finish;
            # the agent holds its reply unapplied and saves the session as before it) is
            # filed before or after the commit's capture, depending on load: the saved
            # calls are the applied turns, plus at most that one of the unsaved turn.
            applied = session["turn"]
            assert applied >= 1
            assert [c["turn"] for c in calls] in (list(range(applied)), list(range(applied + 1)))
            # What the server held at the cut; one filed after the capture shows live only.
            live = await ledger(http, replica.model, rollout_id)
            assert calls == live[: len(calls)]
            assert [c["turn"] for c in live[len(calls) :]] in ([], [applied])
            assert len(live) <= applied + 1
            record = resources[rollout_id]
            assert record["kind"] == "episode_state" and record["episode"] == session["episode"]
            assert calendar_titles(record) == applied_creates(session)
            tool_messages = [m for m in session["messages"] if m["role"] == "tool"]
            assert len(record["tool_results"]) == len(tool_messages)
        assert commits["agent"]["exported"] == {
            f"{s['episode']['rollout_id']}#{s['episode']['attempt']}": s["turn"]
            for s in sessions.values()
        }

        await resume_all(http, replica, "cut1")
        results = await asyncio.wait_for(running, 15)
    assert sorted((r["episode"]["rollout_id"], r["kind"], r["reward"]) for r in results) == [
        (r, "finished", 1.0) for r in ids
    ]


async def test_while_prepared_calls_wait_unfailed_and_new_rows_are_refused(
    policy_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with serve_replica(policy_url, "workplace", tmp_path) as replica:
        (row,) = rows("workplace", 1, prefix="w")
        start = {"episode": row["episode"], "task": row["task"]}
        assert (await http.post(replica.resources + "/episodes/start", json=start)).is_success
        await prepare_all(http, replica, "hold")

        model_call = asyncio.create_task(
            http.post(
                replica.model + "/v1/chat/completions",
                json=chat(row["task"]["prompt"]),
                headers=episode_headers("w0", 0, 0),
            )
        )
        search = tool_call(row["episode"], 0, "calendar_search_events", {"query": "sync"})
        tool = asyncio.create_task(
            http.post(replica.resources + "/tools/calendar_search_events", json=search)
        )

        async def both_held() -> bool:
            model = (await status(http, replica.model))["counts"]
            resources = (await status(http, replica.resources))["counts"]
            return bool(model["waiting"] == 1 and resources["waiting"] == 1)

        await eventually(both_held, "the model call and the tool call wait at their gates")
        (refused,) = await run(http, replica.agent, rows("workplace", 1, prefix="late"))
        assert refused["kind"] == "refused" and refused["episode"]["rollout_id"] == "late0"
        assert not model_call.done() and not tool.done()

        await resume_all(http, replica, "hold")
        assert (await asyncio.wait_for(model_call, 5)).status_code == 200
        assert (await asyncio.wait_for(tool, 5)).json()["is_error"] is False
        (again,) = await run(http, replica.agent, rows("workplace", 1, prefix="late"))
        assert (again["kind"], again["reward"]) == ("finished", 1.0)


# --- restore ------------------------------------------------------------------------------


async def test_a_restore_into_fresh_servers_continues_every_episode_without_repeating_work(
    slow_policy_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    batch = rows("workplace", 3)
    ids = rollout_ids(batch)
    with serve_replica(slow_policy_url, "workplace", tmp_path) as first:
        running = asyncio.create_task(run(http, first.agent, batch))
        await every_rollout_called(http, first.model, ids)
        await prepare_all(http, first, "cut1")
        scope = first.live_episodes(ids)
        commits = await commit_all(http, first, "cut1", scope)
        # This replica is done with: reopen it so its servers can stop.
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await resume_all(http, first, "cut1")
    cut_turns = {
        key.rpartition("#")[0]: turns for key, turns in commits["agent"]["exported"].items()
    }
    assert sorted(cut_turns) == ids

    with serve_replica(slow_policy_url, "workplace", tmp_path) as fresh:
        body = {
            "checkpoint_id": "restore1",
            "source_checkpoint_id": "cut1",
            "deadline_ts": deadline(),
            "checkpoint_dir": CUT_DIR,
            "episode_ids": wire(scope),
        }
        next_attempts = wire([e.next_attempt() for e in scope])
        for kind in ("agent", "model", "resources"):
            restored = await ok(http, fresh.url(kind), "restore", body)
            assert (restored["phase"], restored["restored"]) == ("restored", next_attempts)
        for kind in ("resources", "model", "agent"):
            await ok(http, fresh.url(kind), "resume", {"checkpoint_id": "restore1"})

        (stale,) = await run(http, fresh.agent, batch[:1])  # the saved attempt itself
        assert (stale["kind"], stale["code"], stale["transport"]) == (
            "failed",
            "stale_attempt",
            False,
        )

        results = await run(http, fresh.agent, [with_attempt(row, 1) for row in batch])
        assert sorted((r["episode"]["rollout_id"], r["kind"], r["reward"]) for r in results) == [
            (r, "finished", 1.0) for r in ids
        ]
        tasks = {row["episode"]["rollout_id"]: TaskRow.model_validate(row["task"]) for row in batch}
        for reply in results:
            rollout_id, cut = (
                reply["episode"]["rollout_id"],
                cut_turns[reply["episode"]["rollout_id"]],
            )
            calls = await ledger(http, fresh.model, rollout_id)
            per_turn = Counter(c["turn"] for c in calls)
            assert sorted(per_turn) == list(range(reply["turns"]))
            for c in calls:
                # Before the cut: the saved calls, never regenerated. At the cut, a call
                # may have been answered after the agent's state was taken: asked again.
                assert c["attempt"] == (0 if c["turn"] < cut else 1) or c["turn"] == cut
                assert per_turn[c["turn"]] == 1 or c["turn"] == cut
            await check_each_event_once(http, fresh.resources, reply["episode"], tasks[rollout_id])


async def check_each_event_once(
    http: httpx.AsyncClient, resources: str, episode: JsonDict, task: TaskRow
) -> None:
    events = task.params["events"]
    assert isinstance(events, list) and events
    for turn, event in enumerate(events, start=1000):
        assert isinstance(event, dict)
        title = event["title"]
        call = tool_call(episode, turn, "calendar_search_events", {"query": title})
        found = (await http.post(resources + "/tools/calendar_search_events", json=call)).json()
        assert [e["title"] for e in json.loads(found["content"])].count(title) == 1, title


# --- retire and forget --------------------------------------------------------------------


async def test_a_retired_attempt_is_refused_everywhere_and_forget_releases_its_state(
    policy_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with serve_replica(policy_url, "workplace", tmp_path) as replica:
        batch = rows("workplace", 1, prefix="t")
        (done,) = await run(http, replica.agent, batch)
        assert (done["kind"], done["reward"]) == ("finished", 1.0)
        episode, calls_before = done["episode"], await ledger(http, replica.model, "t0")

        outcomes = {}
        for kind in STAGES:
            reply = await ok(http, replica.url(kind), "retire", {"episode_ids": [episode]})
            assert reply["marks"] == {"t0": 0}
            outcomes[kind] = [o["outcome"] for o in reply["outcomes"]]
        assert outcomes == {
            "model": ["unknown"],
            "agent": ["finished_unacked"],
            "resources": ["unknown"],
        }

        create = tool_call(
            episode,
            40,
            "calendar_create_event",
            {"title": "Late", "date": "2025-02-02", "start_time": "09:00", "duration_minutes": 15},
        )
        refused = await http.post(replica.resources + "/tools/calendar_create_event", json=create)
        assert (refused.status_code, error_code(refused)) == (409, "stale_attempt")
        assert "t0#0" in refused.json()["error"]["message"]
        model_call = await http.post(
            replica.model + "/v1/chat/completions",
            json=chat(batch[0]["task"]["prompt"]),
            headers=episode_headers("t0", 0, 40),
        )
        assert (model_call.status_code, error_code(model_call)) == (409, "stale_attempt")
        assert await ledger(http, replica.model, "t0") == calls_before

        # The next attempt is not retired: it finds the state, and nothing was applied.
        search = tool_call(
            {**episode, "attempt": 1}, 41, "calendar_search_events", {"query": "Late"}
        )
        found = await http.post(replica.resources + "/tools/calendar_search_events", json=search)
        assert found.json()["content"] == "[]"

        # A held reply is still served; once acked, the retired attempt is refused.
        (held,) = await run(http, replica.agent, batch)
        assert held == done
        acked = await ok(http, replica.agent, "ack", {"episode_ids": [episode]})
        assert acked["acked"] == [episode]
        (stale,) = await run(http, replica.agent, batch)
        assert (stale["kind"], stale["code"], stale["transport"]) == (
            "failed",
            "stale_attempt",
            False,
        )

        for kind in STAGES:
            forgotten = await ok(http, replica.url(kind), "forget", {"rollout_ids": ["t0"]})
            assert forgotten["forgotten"] == ["t0"]
            assert (await status(http, replica.url(kind)))["retired_rollouts"] == 0
        assert await ledger(http, replica.model, "t0") == []
        gone = await http.post(replica.resources + "/tools/calendar_search_events", json=search)
        assert (gone.status_code, error_code(gone)) == (404, "not_found")
        assert (await status(http, replica.resources))["counts"]["episodes"] == 0


async def test_retiring_an_attempt_with_a_call_running_cancels_that_call(
    slow_policy_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with serve_replica(slow_policy_url, "workplace", tmp_path) as replica:
        call = asyncio.create_task(
            http.post(
                replica.model + "/v1/chat/completions",
                json=chat("What is 2 + 2? Answer with the number only."),
                headers=episode_headers("x9", 0, 0),
            )
        )

        async def running() -> bool:
            return bool((await model_stats(http, replica.model))["in_flight"] == 1)

        await eventually(running, "the call is in flight")
        retired = await ok(
            http, replica.model, "retire", {"episode_ids": [{"rollout_id": "x9", "attempt": 0}]}
        )
        assert retired["outcomes"] == [
            {"episode": {"rollout_id": "x9", "attempt": 0}, "outcome": "cancelled"}
        ]
        reply = await asyncio.wait_for(call, 5)
        assert (reply.status_code, error_code(reply)) == (409, "stale_attempt")
        assert await ledger(http, replica.model, "x9") == []


# --- auth ---------------------------------------------------------------------------------


async def test_a_wrong_token_is_401_and_changes_nothing(
    policy_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with serve_replica(policy_url, "workplace", tmp_path) as replica:
        for kind in STAGES:
            url = replica.url(kind)
            body = {"checkpoint_id": "sneaky", "deadline_ts": deadline()}
            wrong = await control(http, url, "prepare", body, token="not-the-token")
            assert (wrong.status_code, error_code(wrong)) == (401, "unauthorized")
            assert TOKEN not in wrong.text
            anonymous = await http.post(f"{url}{CONTROL_PREFIX}/prepare", json=body)
            assert anonymous.status_code == 401
            assert (await status(http, url))["phase"] == "idle"
        # Admission is still open everywhere: a row plays to the end.
        (reply,) = await run(http, replica.agent, rows("workplace", 1))
        assert (reply["kind"], reply["reward"]) == ("finished", 1.0)


def test_with_a_snapshot_root_and_no_token_no_server_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CONTROL_TOKEN_ENV)
    root = str(tmp_path)
    makers: list[Callable[[], FastAPI]] = [
        lambda: create_resources_app("workplace", snapshot_root=root),
        lambda: create_model_app(
            ModelServerSettings(upstream_url="http://127.0.0.1:9/v1", snapshot_root=root)
        ),
        lambda: create_agent_app(
            AgentSettings(
                model_url="http://127.0.0.1:9",
                resources_url="http://127.0.0.1:9",
                environment="workplace",
                snapshot_root=root,
            )
        ),
    ]
    for make in makers:
        with pytest.raises(ConfigError, match=CONTROL_TOKEN_ENV):
            make()
    # Without a snapshot root they are plain data servers: no token needed, no control routes.
    plain = create_resources_app("workplace")
    assert control_fence(plain) is None
    assert not [r for r in plain.routes if getattr(r, "path", "").startswith(CONTROL_PREFIX)]


# --- restart-only -------------------------------------------------------------------------


async def test_a_restart_only_agent_never_blocks_prepare_and_lists_its_episodes_as_restarts(
    slow_policy_url: str, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with serve_replica(slow_policy_url, "math", tmp_path, mode=CheckpointMode.RESTART_ONLY) as r:
        # Frozen resources hold every session in `starting`, away from any turn boundary:
        # a turn-mode agent could not be ready until they moved.
        due = deadline(2)
        frozen = await ok(http, r.resources, "prepare", {"checkpoint_id": "m1", "deadline_ts": due})
        assert frozen["phase"] == "prepared"
        batch = rows("math", 3, prefix="m")
        running = asyncio.create_task(run(http, r.agent, batch))

        async def all_starting() -> bool:
            counts: JsonDict = (await status(http, r.agent))["counts"]
            return bool(counts["starting"] == 3)

        await eventually(all_starting, "three sessions wait on the frozen resources server")
        prepared = await ok(http, r.agent, "prepare", {"checkpoint_id": "m1", "deadline_ts": due})
        report = prepared["report"]
        assert (prepared["phase"], report["blocker_count"]) == ("prepared", 0)
        assert sorted(e["rollout_id"] for e in report["restarts"]) == rollout_ids(batch)

        commit = {
            "checkpoint_id": "m1",
            "deadline_ts": due,
            "checkpoint_dir": CUT_DIR,
            "episode_ids": report["restarts"],
        }
        capture = await control(http, r.agent, "commit", commit)
        assert (capture.status_code, error_code(capture)) == (422, "invalid_checkpoint_state")
        committed = await ok(http, r.agent, "commit", {**commit, "episode_ids": []})
        assert committed["manifest"]["count"] == 0 and committed["exported"] == {}
        nothing = await ok(http, r.resources, "commit", commit)  # math keeps no episode state
        assert nothing["manifest"]["count"] == 0 and nothing["exported"] == {}

        for url in (r.resources, r.agent):
            await ok(http, url, "resume", {"checkpoint_id": "m1"})
        results = await asyncio.wait_for(running, 10)
    assert sorted((x["kind"], x["reward"]) for x in results) == [("finished", 1.0)] * 3
