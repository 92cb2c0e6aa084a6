"""Prometheus metrics of a live run: the trainer's ``/metrics`` and every server's.

Real server processes on the embedded runtime and the real trainer; each page is scraped
over HTTP and parsed with prometheus-client's own parser.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from rollpoint.app.config import RunConfig
from rollpoint.envs.workplace import WorkplaceEnvironment
from rollpoint.protocol.errors import ConfigError, StaleAttemptError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.resources_server import create_resources_app, resources_service
from rollpoint.trainer.metrics import TrainerMetrics
from tests.support.embedded_job import embedded_job
from tests.support.job_config import job_config
from tests.support.live_server import serve_app
from tests.support.polling import eventually
from tests.support.prometheus import Scrape


def job(tmp_path: Path, **overrides: Any) -> RunConfig:
    return job_config(
        tmp_path,
        **{
            "tasks": 16,
            "policy": {"latency_ms": 40, "error_rate": 0.0},
            "snapshot": {"every_seconds": 0.5, "keep": 50, "deadline_seconds": 5},
            **overrides,
        },
    )


def train_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def scrape(url: str) -> Scrape:
    return await asyncio.to_thread(Scrape, url)


@pytest.mark.process
async def test_counters_move_during_a_run_and_match_train_data(tmp_path: Path) -> None:
    config = job(tmp_path)
    data = config.workdir / "train_data.jsonl"
    async with embedded_job(config) as j:
        trainer_url = f"http://127.0.0.1:{j.metrics.serve()}/metrics"
        run = asyncio.create_task(j.trainer.run())
        await eventually(lambda: bool(train_rows(data)), "a first train step", within_s=60)
        first = await scrape(trainer_url)
        rows = train_rows(data)

        # train_data.jsonl is written just before the counters move: wait for them to agree.
        async def caught_up() -> bool:
            now = await scrape(trainer_url)
            return now.total("rollpoint_episodes_trained_total") >= len(rows)

        await eventually(caught_up, "the counters to catch up with train_data.jsonl")
        assert first.total("rollpoint_episodes_trained_total") <= len(rows)
        assert first.total("rollpoint_train_steps_total") <= max(r["train_step"] for r in rows)
        # A second scrape while the run still goes: the counters have moved.
        later: list[Scrape] = []

        async def moved() -> bool:
            now = await scrape(trainer_url)
            later[:] = [now]
            return all(
                now.total(name) > first.total(name)
                for name in ("rollpoint_train_steps_total", "rollpoint_episodes_finished_total")
            )

        await eventually(moved, "a later train step and more episodes on /metrics", within_s=60)
        assert not run.done(), "the run ended before the second scrape: make it longer"
        second = later[0]
        assert second.total("rollpoint_episodes_trained_total") > first.total(
            "rollpoint_episodes_trained_total"
        )
        summary = await run
        final = await scrape(trainer_url)
        servers = {
            kind: [
                await scrape(f"{getattr(r, f'{kind}_url')}/metrics") for r in j.deployment.replicas
            ]
            for kind in ("model", "agent", "resources")
        }

    rows = train_rows(data)
    assert summary.episodes == len(rows) == 32 and not summary.failed_groups
    # Grew between the two scrapes, and ended where train_data.jsonl ended.
    assert final.total("rollpoint_episodes_trained_total") == len(rows)
    assert final.total("rollpoint_episodes_trained_total") > first.total(
        "rollpoint_episodes_trained_total"
    )
    assert final.total("rollpoint_train_steps_total") == max(r["train_step"] for r in rows)
    assert final.total("rollpoint_train_steps_total") > first.total("rollpoint_train_steps_total")
    assert final.total("rollpoint_episodes_finished_total") == summary.episodes
    assert final.total("rollpoint_episodes_in_flight") == 0
    assert final.total("rollpoint_rows_failed_total") == 0
    assert final.total("rollpoint_replicas_up") == 2
    events = [
        orjson.loads(line) for line in (config.workdir / "metrics.jsonl").read_bytes().splitlines()
    ]
    published = [e for e in events if e["event"] == "snapshot" and e["outcome"] == "published"]
    assert published, "no snapshot was published during the run"
    assert final.total("rollpoint_snapshots_total", outcome="published") == len(published)
    assert final.total("rollpoint_snapshot_pause_seconds_count") == len(
        [e for e in events if e["event"] == "snapshot"]
    )

    # Every policy call of a trained row went through a model server and was counted there.
    turns = sum(len(r["model_calls"]) for r in rows)
    model = servers["model"]
    calls = sum(s.total("rollpoint_model_calls_total") for s in model)
    assert calls == turns
    assert sum(s.total("rollpoint_model_call_seconds_count") for s in model) == calls
    assert all(s.total("rollpoint_model_calls_total") > 0 for s in model), "a replica idle"
    assert sum(s.total("rollpoint_model_tokens_total", kind="completion") for s in model) == (
        calls * config.policy.tokens_per_call
    )
    assert sum(s.total("rollpoint_model_calls_in_flight") for s in model) == 0
    replicas = {
        dict(labels)["replica"]
        for s in model
        for (name, labels) in s.samples
        if name == "rollpoint_model_calls_total"
    }
    assert replicas == {"replica-0", "replica-1"}
    agent = servers["agent"]
    assert all(s.has("rollpoint_agent_sessions") for s in agent)
    assert sum(s.total("rollpoint_agent_sessions") for s in agent) == 0
    resources = servers["resources"]
    tool_calls = sum(s.total("rollpoint_resources_tool_calls_total") for s in resources)
    assert tool_calls > 0
    assert sum(s.total("rollpoint_resources_conflicts_total") for s in resources) == 0


@pytest.fixture
def resources_app() -> FastAPI:
    return create_resources_app("workplace", name="resources", replica="replica-0")


@pytest.fixture
def resources_url(resources_app: FastAPI) -> Iterator[str]:
    with serve_app(resources_app) as url:
        yield url


def test_resources_count_applied_calls_replays_and_409s_by_code(
    resources_app: FastAPI, resources_url: str
) -> None:
    task = WorkplaceEnvironment().make_tasks(1, seed=11)[0]
    episode = {"rollout_id": "r1", "attempt": 0}
    search = {"episode": episode, "turn": 0, "call_index": 0, "arguments": '{"query": "sync"}'}
    tool = f"{resources_url}/tools/calendar_search_events"
    with httpx.Client(timeout=10) as http:
        start = {"episode": episode, "task": task.model_dump(mode="json")}
        http.post(f"{resources_url}/episodes/start", json=start).raise_for_status()
        http.post(tool, json=search).raise_for_status()
        http.post(tool, json=search).raise_for_status()  # the same key: a replay

        def retired(e: EpisodeId) -> None:
            raise StaleAttemptError(f"{e.rollout_id}#{e.attempt} is retired")

        resources_service(resources_app).attempt_guard = retired
        refused = http.post(tool, json={**search, "turn": 1})
        assert refused.status_code == 409
        page = Scrape(f"{resources_url}/metrics")
    assert page.total("rollpoint_resources_tool_calls_total") == 1
    assert page.total("rollpoint_resources_tool_replays_total") == 1
    assert page.total("rollpoint_resources_conflicts_total", code="stale_attempt") == 1
    assert page.total("rollpoint_resources_episodes") == 1


def test_two_trainers_in_one_process_keep_their_own_counts() -> None:
    a, b = TrainerMetrics(), TrainerMetrics()
    try:
        a.record_restore("start", continued=3, restarted=1)
        pa = Scrape(f"http://127.0.0.1:{a.serve()}/metrics")
        pb = Scrape(f"http://127.0.0.1:{b.serve()}/metrics")
    finally:
        a.close()
        b.close()
    assert pa.total("rollpoint_restores_total", kind="start") == 1
    assert pa.total("rollpoint_restored_episodes_total", outcome="continued") == 3
    assert pb.total("rollpoint_restores_total") == 0


def test_metrics_port_in_use_is_one_line_naming_the_keys() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        metrics = TrainerMetrics()
        with pytest.raises(ConfigError, match=r"metrics\.port") as err:
            metrics.serve("127.0.0.1", port)
    assert "\n" not in err.value.message
