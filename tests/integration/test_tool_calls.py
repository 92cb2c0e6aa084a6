"""Tools that know their call and take their time, on a real resources server over loopback.

The environment (:mod:`tests.support.waiting_env`) logs every tool run to an outside log
with what its context said. Tests: the idempotency key a tool sees (the same for a call
re-sent after its reply was lost, and for the same call of a continued attempt; another
for another turn); a slow or async tool on one episode while another episode's call and
the control verbs go on; and what the snapshot cut does with a call in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.protocol.control import CONTROL_PREFIX
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.episode_record import EpisodeRecord
from rollpoint.servers.resources.episode_service import ResourcesService
from rollpoint.servers.resources.resources_server import create_resources_app, resources_service
from rollpoint.store.participant_state import read_participant_state
from rollpoint.testing.local_cluster import ThreadServer
from tests.support.polling import eventually
from tests.support.waiting_env import WaitingEnvironment

pytestmark = pytest.mark.integration

TOKEN = "tool-calls-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SLOW_S = 3.0
"""How long the slow call of the latency tests takes."""
QUICK_S = 0.5
"""What every other round trip must stay under while it runs (a sixth of it)."""


class Server:
    def __init__(self, env: WaitingEnvironment, root: Path) -> None:
        self.env = env
        self.root = root
        self.thread = ThreadServer(
            create_resources_app(env, snapshot_root=str(root), replica="replica-0")
        )
        self.url = self.thread.url

    @property
    def service(self) -> ResourcesService:
        return resources_service(self.thread.app)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    env = WaitingEnvironment()
    running = Server(env, tmp_path)
    try:
        yield running
    finally:
        env.release.set()  # a wait still running returns, so the server can stop
        running.thread.stop()


@pytest.fixture
async def http(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


TASK = WaitingEnvironment().make_tasks(1, seed=0)[0]


def call_body(
    rollout_id: str, turn: int, index: int, args: Any, attempt: int = 0
) -> dict[str, Any]:
    return {
        "episode": {"rollout_id": rollout_id, "attempt": attempt},
        "turn": turn,
        "call_index": index,
        "arguments": json.dumps(args),
    }


async def start(http: httpx.AsyncClient, url: str, rollout_id: str) -> None:
    body = {"episode": {"rollout_id": rollout_id, "attempt": 0}, "task": TASK.model_dump()}
    reply = await http.post(f"{url}/episodes/start", json=body)
    assert reply.status_code == 200, reply.text


async def tool(
    http: httpx.AsyncClient, url: str, name: str, body: dict[str, Any], read_s: float = 30
) -> dict[str, Any]:
    reply = await http.post(f"{url}/tools/{name}", json=body, timeout=read_s)
    assert reply.status_code == 200, reply.text
    payload: dict[str, Any] = reply.json()
    return payload


async def control(http: httpx.AsyncClient, url: str, verb: str, body: dict[str, Any]) -> Any:
    reply = await http.post(f"{url}{CONTROL_PREFIX}/{verb}", json=body, headers=AUTH)
    assert reply.status_code == 200, (verb, reply.text)
    return reply.json()


async def status(http: httpx.AsyncClient, url: str) -> Any:
    reply = await http.get(f"{url}{CONTROL_PREFIX}/status", headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def timed(coro: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - t0


# ---- the call context ----------------------------------------------------------------------
async def test_a_tool_sees_one_key_per_call_and_another_for_another_turn(
    server: Server, http: httpx.AsyncClient
) -> None:
    await start(http, server.url, "r1")
    await start(http, server.url, "r2")
    for rollout_id, turn, index in (("r1", 0, 0), ("r1", 0, 1), ("r1", 1, 0), ("r2", 0, 0)):
        body = call_body(rollout_id, turn, index, {"text": f"{turn}.{index}"})
        assert (await tool(http, server.url, "note", body))["content"] == f"noted {turn}.{index}"
    seen = [
        (s.key, s.rollout_id, s.attempt, s.task_id, s.turn, s.call_index)
        for s in server.env.outside
    ]
    assert seen == [
        ("r1/0/0", "r1", 0, TASK.task_id, 0, 0),
        ("r1/0/1", "r1", 0, TASK.task_id, 0, 1),
        ("r1/1/0", "r1", 0, TASK.task_id, 1, 0),
        ("r2/0/0", "r2", 0, TASK.task_id, 0, 0),
    ]
    # A two-argument tool on the same server, unchanged.
    count = await tool(http, server.url, "count", call_body("r1", 2, 0, {}))
    assert count == {"content": "3", "is_error": False, "replayed": False}


async def test_a_call_re_sent_after_its_reply_was_lost_runs_once_and_replays_its_result(
    server: Server, http: httpx.AsyncClient
) -> None:
    """The agent gives up on a slow call (its reply is lost) and sends it again while the
    first try still runs in its worker thread: the second waits for the first and gets its
    result; the tool ran once, as the outside log shows."""
    await start(http, server.url, "r1")
    body = call_body("r1", 0, 0, {"seconds": 30.0})
    with pytest.raises(httpx.ReadTimeout):
        await tool(http, server.url, "wait", body, read_s=0.3)
    assert server.env.running == 1
    again = asyncio.create_task(tool(http, server.url, "wait", body))
    # And a call of the next turn, which runs on the loop: it waits for the episode too.
    then = asyncio.create_task(tool(http, server.url, "note", call_body("r1", 1, 0, {"text": "x"})))
    await eventually(lambda: server.service.in_flight == 3, "the re-sent call is in")
    await asyncio.sleep(0.2)  # time enough to have run a second time, had it not waited
    assert not again.done() and not then.done() and server.env.running == 1
    server.env.release.set()
    reply = await asyncio.wait_for(again, 10)
    assert reply == {"content": "waited", "is_error": False, "replayed": True}
    assert (await asyncio.wait_for(then, 10))["content"] == "noted x"
    assert [s.key for s in server.env.outside] == ["r1/0/0", "r1/1/0"]
    assert server.service.tool_calls == 2 and server.service.tool_replays == 1
    state = server.thread.call(lambda: server.service._episodes["r1"].state)
    assert state.notes == ["waiting", "waited", "x"]  # never interleaved


async def test_a_continued_attempt_re_sending_a_lost_call_gets_the_same_key(
    server: Server, http: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 0 runs turn 1's call, and its reply is lost with the server; the episode is
    restored (elsewhere) from before the call and attempt 1 sends the same call: the tool
    runs again there and sees the same idempotency key, so an outside system keyed on it
    can tell it is the same call. A new turn gets a new key."""
    await start(http, server.url, "r1")
    await tool(http, server.url, "note", call_body("r1", 0, 0, {"text": "first"}))
    before = server.thread.call(lambda: server.service.export(["r1"]))
    await tool(http, server.url, "note", call_body("r1", 1, 0, {"text": "second"}))

    other_env = WaitingEnvironment()
    other = Server(other_env, tmp_path / "other")
    try:
        other.thread.call(lambda: other.service.install(before))
        body = call_body("r1", 1, 0, {"text": "second"}, attempt=1)
        reply = await tool(http, other.url, "note", body)
        assert reply == {"content": "noted second", "is_error": False, "replayed": False}
        await tool(http, other.url, "note", call_body("r1", 2, 0, {"text": "third"}, attempt=1))
    finally:
        other.thread.stop()
    first = [(s.key, s.attempt) for s in server.env.outside]
    then = [(s.key, s.attempt) for s in other_env.outside]
    assert first == [("r1/0/0", 0), ("r1/1/0", 0)]
    assert then == [("r1/1/0", 1), ("r1/2/0", 1)]


