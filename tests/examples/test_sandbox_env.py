"""The sandbox example environment on its own, and inside a resources service (no sockets)."""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import tarfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from sandbox_env import TASKS, SandboxEnvironment
from sandbox_env.tree import pack_tree, read_tree

from rollpoint.envs import (
    InvalidCheckpointStateError,
    TaskRow,
    ToolArgumentError,
    get_environment,
    load_tasks,
)
from rollpoint.protocol.episode import EpisodeStart, ToolCall
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.episode_record import pack_state
from rollpoint.servers.resources.episode_service import ResourcesService

REF = "sandbox_env:SandboxEnvironment"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SandboxEnvironment:
    monkeypatch.setenv("SANDBOX_ROOT", str(tmp_path / "replica-a"))
    made = get_environment(REF)
    assert isinstance(made, SandboxEnvironment)
    return made


def task(index: int = 1) -> TaskRow:
    return load_tasks(TASKS, environment=REF)[index]


def test_the_shipped_dataset_loads_and_every_task_starts(env: SandboxEnvironment) -> None:
    tasks = load_tasks(TASKS, environment=REF)
    assert len(tasks) == 12 and {t.environment for t in tasks} == {"sandbox"}
    for t in tasks:
        state = env.start(t)
        assert env.verify(state, t, None).reward < 1.0  # no task is done before it starts
        env.close(state)
        assert not state.workdir.exists()


def test_tools_write_append_read_list_and_check(env: SandboxEnvironment) -> None:
    t = task(1)  # fix add() in src/calc.py, log a line in notes.txt
    state = env.start(t)
    assert env.call(state, "fs_append", {"path": "notes.txt", "line": "fixed add"}) == (
        "appended a line to notes.txt (now 1 lines)"
    )
    env.call(
        state, "fs_write", {"path": "src/calc.py", "content": "def add(a, b):\n    return a + b\n"}
    )
    assert env.call(state, "fs_read", {"path": "notes.txt"}) == "fixed add\n"
    listed = orjson.loads(env.call(state, "fs_list", {}))
    assert listed == [{"path": "notes.txt", "bytes": 10}, {"path": "src/calc.py", "bytes": 32}]
    assert orjson.loads(env.call(state, "run_check", {}))["passed"] == 2
    assert env.verify(state, t, "done").reward == 1.0


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        ("fs_read", {"path": "../etc/passwd.txt"}, "argument 'path'"),
        ("fs_write", {"path": "/abs.txt", "content": "x"}, "argument 'path'"),
        ("fs_read", {"path": "missing.txt"}, "no file missing.txt"),
        ("fs_append", {"path": "a.txt", "line": "two\nlines"}, "argument 'line'"),
        ("run_check", {"x": 1}, "unexpected argument 'x'"),
    ],
)
def test_bad_calls_are_tool_errors(
    env: SandboxEnvironment, tool: str, arguments: dict[str, Any], message: str
) -> None:
    state = env.start(task())
    with pytest.raises(ToolArgumentError, match=message):
        env.call(state, tool, arguments)


def test_the_tree_restores_byte_exact_onto_another_replica(
    env: SandboxEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = task(5)
    state = env.start(t)
    env.call(state, "fs_append", {"path": "build/log.txt", "line": "fetch \u00e9"})
    env.call(state, "fs_write", {"path": "deep/er/x.py", "content": "\x00\x01 binary-ish\r\n"})
    exported = orjson.loads(orjson.dumps(env.export_state(state)))  # through JSON, as saved
    before = read_tree(state.workdir)

    monkeypatch.setenv("SANDBOX_ROOT", str(tmp_path / "replica-b"))  # another replica's root
    replica_b = SandboxEnvironment()
    restored = replica_b.restore_state(t, exported)

    assert restored.workdir.parent == tmp_path / "replica-b"
    assert read_tree(restored.workdir) == before
    assert replica_b.export_state(restored) == exported
    # And it goes on from there: the append is applied to the restored bytes.
    replica_b.call(restored, "fs_append", {"path": "build/log.txt", "line": "configure"})
    assert (
        read_tree(restored.workdir)["build/log.txt"] == "start\nfetch \u00e9\nconfigure\n".encode()
    )


def _exported(members: list[tarfile.TarInfo], data: bytes = b"x") -> dict[str, str]:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info in members:
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    archive = out.getvalue()
    return {
        "format": "tar",
        "archive": base64.b64encode(archive).decode(),
        "sha256": hashlib.sha256(archive).hexdigest(),
    }


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = 1 if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (
            _member("../outside.txt"),
            "archive member '../outside.txt' is outside the working directory",
        ),
        (_member("/etc/x.txt"), "archive member '/etc/x.txt' is outside the working directory"),
        (
            _member("link.txt", tarfile.SYMTYPE, "/etc/passwd"),
            "archive member 'link.txt' is a symlink",
        ),
        (_member("hard.txt", tarfile.LNKTYPE, "a.txt"), "archive member 'hard.txt' is a hard link"),
    ],
)
def test_a_tree_with_a_symlink_or_a_path_outside_is_refused(
    env: SandboxEnvironment, tmp_path: Path, member: tarfile.TarInfo, why: str
) -> None:
    t = task(0)
    exported = _exported([_member("ok.txt"), member])
    with pytest.raises(InvalidCheckpointStateError) as err:
        env.restore_state(t, exported)
    assert err.value.message == f"sandbox state of task {t.task_id}: {why}"
    assert not (tmp_path / "outside.txt").exists()
    assert list((tmp_path / "replica-a").iterdir()) == []  # nothing left half-written


