"""No call waits forever: a peer that accepts and never answers, on every outbound path.

The peer is :func:`tests.support.blackhole.blackhole`: a real loopback socket that takes
every connection and sends nothing back. Each caller must give up in its stated time with a
typed error (one line on the console for ``rollpoint run``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from rollpoint.envs.registry import get_environment
from rollpoint.http.client import HttpClient
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.episode import RunRow
from rollpoint.protocol.errors import ConfigError, TransportError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from rollpoint.servers.resources.resources_server import create_resources_app
from rollpoint.trainer.control.participant_client import ParticipantAddress, ParticipantClient
from tests.support.blackhole import blackhole
from tests.support.live_server import serve_app

pytestmark = pytest.mark.process


@pytest.fixture
def hole() -> Iterator[str]:
    with blackhole() as url:
        yield url


# --- the seam -----------------------------------------------------------------------------


async def test_an_explicit_none_timeout_falls_back_to_the_clients_own(hole: str) -> None:
    async with HttpClient(timeout_s=0.5) as client:
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"no answer within 0\.5s"):
            await client.get_json(f"{hole}/anything", timeout_s=None)
        with pytest.raises(TransportError, match=r"no answer within 0\.5s"):
            await client.post_json(f"{hole}/rollpoint/v1/policy_version", {"version": 1})
        assert time.monotonic() - started < 5


async def test_a_stream_that_never_sends_a_line_ends_in_its_timeout(hole: str) -> None:
    async with HttpClient(timeout_s=0.5) as client:
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"nothing received for 0\.5s"):
            async for _ in client.stream_ndjson(f"{hole}/run", {"rows": []}):
                pass
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("bad", [None, 0, -1.0, float("inf")])
def test_a_client_without_a_finite_timeout_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="timeout_s must be a finite number"):
        HttpClient(timeout_s=bad)  # type: ignore[arg-type]


# --- each caller --------------------------------------------------------------------------


def test_a_policy_url_that_never_answers_fails_the_run_in_its_stated_time(
    tmp_path: Path, hole: str
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump({"workdir": str(tmp_path / "run"), "policy": {"base_url": f"{hole}/v1"}})
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "rollpoint", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "240"},
    )
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"policy.base_url {hole}/v1 is not reachable" in lines[0]
    assert "no answer within 10s" in lines[0]
    assert took < 10 + 15  # the stated 10 s, plus an interpreter start on a loaded machine


async def test_a_model_server_whose_engine_never_answers_refuses_the_call_in_time(
    hole: str,
) -> None:
    settings = ModelServerSettings(upstream_url=f"{hole}/v1", call_timeout_s=0.5)
    with serve_app(create_model_app(settings)) as model:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.post(
                f"{model}/v1/chat/completions",
                json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert reply.status_code >= 500
        assert time.monotonic() - started < 10


def _row() -> dict[str, object]:
    (task,) = get_environment("workplace").make_tasks(1, seed=1)
    row = RunRow(task=task, group_id="g1", row=0, episode=EpisodeId(rollout_id="r0"))
    return {"rows": [row.model_dump(mode="json")]}


async def _run_one(agent: str) -> list[dict[str, object]]:
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", f"{agent}/run", json=_row()) as reply,
    ):
        return [orjson.loads(line) async for line in reply.aiter_lines() if line]


@pytest.mark.parametrize("peer", ["model", "resources"])
async def test_an_agent_whose_peer_never_answers_fails_the_row_in_time(
    hole: str, peer: str
) -> None:
    policy = create_policy_app(PolicySettings(seed=0, latency_ms=0, error_rate=0.0))
    with (
        serve_app(policy) as policy_url,
        serve_app(create_model_app(ModelServerSettings(upstream_url=f"{policy_url}/v1"))) as m,
        serve_app(create_resources_app("workplace")) as r,
    ):
        settings = AgentSettings(
            model_url=hole if peer == "model" else m,
            resources_url=hole if peer == "resources" else r,
            environment="workplace",
            model_timeout_s=0.5,
            tool_timeout_s=0.5,
        )
        with serve_app(create_agent_app(settings)) as agent:
            started = time.monotonic()
            (result,) = await _run_one(agent)
            assert time.monotonic() - started < 10
    assert result["kind"] == "failed" and result["transport"] is True, result


async def test_a_participant_that_never_answers_fails_each_control_call_in_time(
    hole: str,
) -> None:
    address = ParticipantAddress(kind=ParticipantKind.AGENT, replica="replica-0", url=hole)
    async with HttpClient(token="t", timeout_s=60) as http:
        client = ParticipantClient(address, http, control_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"status: .*no answer within 0\.5s"):
            await client.status()
        with pytest.raises(TransportError, match="prepare"):
            await client.prepare("ck-1", deadline_ts=time.time() + 0.5)
        assert time.monotonic() - started < 10