async def test_an_episode_released_while_its_call_runs_is_closed_when_the_call_ends(
    server: Server, http: httpx.AsyncClient
) -> None:
    await start(http, server.url, "r1")
    state_id = server.thread.call(lambda: id(server.service._episodes["r1"].state))
    slow = asyncio.create_task(
        tool(http, server.url, "wait", call_body("r1", 0, 0, {"seconds": 30.0}))
    )
    await eventually(lambda: server.env.running == 1, "the slow call is running")
    reply = await http.post(f"{server.url}/episodes/release", json={"rollout_ids": ["r1"]})
    assert reply.json() == {"released": 1}
    assert server.env.closed == []  # not under the running call's feet
    server.env.release.set()
    assert (await asyncio.wait_for(slow, 10))["content"] == "waited"
    assert server.env.closed == [state_id]


# ---- slow and async tools ------------------------------------------------------------------
@pytest.mark.parametrize("slow_tool", ["wait", "await_for"])
async def test_a_slow_call_holds_neither_other_episodes_nor_the_control_verbs(
    server: Server, http: httpx.AsyncClient, slow_tool: str
) -> None:
    """While one episode's call takes SLOW_S (in a worker thread, or awaited), another
    episode's call, a status and a prepare each come back within QUICK_S; the prepare, whose
    deadline comes first, reports the call in flight as its blocker."""
    await start(http, server.url, "r1")
    await start(http, server.url, "r2")
    t0 = time.perf_counter()
    slow = asyncio.create_task(
        tool(http, server.url, slow_tool, call_body("r1", 0, 0, {"seconds": SLOW_S}))
    )
    await eventually(lambda: server.service.in_flight == 1, "the slow call is running")

    other, other_s = await timed(
        tool(http, server.url, "note", call_body("r2", 0, 0, {"text": "meanwhile"}))
    )
    assert other["content"] == "noted meanwhile"
    _, status_s = await timed(status(http, server.url))
    prepare = {"checkpoint_id": "c1", "deadline_ts": time.time() + 0.2}
    prepared, prepare_s = await timed(control(http, server.url, "prepare", prepare))
    assert prepared["phase"] == "preparing"  # not ready: the slow call is in flight
    assert prepared["report"]["blocker_count"] == 1
    assert not slow.done()
    assert max(other_s, status_s, prepare_s) < QUICK_S, (other_s, status_s, prepare_s)

    await control(http, server.url, "resume", {"checkpoint_id": "c1"})
    reply = await asyncio.wait_for(slow, SLOW_S + 10)
    slow_s = time.perf_counter() - t0
    assert reply["content"] in {"waited", "awaited"}
    assert slow_s >= SLOW_S
    assert max(other_s, status_s, prepare_s) < slow_s / 6


