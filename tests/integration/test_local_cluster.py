"""rollpoint.testing.LocalCluster as a user's test would use it: real servers on loopback
in threads, control routes guarded by the token given, and a close that does not hang on a
call the test left held at a closed gate."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import CONTROL_PREFIX
from rollpoint.protocol.episode import RunRow
from rollpoint.protocol.errors import LaunchError, UnauthorizedError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.testing import FaultProxy, LocalCluster

pytestmark = pytest.mark.integration

TOKEN = "local-cluster-test-token"


async def test_every_participant_answers_status_with_the_token_and_refuses_without(
    tmp_path: Path,
) -> None:
    with LocalCluster(
        replicas=2, snapshot_root=str(tmp_path / "snapshots"), control_token=TOKEN
    ) as cluster:
        deployment = cluster.deployment()
        urls = [u for r in deployment.replicas for u in (r.model_url, r.agent_url, r.resources_url)]
        async with HttpClient(token=TOKEN) as http:
            kinds = [(await http.get_json(f"{u}{CONTROL_PREFIX}/status"))["kind"] for u in urls]
        async with HttpClient(token="wrong") as http:
            with pytest.raises(UnauthorizedError):
                await http.get_json(f"{urls[0]}{CONTROL_PREFIX}/status")
        assert len(cluster.tasks(3)) == 3
    assert kinds == ["model", "agent", "resources"] * 2


async def test_close_reopens_a_gate_the_test_left_closed(tmp_path: Path) -> None:
    cluster = LocalCluster(replicas=1, latency_ms=1.0)
    replica = cluster.replicas[0]
    replica.on_gate(lambda gate: gate.close())
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    async with HttpClient(timeout_s=30) as http:
        held = asyncio.create_task(http.post_json(f"{replica.model.url}/v1/chat/completions", body))
        await asyncio.sleep(0.3)
        assert not held.done()  # waiting at the closed gate
        started = time.monotonic()
        await asyncio.to_thread(cluster.close)
        assert time.monotonic() - started < 5
        await asyncio.gather(held, return_exceptions=True)
    with pytest.raises(LaunchError, match="is not running"):
        replica.on_gate(lambda gate: gate.open())


async def test_each_agent_calls_its_resources_server_at_the_url_agent_resources_url_gives(
    tmp_path: Path,
) -> None:
    async with FaultProxy("http://127.0.0.1:9") as proxy:
        given: list[tuple[str, str]] = []

        def wire(replica: str, resources_url: str) -> str:
            given.append((replica, resources_url))
            proxy.upstream = resources_url
            return proxy.url

        cluster = LocalCluster(replicas=1, latency_ms=1.0, agent_resources_url=wire)
        try:
            replica = cluster.replicas[0]
            assert given == [(replica.name, replica.resources.url)]
            assert cluster.agent_settings(0)["resources_url"] == proxy.url
            (task,) = cluster.tasks(1)
            row = RunRow(task=task, group_id="g", row=0, episode=EpisodeId(rollout_id="r-0"))
            body = {"rows": [row.model_dump(mode="json")]}
            async with HttpClient(timeout_s=30) as http:
                lines = [
                    line async for line in http.stream_ndjson(f"{replica.agent.url}/run", body)
                ]
        finally:
            await asyncio.to_thread(cluster.close)
    assert [line["episode"]["rollout_id"] for line in lines] == ["r-0"]
    # The episode's start and its tool calls all crossed the proxy.
    assert proxy.stats.by_route["POST /episodes/start"] == 1
    assert proxy.stats.forwarded >= 2
