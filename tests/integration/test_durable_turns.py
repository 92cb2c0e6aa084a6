"""Durable turns on loopback (issue 35): the model server journals every finished policy call
and the resources server every applied tool call in the snapshot store before replying, and
a restored episode that makes those calls again is answered from the journal.

The servers are stopped and started again on the same store (new processes' state: an
empty call ledger, an empty resources server), and the same rollouts are played again under
the next attempt, from their prompts: every policy call is answered with the recorded reply
and its exact tokens (the engine's own call log does not grow), every tool call with its
recorded result, the environment's state is rebuilt by replaying the tools (the verifier
gives the same reward), and an effect outside the state is not repeated (counted from that
outside log). A kill of real processes is in ``tests/chaos/test_durable_turns_crash.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, ClassVar

import httpx
import orjson
import pytest

from rollpoint.app.config import SamplingConfig
from rollpoint.envs.base import NoArguments, Tool
from rollpoint.envs.registry import get_environment
from rollpoint.envs.workplace import WorkplaceEnvironment, WorkplaceState
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.episode import EpisodeStart, RunRow, ToolCall, VerifyRequest
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN, EpisodeId
from rollpoint.protocol.token_data import TokenTrace, as_float32
from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from rollpoint.servers.resources.episode_service import ResourcesService
from rollpoint.servers.resources.resources_server import create_resources_app
from rollpoint.servers.resources.tool_journal import ToolJournal
from rollpoint.store.journal import Journal
from rollpoint.store.journal_shipping import SPOOL_ENV
from rollpoint.testing.journal_damage import JournalDamage, damage_journal
from tests.support.effect_log_env import LOG_ENV, EffectLogEnvironment
from tests.support.live_server import serve_app
from tests.support.moto_s3 import moto_s3

pytestmark = pytest.mark.integration

SAMPLING = SamplingConfig(temperature=1.0, logprobs=True, seed="turn")


@pytest.fixture(autouse=True)
def control_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPOINT_CONTROL_TOKEN", "durable-turns-test")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "engine.jsonl"
    settings = PolicySettings(seed=3, error_rate=0.0, call_log=str(log))
    with serve_app(create_policy_app(settings)) as url:
        yield url, log


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


@contextmanager
def servers(
    engine_url: str, store: Path | str, *, journal: bool, agent_journal: bool = False
) -> Iterator[tuple[str, str]]:
    """Resources (the effect-logging workplace), model and agent servers on ``store``;
    the model and agent URLs. ``agent_journal``: the agent journals its turns too."""
    root = str(store)
    with ExitStack() as stack:
        resources = stack.enter_context(
            serve_app(
                create_resources_app(EffectLogEnvironment(), snapshot_root=root, journal=journal)
            )
        )
        model = stack.enter_context(
            serve_app(
                create_model_app(
                    ModelServerSettings(
                        upstream_url=engine_url + "/v1", snapshot_root=root, journal=journal
                    )
                )
            )
        )
        settings = AgentSettings(
            model_url=model,
            resources_url=resources,
            environment="workplace",
            model_timeout_s=10,
            tool_timeout_s=5,
            sampling=SAMPLING.request_fields(),
            seed_policy=SAMPLING.seed,
            capture_tokens=True,
            **({"snapshot_root": root, "journal": True} if agent_journal else {}),
        )
        agent = stack.enter_context(serve_app(create_agent_app(settings)))
        yield model, agent


def rows(n: int, attempt: int) -> list[Any]:
    tasks = get_environment("workplace").make_tasks(n, seed=5)
    return [
        RunRow(
            task=t,
            group_id="g1",
            row=i,
            episode=EpisodeId(rollout_id=f"dt{i}", attempt=attempt),
        ).model_dump(mode="json")
        for i, t in enumerate(tasks)
    ]


async def run(http: httpx.AsyncClient, agent: str, batch: list[Any]) -> dict[str, Any]:
    async with http.stream("POST", agent + "/run", json={"rows": batch}) as reply:
        assert reply.status_code == 200
        lines = [orjson.loads(line) async for line in reply.aiter_lines() if line]
    assert {line["kind"] for line in lines} == {"finished"}, lines
    return {line["episode"]["rollout_id"]: line for line in lines}


def log_lines(path: Path) -> list[Any]:
    return [orjson.loads(raw) for raw in path.read_bytes().splitlines()] if path.exists() else []


def turns(reply: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What each policy call of an episode was answered with: the engine's completion id,
    its token data and stamped version."""
    return [
        (c["turn"], c["completion_id"], c["tokens"], c["policy_version"])
        for c in reply["model_calls"]
    ]