async def test_a_prepare_waits_for_the_call_in_flight_and_the_cut_holds_it_whole(
    server: Server, http: httpx.AsyncClient
) -> None:
    """The cut keeps the protocol's rule: readiness means no call in flight. A prepare made
    while a slow call runs is answered when that call ends (a call sent meanwhile waits at
    the closed gate), and the commit saves the call whole: its result and its state."""
    await start(http, server.url, "r1")
    await start(http, server.url, "r2")
    await status(http, server.url)  # as a coordinator does first: the state image starts
    slow = asyncio.create_task(
        tool(http, server.url, "wait", call_body("r1", 0, 0, {"seconds": 30.0}))
    )
    await eventually(lambda: server.service.in_flight == 1, "the slow call is running")
    # Mid-call, the saved form of r1 is the one from before the call.
    mid = server.thread.call(
        lambda: server.service.export_episodes([EpisodeId(rollout_id="r1", attempt=0)])
    )
    assert mid[0]["tool_results"] == [] and _notes(mid[0]) == []  # not ["waiting"]

    prepare = asyncio.create_task(
        control(
            http, server.url, "prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 20}
        )
    )
    await eventually(lambda: server.service.frozen, "the prepare closed the gate")
    held = asyncio.create_task(
        tool(http, server.url, "note", call_body("r2", 0, 0, {"text": "later"}))
    )
    await eventually(lambda: server.service.waiting == 1, "r2's call waits at the gate")
    _, status_s = await timed(status(http, server.url))
    assert status_s < QUICK_S
    assert not prepare.done() and not slow.done()

    server.env.release.set()
    assert (await asyncio.wait_for(slow, 10))["content"] == "waited"
    prepared = await asyncio.wait_for(prepare, 10)
    assert prepared["phase"] == "prepared"
    assert not held.done()
    scope = [_ep("r1"), _ep("r2")]
    commit = {
        "checkpoint_id": "c1",
        "deadline_ts": time.time() + 20,
        "checkpoint_dir": "cut",
        "episode_ids": scope,
    }
    committed = await control(http, server.url, "commit", commit)
    assert committed["phase"] == "committed"
    await control(http, server.url, "resume", {"checkpoint_id": "c1"})
    assert (await asyncio.wait_for(held, 10))["content"] == "noted later"

    instance = "resources-replica-0"
    _, records = read_participant_state(
        str(server.root / "cut" / "resources" / instance),
        kind="resources",
        instance=instance,
        checkpoint_id="c1",
        root=str(server.root),
    )
    by_rollout = {r["rollout_id"]: r for r in records}
    r1, r2 = by_rollout["r1"], by_rollout["r2"]
    assert [(t["turn"], t["call_index"], t["result"]["content"]) for t in r1["tool_results"]] == [
        (0, 0, "waited")
    ]
    assert _notes(r1) == ["waiting", "waited"]
    assert r2["tool_results"] == [] and _notes(r2) == []


def _ep(rollout_id: str) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt": 0}


def _notes(record: dict[str, Any]) -> list[str]:
    notes: list[str] = EpisodeRecord.model_validate(record).exported_state()["notes"]
    return notes
