"""The ``mcp:<spec file>`` environment against real MCP servers: the SDK's streamable HTTP
server of ``tests.support.mcp_http_server`` (its own call log) and ``mcp-server-sqlite``
from PyPI over stdio (its SQLite file).

Tools listed from the server become the policy's tools (bound arguments hidden and filled
in), each call carries its idempotency key in ``_meta``, a call the journal answers is not
sent, and every way it can fail is one line: a server that cannot start, a tool the server
lacks, a call that fails (an environment error, not a transport fault).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollpoint.app.config import parse_config
from rollpoint.envs.mcp_env import McpEnvironment, mcp_environment
from rollpoint.envs.tool_call import ToolRunner, tool_context
from rollpoint.protocol.episode import EpisodeStart, ToolCall, ToolResult, VerifyReply
from rollpoint.protocol.errors import ConfigError, EnvironmentRaisedError, ToolArgumentError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources import tool_journal
from rollpoint.servers.resources.episode_service import ResourcesService
from rollpoint.servers.resources.tool_journal import ToolJournal
from rollpoint.store.journal import Journal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SQLITE_TABLE = "CREATE TABLE IF NOT EXISTS calls (key TEXT NOT NULL, rollout TEXT NOT NULL)"


@pytest.fixture(autouse=True)
def fresh_resolutions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)  # spec paths are relative to the working directory
    mcp_environment.cache_clear()
    yield
    mcp_environment.cache_clear()


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    """The SDK's server on a loopback port: (its URL, its call log, its process)."""
    log = tmp_path / "notes.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.mcp_http_server", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once its socket is bound
        assert line.startswith("port "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp", log, proc
    finally:
        proc.kill()
        proc.wait()


def write_spec(name: str, **spec: Any) -> str:
    spec.setdefault("tasks", {"prompt": "Task {index}"})
    Path(name).write_text(yaml.safe_dump(spec))
    return f"mcp:{name}"


def sqlite_spec(name: str, db: Path, **more: Any) -> str:
    return write_spec(
        name,
        server={"command": ["mcp-server-sqlite", "--db-path", str(db)]},
        setup=[{"tool": "create_table", "arguments": {"query": SQLITE_TABLE}}],
        **more,
    )


def call(env: McpEnvironment, state: Any, tool: str, args: dict[str, Any], turn: int) -> Any:
    """One call through the runner the resources server uses, in a loop of its own."""

    async def run() -> str:
        runner = ToolRunner(env)
        try:
            return await runner.call(
                state,
                tool,
                args,
                lambda: tool_context(
                    env.name,
                    tool,
                    rollout_id="r1",
                    attempt=0,
                    task_id="t1",
                    turn=turn,
                    call_index=0,
                ),
            )
        finally:
            await env._connection.close()

    return asyncio.run(run())


def logged(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_http_server_tools_become_the_policys_tools_and_calls_carry_their_key(
    http_server: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    url, log, _ = http_server
    ref = write_spec(
        "notes.yaml",
        server={"url": url},
        tools={"note": {"bind": {"tag": "{task_id}:{idempotency_key}"}}, "refuse": {}},
    )
    env = mcp_environment(ref)()
    specs = {s["function"]["name"]: s["function"] for s in env.tools()}  # type: ignore[index]
    assert set(specs) == {"note", "refuse"}
    assert specs["note"]["description"] == "Write a note"
    # The bound argument is the environment's: the policy sees only `text`.
    assert set(specs["note"]["parameters"]["properties"]) == {"text"}  # type: ignore[index]
    assert specs["note"]["parameters"]["required"] == ["text"]  # type: ignore[index]

    state = env.start(env.make_tasks(1, 0)[0])
    assert call(env, state, "note", {"text": "hello"}, turn=3) == "noted hello"
    assert logged(log) == [{"text": "hello", "tag": "t1:r1/3/0", "key": "r1/3/0"}]
    assert env.export_state(state)["calls"] == [
        {
            "key": "r1/3/0",
            "tool": "note",
            "arguments": {"text": "hello", "tag": "t1:r1/3/0"},
            "result": "noted hello",
            "is_error": False,
            "journal": False,
        }
    ]
    # The schema checks the policy's arguments before anything is sent.
    with pytest.raises(ToolArgumentError, match="note: arguments: 'text' is a required"):
        call(env, state, "note", {}, turn=4)
    with pytest.raises(ToolArgumentError, match="argument 'tag' is set by the environment"):
        call(env, state, "note", {"text": "x", "tag": "mine"}, turn=4)
    # An isError result is the model's to read, saved as such.
    with pytest.raises(ToolArgumentError, match="not today"):
        call(env, state, "refuse", {}, turn=5)
    assert env.export_state(state)["calls"][-1]["is_error"] is True  # type: ignore[index]
    assert len(logged(log)) == 1


def test_a_call_the_journal_answers_is_not_sent_again(
    http_server: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    url, log, _ = http_server
    env = mcp_environment(write_spec("replay.yaml", server={"url": url}))()
    state = env.start(env.make_tasks(1, 0)[0])
    with tool_journal._replay_mode(ToolResult(content="noted earlier")):
        assert call(env, state, "note", {"text": "earlier", "tag": "a"}, turn=0) == "noted earlier"
    assert logged(log) == []  # the server never saw it
    saved = env.export_state(state)["calls"]
    assert saved[0]["journal"] is True and saved[0]["result"] == "noted earlier"  # type: ignore[index]
    # A restored state holds it too.
    restored = env.restore_state(env.make_tasks(1, 0)[0], env.export_state(state))
    assert env.export_state(restored) == env.export_state(state)


def test_a_call_to_a_server_that_went_away_is_one_line_environment_error(
    http_server: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    url, _, proc = http_server
    env = mcp_environment(write_spec("gone.yaml", server={"url": url, "headers": {}}))()
    proc.kill()
    proc.wait()
    state = env.start(env.make_tasks(1, 0)[0])
    with pytest.raises(EnvironmentRaisedError) as raised:
        call(env, state, "note", {"text": "x", "tag": "y"}, turn=0)
    message = raised.value.message
    assert "\n" not in message
    assert message.startswith(f"environment {env.name!r}: MCP server {url!r}: call of tool 'note'")
    assert not raised.value.retryable


def test_stdio_server_from_pypi_state_in_its_own_file(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "calls.db"
    ref = sqlite_spec(
        "sqlite.yaml",
        db,
        tools={
            "write_query": {
                "bind": {"query": "INSERT INTO calls VALUES ('{idempotency_key}', '{rollout_id}')"}
            }
        },
    )
    env = mcp_environment(ref)()
    state = env.start(env.make_tasks(1, 0)[0])
    assert call(env, state, "write_query", {}, turn=0) == "[{'affected_rows': 1}]"
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT key, rollout FROM calls").fetchall() == [("r1/0/0", "r1")]


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (
            {"server": {"command": ["no-such-mcp-server"]}},
            "MCP server 'no-such-mcp-server' cannot be used: command 'no-such-mcp-server' not"
            " found on PATH nor in",
        ),
        (
            {"server": {"command": [sys.executable, "-c", "pass"]}, "timeout_s": 10},
            "cannot be used:",
        ),
        ({"server": {"url": "http://127.0.0.1:9/mcp"}, "timeout_s": 5}, "cannot be used:"),
        ({"server": {}}, "key 'server': Value error, give exactly one of 'command'"),
        ({"server": {"command": ["x"]}, "tool": {}}, "key 'tool': Extra inputs"),
    ],
    ids=["no-command", "exits-at-once", "no-listener", "no-transport", "unknown-key"],
)
def test_a_server_that_cannot_start_or_a_bad_spec_is_one_config_line(
    spec: dict[str, Any], error: str
) -> None:
    ref = write_spec("bad.yaml", **spec)
    with pytest.raises(ConfigError) as raised:
        mcp_environment(ref)
    message = raised.value.message
    assert message.startswith(f"environment {ref!r}: ")
    assert error in message
    assert "\n" not in message


def test_a_tool_the_server_lacks_or_a_bound_argument_it_does_not_take_is_named(
    tmp_path: Path,
) -> None:
    db = tmp_path / "x.db"
    with pytest.raises(ConfigError, match="the server has no tool 'delete_all' \\(it has: "):
        mcp_environment(sqlite_spec("lacks.yaml", db, tools={"delete_all": {}}))
    with pytest.raises(ConfigError, match=r"tools\.read_query\.bind: read_query takes no argument"):
        mcp_environment(sqlite_spec("bind.yaml", db, tools={"read_query": {"bind": {"sql": "x"}}}))
    with pytest.raises(ConfigError, match=r"cannot read missing\.yaml"):
        mcp_environment("mcp:missing.yaml")


def test_a_config_naming_an_mcp_environment_needs_the_journal(tmp_path: Path) -> None:
    ref = sqlite_spec("journal.yaml", tmp_path / "j.db")
    with pytest.raises(
        ConfigError, match=r"key 'journal\.enabled': environment 'mcp:journal\.yaml'"
    ):
        parse_config({"environment": ref})
    assert parse_config({"environment": ref, "journal": {"enabled": True}}).environment == ref


def test_a_failing_setup_call_fails_the_first_call_in_one_line(
    http_server: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    url, log, _ = http_server
    ref = write_spec("setup.yaml", server={"url": url}, setup=[{"tool": "refuse"}])
    env = mcp_environment(ref)()
    state = env.start(env.make_tasks(1, 0)[0])
    with pytest.raises(EnvironmentRaisedError) as raised:
        call(env, state, "note", {"text": "x", "tag": "y"}, turn=0)
    assert "call of tool 'note' failed (setup call 'refuse' failed: " in raised.value.message
    assert "\n" not in raised.value.message
    assert env.export_state(state) == {"calls": []}
    assert logged(log) == []


async def test_through_the_resources_servers_journal_a_restored_call_is_answered_not_resent(
    tmp_path: Path, http_server: tuple[str, Path, subprocess.Popen[str]]
) -> None:
    url, log, _ = http_server
    ref = write_spec("journaled.yaml", server={"url": url}, tools={"note": {}})
    folder = str(tmp_path / "journal")
    episode = EpisodeId(rollout_id="mcp1", attempt=0)
    note = '{"text": "one", "tag": "a"}'

    def at(turn: int, attempt: int, arguments: str = note) -> ToolCall:
        restored = episode.model_copy(update={"attempt": attempt})
        return ToolCall(episode=restored, turn=turn, call_index=0, arguments=arguments)

    env = mcp_environment(ref)()
    task = env.make_tasks(1, 0)[0]
    service = ResourcesService(env)
    journal = ToolJournal(Journal.open(folder), service)
    await service.start(EpisodeStart(episode=episode, task=task))
    first = await journal.call_tool("note", at(0, 0))
    await journal.journal.close()
    assert first.content == "noted one" and len(logged(log)) == 1

    # A restarted server: the episode starts again from its task (no snapshot held it)
    # and makes the same call under the same key; the journal answers it.
    service = ResourcesService(env)
    journal = ToolJournal(Journal.open(folder), service)
    await service.start(EpisodeStart(episode=episode.model_copy(update={"attempt": 1}), task=task))
    again = await journal.call_tool("note", at(0, 1))
    assert again.replayed and again.content == "noted one"
    assert len(logged(log)) == 1, "a call the journal held reached the server again"
    later = await journal.call_tool("note", at(1, 1, '{"text": "two", "tag": "b"}'))
    assert not later.replayed and [n["key"] for n in logged(log)] == ["mcp1/0/0", "mcp1/1/0"]
    calls = env.export_state(service._episode("mcp1").state)["calls"]
    assert [(c["key"], c["journal"]) for c in calls] == [  # type: ignore[index]
        ("mcp1/0/0", True),
        ("mcp1/1/0", False),
    ]
    await journal.journal.close()
    await env._connection.close()


def test_a_stdio_server_that_died_fails_its_call_and_is_started_again_for_the_next(
    tmp_path: Path,
) -> None:
    import os
    import signal
    import sqlite3

    db = tmp_path / "dies.db"
    insert = "INSERT INTO calls VALUES ('{idempotency_key}', '{rollout_id}')"
    env = mcp_environment(
        sqlite_spec("dies.yaml", db, tools={"write_query": {"bind": {"query": insert}}})
    )()
    state = env.start(env.make_tasks(1, 0)[0])

    def servers() -> list[int]:
        return [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and str(db).encode() in _cmdline(p)
        ]

    async def play() -> list[str]:
        runner = ToolRunner(env)
        outcomes = []
        for turn in range(3):
            if turn == 1:
                (pid,) = servers()
                os.kill(pid, signal.SIGKILL)
            context = partial(
                tool_context,
                env.name,
                "write_query",
                rollout_id="r1",
                attempt=0,
                task_id="t1",
                turn=turn,
                call_index=0,
            )
            try:
                outcomes.append(await runner.call(state, "write_query", {}, context))
            except EnvironmentRaisedError as exc:
                outcomes.append(exc.message)
        await env._connection.close()
        return outcomes

    first, failed, third = asyncio.run(play())
    assert first == third == "[{'affected_rows': 1}]"
    assert failed.startswith(
        f"environment {env.name!r}: MCP server 'mcp-server-sqlite': call of tool 'write_query'"
        " failed ("
    )
    assert "\n" not in failed
    with sqlite3.connect(db) as conn:
        assert [k for (k,) in conn.execute("SELECT key FROM calls")] == ["r1/0/0", "r1/2/0"]
    assert [c["key"] for c in env.export_state(state)["calls"]] == ["r1/0/0", "r1/2/0"]  # type: ignore[index]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def seen_calls(calls: list[dict[str, Any]], task: Any, final_message: str | None) -> float:
    """A user's verify: a reward from the saved calls (here 2.0 when told "clamp me")."""
    return 2.0 if final_message == "clamp me" else len(calls) / 10


def test_verify_is_the_users_function_or_the_share_of_calls_that_did_not_error(
    http_server: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    url, _, _ = http_server
    plain = mcp_environment(write_spec("plain.yaml", server={"url": url}))()
    mine = mcp_environment(
        write_spec(
            "mine.yaml", server={"url": url}, verify="tests.integration.test_mcp_env:seen_calls"
        )
    )()
    for env in (plain, mine):
        task = env.make_tasks(1, 0)[0]
        state = env.start(task)
        assert env.verify(state, task, None).reward == 0.0  # no calls yet
        call(env, state, "note", {"text": "a", "tag": "b"}, turn=0)
        with pytest.raises(ToolArgumentError):
            call(env, state, "refuse", {}, turn=1)
        detail = {"calls": 2, "errors": 1, "from_journal": 0}
        expected = 0.5 if env is plain else 0.2
        assert env.verify(state, task, "done") == VerifyReply(reward=expected, detail=detail)
    assert mine.verify(state, task, "clamp me").reward == 1.0
    with pytest.raises(ConfigError, match=r"verify: cannot import 'no_such_module'"):
        mcp_environment(
            write_spec("bad_verify.yaml", server={"url": url}, verify="no_such_module:f")
        )