async def test_a_restored_episode_is_answered_from_the_journal_never_the_engine_or_the_tool(
    engine: tuple[str, Path],
    http: httpx.AsyncClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine_url, engine_log = engine
    effects = tmp_path / "effects.jsonl"
    monkeypatch.setenv(LOG_ENV, str(effects))
    store = tmp_path / "store"
    with servers(engine_url, store, journal=True) as (_, agent):
        first = await run(http, agent, rows(3, attempt=0))
    sampled = log_lines(engine_log)
    applied = log_lines(effects)
    assert sampled and applied
    assert len(sampled) == sum(r["turns"] for r in first.values())

    # New servers on the same store: what a restarted job's processes start with. The
    # rollouts are played again under the next attempt (a restored session's).
    with servers(engine_url, store, journal=True) as (model, agent):
        again = await run(http, agent, rows(3, attempt=1))
        recorded = {
            rid: (await http.get(model + "/rollpoint/v1/calls", params={"rollout_id": rid})).json()
            for rid in again
        }
    assert log_lines(engine_log) == sampled, "a journaled policy call was sampled again"
    assert log_lines(effects) == applied, "a journaled tool call's effect was applied again"
    by_id = {line["id"]: line for line in sampled}
    for rid, reply in again.items():
        assert turns(reply) == turns(first[rid])
        # The environment's state was rebuilt by replaying the tools: same verdict.
        assert reply["reward"] == first[rid]["reward"]
        # Each turn carries the ids and logprobs the engine logged when it sampled it.
        for call in reply["model_calls"]:
            (choice,) = by_id[call["completion_id"]]["choices"]
            trace = TokenTrace.model_validate(call["tokens"])
            assert trace.completion() == choice["token_ids"]
            assert trace.logprobs() == as_float32(choice["logprobs"])
        # The model server's ledger files the answered calls under the new attempt.
        assert [c["attempt"] for c in recorded[rid]["calls"]] == [1] * reply["turns"]
        assert [c["tokens"] for c in recorded[rid]["calls"]] == [
            c["tokens"] for c in reply["model_calls"]
        ]
    counts = Counter((line["task"], line["effect"]) for line in log_lines(effects))
    assert max(counts.values()) == 1


async def test_a_journal_in_an_object_store_answers_the_restored_episodes_on_a_new_machine(
    engine: tuple[str, Path],
    http: httpx.AsyncClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``snapshot.store`` an S3 bucket (moto's server on loopback): each server journals in
    this machine's spool and ships its segments there, and servers started on another
    machine (an empty spool) fetch them and answer every call from them as above."""
    engine_url, engine_log = engine
    effects = tmp_path / "effects.jsonl"
    monkeypatch.setenv(LOG_ENV, str(effects))
    store = "s3://rollpoint-journal-store/run-1"
    with moto_s3(monkeypatch, "rollpoint-journal-store") as s3:
        monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "machine-1"))
        with servers(engine_url, store, journal=True, agent_journal=True) as (_, agent):
            first = await run(http, agent, rows(2, attempt=0))
        sampled, applied = log_lines(engine_log), log_lines(effects)
        assert sampled and applied
        shipped = {kind: s3.ls(f"{store}/journal/{kind}") for kind in ("model", "resources")}
        assert all(shipped.values()), shipped

        monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "machine-2"))
        with servers(engine_url, store, journal=True, agent_journal=True) as (_, agent):
            again = await run(http, agent, rows(2, attempt=1))
    assert log_lines(engine_log) == sampled, "a journaled policy call was sampled again"
    assert log_lines(effects) == applied, "a journaled tool call's effect was applied again"
    for rid, reply in again.items():
        assert turns(reply) == turns(first[rid]) and reply["reward"] == first[rid]["reward"]
    assert (tmp_path / "machine-2").is_dir()


async def test_without_the_journal_a_restarted_server_samples_and_applies_again(
    engine: tuple[str, Path],
    http: httpx.AsyncClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The baseline the first test is measured against (so its counts have teeth)."""
    engine_url, engine_log = engine
    effects = tmp_path / "effects.jsonl"
    monkeypatch.setenv(LOG_ENV, str(effects))
    store = tmp_path / "store"
    with servers(engine_url, store, journal=False) as (_, agent):
        await run(http, agent, rows(2, attempt=0))
    sampled, applied = len(log_lines(engine_log)), len(log_lines(effects))
    with servers(engine_url, store, journal=False) as (_, agent):
        await run(http, agent, rows(2, attempt=1))
    assert len(log_lines(engine_log)) == 2 * sampled
    assert len(log_lines(effects)) == 2 * applied
    assert not (store / "journal").exists()


async def test_a_call_asking_something_else_goes_to_the_engine(
    engine: tuple[str, Path], http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The journal answers the same request of the same rollout and turn, at the journaled
    attempt or a later one; another conversation, an earlier attempt or another turn is a
    call of its own."""
    engine_url, engine_log = engine
    store = tmp_path / "store"
    body: dict[str, Any] = {
        "model": "scripted",
        "messages": [{"role": "user", "content": "Book a room for Friday."}],
        **SAMPLING.request_fields(),
        "return_token_ids": True,
        "seed": 11,
    }

    def tag(attempt: int, turn: int) -> dict[str, str]:
        return {HEADER_ROLLOUT_ID: "q1", HEADER_ATTEMPT: str(attempt), HEADER_TURN: str(turn)}

    url = "/v1/chat/completions"
    with servers(engine_url, store, journal=True) as (model, _):
        first = await http.post(model + url, json=body, headers=tag(2, 0))
    assert first.status_code == 200 and len(log_lines(engine_log)) == 1
    with servers(engine_url, store, journal=True) as (model, _):
        # Same call, key order changed (a session restored from JSON): from the journal.
        same = await http.post(model + url, json=dict(reversed(body.items())), headers=tag(3, 0))
        assert same.content == first.content and len(log_lines(engine_log)) == 1
        other = {**body, "messages": [{"role": "user", "content": "Book a room for Monday."}]}
        for headers, sent in ((tag(3, 0), other), (tag(1, 0), body), (tag(3, 1), body)):
            before = len(log_lines(engine_log))
            reply = await http.post(model + url, json=sent, headers=headers)
            assert reply.status_code == 200
            assert len(log_lines(engine_log)) == before + 1, headers


def stream_body(seed: int) -> dict[str, Any]:
    return {
        "model": "scripted",
        "messages": [{"role": "user", "content": "Book a room for Friday."}],
        **SAMPLING.request_fields(),
        "return_token_ids": True,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_tag(attempt: int, turn: int = 0) -> dict[str, str]:
    return {HEADER_ROLLOUT_ID: "s1", HEADER_ATTEMPT: str(attempt), HEADER_TURN: str(turn)}


async def test_a_streamed_call_is_journaled_and_asked_again_gets_the_same_stream_not_the_engine(
    engine: tuple[str, Path], http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """A streamed caller's call is journaled as its stream ends; asked again of a new
    server on the same store (the next attempt, as a restored session asks it), it is
    answered with the same event stream from the journal, and the engine does not see it."""
    engine_url, engine_log = engine
    store = tmp_path / "store"
    url = "/v1/chat/completions"
    with servers(engine_url, store, journal=True) as (model, _):
        first = await http.post(model + url, json=stream_body(7), headers=stream_tag(0))
    assert first.status_code == 200, first.text
    assert first.headers["content-type"].startswith("text/event-stream")
    assert first.text.rstrip().endswith("data: [DONE]")
    assert len(log_lines(engine_log)) == 1
    with servers(engine_url, store, journal=True) as (model, _):
        again = await http.post(model + url, json=stream_body(7), headers=stream_tag(1))
        assert again.status_code == 200
        assert again.content == first.content
        assert again.headers["content-type"].startswith("text/event-stream")
        assert len(log_lines(engine_log)) == 1  # from the journal: the engine did not see it
        # Another turn is a call of its own.
        other = await http.post(model + url, json=stream_body(7), headers=stream_tag(1, 1))
        assert other.status_code == 200 and len(log_lines(engine_log)) == 2
    with servers(engine_url, tmp_path / "no-journal", journal=False) as (model, _):
        await http.post(model + url, json=stream_body(7), headers=stream_tag(0))
    with servers(engine_url, tmp_path / "no-journal", journal=False) as (model, _):
        await http.post(model + url, json=stream_body(7), headers=stream_tag(1))
    assert len(log_lines(engine_log)) == 4  # without it, the engine answers again


async def test_a_streamed_call_ends_only_once_it_is_journaled(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The stream's last bytes wait for the record to be durable, the events before them do
    not: the append (in the server's thread) waits until the caller has read the stream's
    first event, and when it is durable the caller has not read ``[DONE]``. The engine sends
    one token every 20 ms, so the stream comes in many chunks."""
    pacing = PolicySettings(seed=3, error_rate=0.0, token_latency_ms=20)
    first_read = threading.Event()
    lines: list[str] = []
    seen_when_durable: list[list[str]] = []
    append = Journal.append_json

    async def append_after_the_first_event(self: Journal, *args: Any, **kw: Any) -> Any:
        # Never set if the whole stream were held: the caller would read nothing first.
        assert await asyncio.to_thread(first_read.wait, 10), "no event before the record"
        position = await append(self, *args, **kw)
        seen_when_durable.append(list(lines))
        return position

    with (
        pytest.MonkeyPatch.context() as patch,
        serve_app(create_policy_app(pacing)) as engine_url,
    ):
        patch.setattr(Journal, "append_json", append_after_the_first_event)
        with servers(engine_url, tmp_path / "store", journal=True) as (model, _):
            async with http.stream(
                "POST", model + "/v1/chat/completions", json=stream_body(5), headers=stream_tag(0)
            ) as reply:
                assert reply.status_code == 200
                async for line in reply.aiter_lines():
                    if line:
                        lines.append(line)
                        first_read.set()
    assert lines[-1] == "data: [DONE]"
    (seen,) = seen_when_durable
    assert seen, "the caller read no event before the record was durable"
    assert "data: [DONE]" not in seen, "the stream ended before its call was durable"


class CoinEnvironment(WorkplaceEnvironment):
    """A workplace with a tool that is not deterministic: ``flip`` answers a different
    number each time it runs (a process-wide counter outside the state)."""

    flips: ClassVar[list[int]] = [0]

    def tool_table(self) -> Any:
        def flip(state: WorkplaceState, _: NoArguments) -> str:
            self.flips[0] += 1
            return f"flip {self.flips[0]}"

        return {**super().tool_table(), "flip": Tool("flip", "Flip.", NoArguments, flip)}


async def test_a_replay_that_differs_warns_and_the_episode_continues_from_the_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = str(tmp_path / "journal")
    task = get_environment("workplace").make_tasks(1, seed=1)[0]
    episode = EpisodeId(rollout_id="coin1", attempt=0)
    email = '{"to": "ana@example.com", "subject": "Hi", "body": "Hello"}'

    def call(turn: int, name: str, arguments: str = "{}", attempt: int = 0) -> ToolCall:
        return ToolCall(
            episode=episode.model_copy(update={"attempt": attempt}),
            turn=turn,
            call_index=0,
            arguments=arguments,
        )

    service = ResourcesService(CoinEnvironment())
    journal = ToolJournal(Journal.open(folder), service)
    await service.start(EpisodeStart(episode=episode, task=task))
    await journal.call_tool("email_send", call(0, "email_send", email))
    flipped = await journal.call_tool("flip", call(1, "flip"))
    await journal.journal.close()

    # A restarted server: the episode starts again from its task (no snapshot held it).
    service = ResourcesService(CoinEnvironment())
    journal = ToolJournal(Journal.open(folder), service)
    await service.start(EpisodeStart(episode=episode.model_copy(update={"attempt": 1}), task=task))
    sent = await journal.call_tool("email_send", call(0, "email_send", email, attempt=1))
    assert sent.replayed and journal.counts.replayed == 1
    with caplog.at_level(logging.WARNING, logger="rollpoint.servers.resources.tool_journal"):
        again = await journal.call_tool("flip", call(1, "flip", attempt=1))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "environment workplace" in warning and "tool flip" in warning and "coin1#1" in warning
    assert "\n" not in warning
    # Continued from the snapshot: the state is the start state (the replayed e-mail gone),
    # and the call ran live, not answered from the journal.
    assert again.content != flipped.content and not again.replayed
    state = service._episode("coin1").state
    assert not service.environment.side_effects(state)
    verdict = service.verify(VerifyRequest(episode=episode, final_message=None))
    assert verdict.reward is not None
    await journal.journal.close()


@pytest.fixture
def slow_engine(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The scripted policy taking 150 ms a call: a stop lands mid-episode."""
    log = tmp_path / "slow-engine.jsonl"
    settings = PolicySettings(seed=3, error_rate=0.0, call_log=str(log), latency_ms=150)
    with serve_app(create_policy_app(settings)) as url:
        yield url, log


async def test_an_agent_resumes_each_episode_at_its_last_journaled_turn_and_adopts_finished_replies(
    slow_engine: tuple[str, Path],
    http: httpx.AsyncClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first servers stop while episodes are mid-way (their sessions cancelled, as a
    kill would leave them, with what was journaled); new servers on the same store are sent
    the same rows under the next attempt: each episode goes on from its last journaled turn
    (no policy call sampled again but the ones in flight at the stop, no effect applied
    again, the environment's state rebuilt: full reward), and a row that had finished gets
    its journaled reply back without running."""
    engine_url, engine_log = slow_engine
    effects = tmp_path / "effects.jsonl"
    monkeypatch.setenv(LOG_ENV, str(effects))
    store = tmp_path / "store"
    batch = rows(4, attempt=0)
    with servers(engine_url, store, journal=True, agent_journal=True) as (_, agent):
        finished = await run(http, agent, batch[:1])  # one row ends before the stop
        first = asyncio.create_task(run(http, agent, batch[1:]))
        # Mid-way: some turns of every other row journaled, none of them finished.
        for _ in range(2000):
            if len(log_lines(engine_log)) >= finished["dt0"]["turns"] + 6:
                break
            await asyncio.sleep(0.005)
        assert not first.done()
        first.cancel()  # the connection goes: the server's shutdown then stops the sessions
        with contextlib.suppress(BaseException):
            await first
    sampled = log_lines(engine_log)
    applied = log_lines(effects)

    with servers(engine_url, store, journal=True, agent_journal=True) as (_, agent):
        again = await run(http, agent, rows(4, attempt=1))
        counts = (await http.get(agent + "/rollpoint/v1/sessions")).json()["counts"]
    # The finished row: its reply, adopted under the new attempt, nothing run.
    assert again["dt0"]["episode"]["attempt"] == 1
    assert turns(again["dt0"]) == turns(finished["dt0"])
    assert counts["journal_adopted"] == 1
    assert counts["journal_resumed_turns"] > 0
    # At most one policy call per unfinished row (the one in flight at the stop) sampled again.
    seeds_before = Counter(line["request"]["seed"] for line in sampled)
    after = log_lines(engine_log)[len(sampled) :]
    twice = [line["request"]["seed"] for line in after if seeds_before[line["request"]["seed"]]]
    assert len(twice) <= 3, twice
    # No effect twice, every effect once; the state was rebuilt: full reward.
    seen = Counter((line["task"], line["effect"]) for line in log_lines(effects))
    assert max(seen.values()) == 1 and len(log_lines(effects)) >= len(applied)
    by_id = {line["id"]: line for line in log_lines(engine_log)}
    for reply in again.values():
        assert reply["reward"] == 1.0, reply["reward"]
        for call in reply["model_calls"]:
            (choice,) = by_id[call["completion_id"]]["choices"]
            trace = TokenTrace.model_validate(call["tokens"])
            assert trace.completion() == choice["token_ids"]
            assert trace.logprobs() == as_float32(choice["logprobs"])


async def test_a_continued_episode_whose_tool_journal_lost_calls_it_holds_starts_over(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A damaged tool journal (its last record corrupt: the journal is cut before it) no
    longer holds a call the agent's session has the result of: the restarted resources
    server refuses to continue that episode (409 ``cancelled``, naming it and the call), so
    its row starts over instead of playing its later turns on a state without that call's
    effect (``rollpoint chaos``'s journal_corrupt_record found the I2 violation). A
    continued episode whose calls all survived starts as before."""
    store = tmp_path / "store"
    task = get_environment("workplace").make_tasks(1, seed=1)[0]
    email = '{"to": "ana@example.com", "subject": "Hi", "body": "Hello"}'
    keys = [(0, 0), (1, 0)]

    def start(rollout_id: str, attempt: int, held: list[tuple[int, int]]) -> dict[str, Any]:
        episode = EpisodeId(rollout_id=rollout_id, attempt=attempt)
        return EpisodeStart(episode=episode, task=task, held_calls=held).model_dump(mode="json")

    def call(rollout_id: str, turn: int) -> dict[str, Any]:
        episode = EpisodeId(rollout_id=rollout_id, attempt=0)
        return ToolCall(episode=episode, turn=turn, call_index=0, arguments=email).model_dump(
            mode="json"
        )

    def resources() -> Any:
        app = create_resources_app(WorkplaceEnvironment(), snapshot_root=str(store), journal=True)
        return serve_app(app)

    with resources() as url:
        for rollout_id in ("kept", "cut"):
            assert (
                await http.post(url + "/episodes/start", json=start(rollout_id, 0, []))
            ).is_success
            for turn, _ in keys:
                reply = await http.post(url + "/tools/email_send", json=call(rollout_id, turn))
                assert reply.is_success and not reply.json()["is_error"], reply.text
    # The journal's last record is the "cut" episode's turn-1 call: corrupt it.
    said = damage_journal(store, JournalDamage.CORRUPT_RECORD, "resources")
    assert "a byte flipped" in said

    with resources() as url:
        refused = await http.post(url + "/episodes/start", json=start("cut", 1, keys))
        assert refused.status_code == 409, refused.text
        body = refused.json()["error"]
        assert body["code"] == "cancelled"
        assert "cut#1" in body["message"] and "turn 1 call 0" in body["message"]
        assert "turn 0 call 0" not in body["message"]  # replayed from the journal
        kept = await http.post(url + "/episodes/start", json=start("kept", 1, keys))
        assert kept.is_success, kept.text
        # Asking for no more than the journal kept, the damaged one continues too.
        partial = await http.post(url + "/episodes/start", json=start("cut", 1, keys[:1]))
        assert partial.is_success, partial.text
