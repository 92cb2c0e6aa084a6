"""Servers forked from a launcher's zygote (rollpoint.runtime.warm_start), as a group
starts, stops and kills them; read from /proc and over HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import httpx
import pytest

from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.protocol.control_verbs import STATUS
from rollpoint.protocol.errors import LaunchError
from rollpoint.runtime.process_group import ChildServer, ProcessGroup
from rollpoint.runtime.server_spec import ServerSpec
from rollpoint.runtime.warm_start import WARM_START_ENV, ForkedProcess
from tests.support.processes import alive, children_of, wait_gone

pytestmark = pytest.mark.process

TOKEN = "warm-start-test-token"


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _resources(name: str, root: Path, port: int = 0) -> ServerSpec:
    return ServerSpec(
        kind="resources",
        name=name,
        port=port,
        settings={"environment": "workplace", "name": name, "snapshot_root": str(root)},
    )


async def _status(child: ChildServer, token: str) -> int:
    async with httpx.AsyncClient() as client:
        reply = await client.get(
            f"{child.url}{STATUS.path}", headers={"Authorization": f"Bearer {token}"}
        )
    return reply.status_code


async def test_a_groups_servers_are_forked_from_one_zygote_and_look_exec_d(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs", env={CONTROL_TOKEN_ENV: TOKEN})
    try:
        children = await group.start(
            [_resources(f"resources-replica-{i}", tmp_path / "snapshots") for i in (0, 1)]
        )
        pids = [c.process.pid for c in children]
        assert all(isinstance(c.process, ForkedProcess) for c in children)
        zygote = _ppid(pids[0])
        assert zygote != os.getpid() and _ppid(zygote) == os.getpid()
        assert _ppid(pids[1]) == zygote
        assert "rollpoint.runtime.warm_start" in _cmdline(zygote)
        for child in children:
            line = _cmdline(child.process.pid)
            assert "-m rollpoint.runtime.server_process" in line
            assert f'"name":"{child.spec.name}"' in line
            # The group's environment reached each server: its control token guards its routes.
            assert await _status(child, TOKEN) == 200
            assert await _status(child, "another-token") == 401
    finally:
        await group.stop()
    assert wait_gone([*pids, zygote], timeout_s=5) == []


async def test_a_killed_server_reports_its_signal_and_its_sibling_serves_on(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs", env={CONTROL_TOKEN_ENV: TOKEN})
    try:
        first, second = await group.start(
            [_resources(f"resources-replica-{i}", tmp_path / "snapshots") for i in (0, 1)]
        )
        first.process.kill()
        assert await asyncio.wait_for(first.process.wait(), 10) == -signal.SIGKILL
        assert first.process.returncode == -signal.SIGKILL
        assert group.dead() == [first]
        with pytest.raises(ProcessLookupError):
            first.process.send_signal(signal.SIGTERM)  # gone: its pid may be someone else's
        assert await _status(second, TOKEN) == 200
    finally:
        await group.stop()


async def test_a_server_that_cannot_start_is_named_with_its_reason(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs", env={CONTROL_TOKEN_ENV: TOKEN})
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        try:
            with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is already in use"):
                await group.start([_resources("resources-replica-0", tmp_path, port=port)])
            (child,) = group.children
            assert child.process.returncode == 2
        finally:
            await group.stop()


async def test_servers_outlive_their_zygote_and_still_stop_by_their_leash(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs", env={CONTROL_TOKEN_ENV: TOKEN})
    try:
        (child,) = await group.start([_resources("resources-replica-0", tmp_path)])
        zygote = _ppid(child.process.pid)
        assert zygote in children_of(os.getpid())
        os.kill(zygote, signal.SIGKILL)
        assert wait_gone([zygote], timeout_s=5) == []
        assert alive(child.process.pid)
        assert await _status(child, TOKEN) == 200
    finally:
        await group.stop()
    # Its exit is seen without the zygote that would have reported it; its status is not.
    assert child.process.returncode == 255
    assert wait_gone([child.process.pid], timeout_s=5) == []


async def test_off_a_group_execs_each_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WARM_START_ENV, "0")
    group = ProcessGroup(tmp_path / "logs", env={CONTROL_TOKEN_ENV: TOKEN})
    try:
        (child,) = await group.start([_resources("resources-replica-0", tmp_path)])
        assert not isinstance(child.process, ForkedProcess)
        assert _ppid(child.process.pid) == os.getpid()
        assert await _status(child, TOKEN) == 200
    finally:
        await group.stop()