def test_a_tampered_archive_is_refused(env: SandboxEnvironment) -> None:
    t = task(0)
    exported = env.export_state(env.start(t))
    forged = {**exported, "archive": base64.b64encode(pack_tree({"a.txt": b"forged"})).decode()}
    with pytest.raises(InvalidCheckpointStateError, match="does not match its sha256"):
        env.restore_state(t, forged)


def _ep(rollout_id: str) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=0)


async def test_the_resources_service_names_the_rollout_of_a_refused_tree(
    env: SandboxEnvironment,
) -> None:
    service = ResourcesService(env)
    t = task(0)
    await service.start(EpisodeStart(episode=_ep("r1"), task=t))
    call = ToolCall(
        episode=_ep("r1"), turn=0, call_index=0, arguments='{"path": "a.txt", "line": "x"}'
    )
    await service.call_tool("fs_append", call)
    (record,) = service.export_episodes([_ep("r1")])
    bad_state = _exported([_member("link.txt", tarfile.SYMTYPE, "/etc/passwd")])
    tampered = {**record, "packed_state": pack_state(bad_state)}
    target = ResourcesService(SandboxEnvironment())
    with pytest.raises(InvalidCheckpointStateError) as err:
        target.install([tampered], [_ep("r1")])
    assert err.value.message == (
        f"record 0 (rollout r1): sandbox state of task {t.task_id}:"
        " archive member 'link.txt' is a symlink"
    )
    assert target.rollout_ids() == []


async def test_an_append_replayed_by_its_idempotency_key_is_applied_once(
    env: SandboxEnvironment,
) -> None:
    service = ResourcesService(env)
    t = task(2)  # todo.txt starts empty
    await service.start(EpisodeStart(episode=_ep("r1"), task=t))
    call = ToolCall(
        episode=_ep("r1"), turn=0, call_index=0, arguments='{"path": "todo.txt", "line": "a"}'
    )
    first = await service.call_tool("fs_append", call)
    again = await service.call_tool("fs_append", call)
    assert (first.replayed, again.replayed) == (False, True)
    assert again.content == first.content == "appended a line to todo.txt (now 1 lines)"
    (record,) = service.export_episodes([_ep("r1")])
    restored = ResourcesService(SandboxEnvironment())
    restored.install([record], [_ep("r1")])
    replay = await restored.call_tool("fs_append", call)  # the rerun's copy of the call
    assert replay.replayed and replay.content == first.content
    (after,) = restored.export_episodes([_ep("r1")])
    assert after["packed_state"] == record["packed_state"]  # the tree did not change


async def test_append_logs_its_calls_key_and_run_check_runs_in_a_worker_thread(
    env: SandboxEnvironment, caplog: pytest.LogCaptureFixture
) -> None:
    service = ResourcesService(env)
    await service.start(EpisodeStart(episode=_ep("r1"), task=task(2)))
    assert not service.tools.runs_on_loop("run_check")  # @slow_tool
    assert service.tools.runs_on_loop("fs_append")
    line = '{"path": "todo.txt", "line": "a"}'
    with caplog.at_level(logging.INFO, logger="rollpoint.envs.sandbox"):
        for turn in (0, 1):
            call = ToolCall(episode=_ep("r1"), turn=turn, call_index=0, arguments=line)
            await service.call_tool("fs_append", call)
    assert [r.getMessage() for r in caplog.records] == [
        f"[rollout r1#0 turn {turn} call 0 fs_append] appended a line to todo.txt (key r1/{turn}/0)"
        for turn in (0, 1)
    ]
    check = ToolCall(episode=_ep("r1"), turn=2, call_index=0, arguments="")
    report = orjson.loads((await service.call_tool("run_check", check)).content)
    assert report["total"] >= 1
    service.tools.close()


class SetExport(SandboxEnvironment):
    """An author's mistake: a set in the export, which JSON cannot hold."""

    def capture_state(self, state: Any) -> Any:
        made = super().capture_state(state)
        return lambda: {**made(), "seen": {1, 2}}


async def test_an_export_that_is_not_json_safe_fails_the_snapshot_naming_environment_and_episode(
    env: SandboxEnvironment, tmp_path: Path
) -> None:
    from rollpoint.servers.resources.resources_participant import ResourcesParticipant
    from rollpoint.store.participant_state import write_participant_state

    service = ResourcesService(SetExport())
    t = task(2)
    await service.start(EpisodeStart(episode=_ep("r7"), task=t))
    call = ToolCall(
        episode=_ep("r7"), turn=0, call_index=0, arguments='{"path": "todo.txt", "line": "a"}'
    )
    await service.call_tool("fs_append", call)
    records = await ResourcesParticipant(service).export([_ep("r7")])
    with pytest.raises(InvalidCheckpointStateError) as err:
        write_participant_state(
            str(tmp_path / "c1"),
            kind="resources",
            instance="resources-replica-0",
            checkpoint_id="c1",
            records=records,
        )
    assert err.value.message == (
        "record 0 cannot be encoded: packed state of rollout r7 could not be made:"
        " environment 'sandbox': export_state returned data that is not JSON-safe"
        " (Type is not JSON serializable: set)"
    )
