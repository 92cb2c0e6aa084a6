"""Data routes have a token of their own: `rollpoint serve` guards /run, tools and chat with
the data token, the control routes with the control token, and neither opens the other.

One real deployment (`rollpoint serve`, real processes on loopback) for the module; the
official `openai` client is the chat caller, as a user's trainer would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import yaml

from rollpoint.envs import get_environment
from rollpoint.protocol.episode import RunRow
from rollpoint.protocol.ids import EpisodeId
from tests.support.serve_process import served as served_cli

# One worker runs the file: the module's served deployment is started once.
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("data_token")]


@dataclass(frozen=True)
class Served:
    agent: str
    model: str
    resources: str
    control_token: str
    data_token: str
    workdir: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("data-token")
    config = tmp / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workdir": str(tmp / "run"),
                "environment": "workplace",
                "tasks": 2,
                "replicas": 1,
                "policy": {"latency_ms": 0, "error_rate": 0},
            }
        )
    )
    with served_cli(config) as doc:
        (replica,) = doc["replicas"]
        data_file = Path(doc["data_token_file"])
        assert data_file.stat().st_mode & 0o077 == 0
        yield Served(
            agent=replica["agent_url"],
            model=replica["model_url"],
            resources=replica["resources_url"],
            control_token=Path(doc["control_token_file"]).read_text().strip(),
            data_token=data_file.read_text().strip(),
            workdir=tmp / "run",
        )


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def one_row() -> dict[str, object]:
    (task,) = get_environment("workplace").make_tasks(1, seed=3)
    row = RunRow(task=task, group_id="g1", row=0, episode=EpisodeId(rollout_id="tok-0"))
    return {"rows": [row.model_dump(mode="json")]}


def test_run_needs_the_data_token_and_refuses_the_control_token(served: Served) -> None:
    for headers in ({}, bearer(served.control_token), bearer("wrong")):
        refused = httpx.post(f"{served.agent}/run", json=one_row(), headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthorized"
    with httpx.stream(
        "POST",
        f"{served.agent}/run",
        json=one_row(),
        headers=bearer(served.data_token),
        timeout=60,
    ) as reply:
        assert reply.status_code == 200
        (line,) = [orjson.loads(x) for x in reply.iter_lines() if x]
    # The agent reached its model and resources servers: they take its data token.
    assert line["kind"] == "finished" and line["turns"] >= 1


def test_chat_takes_the_data_token_as_the_openai_api_key(served: Served) -> None:
    good = openai.OpenAI(base_url=f"{served.model}/v1", api_key=served.data_token)
    assert [m.id for m in good.models.list()] == ["scripted"]
    bad = openai.OpenAI(base_url=f"{served.model}/v1", api_key=served.control_token)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hello"}]
        )


def test_tools_need_the_data_token_health_does_not(served: Served) -> None:
    assert httpx.get(f"{served.resources}/tools").status_code == 401
    listed = httpx.get(f"{served.resources}/tools", headers=bearer(served.data_token))
    assert listed.status_code == 200 and listed.json()["tools"]
    assert httpx.get(f"{served.resources}/healthz").status_code == 200


def test_control_routes_refuse_the_data_token(served: Served) -> None:
    for url in (served.agent, served.model, served.resources):
        status = f"{url}/rollpoint/v1/checkpoint/status"
        assert httpx.get(status, headers=bearer(served.data_token)).status_code == 401
        assert httpx.get(status, headers=bearer(served.control_token)).status_code == 200


def test_no_token_reaches_a_log(served: Served) -> None:
    httpx.post(f"{served.agent}/run", json=one_row(), headers=bearer("wrong"))
    logs = list((served.workdir / "logs").glob("*"))
    assert logs
    for path in logs:
        text = path.read_text(errors="replace")
        assert served.data_token not in text and served.control_token not in text, path
