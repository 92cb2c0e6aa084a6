"""Snapshots of live jobs: real server processes, the real trainer and coordinator.

Each test runs a short job on the embedded runtime with snapshots on, then reads what the
snapshot store holds and checks it against what the servers held at the cut.
"""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.config import RunConfig
from rollpoint.envs import get_environment
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import ConfigError
from rollpoint.servers.agent.session_parts import join_parts
from rollpoint.servers.resources.episode_record import EpisodeRecord
from rollpoint.store.participant_state import read_participant_state
from rollpoint.trainer.restore.resume_point import read_trainer_document
from rollpoint.trainer.snapshot.publication import LEDGER_FILE
from rollpoint.trainer.train_hooks import TrainSample
from rollpoint.trainer.trainer import Trainer
from rollpoint.tuning import collector_schedule as collector_schedule_module
from rollpoint.tuning.collector_listener import installed
from rollpoint.tuning.collector_schedule import collector_schedule
from tests.support.embedded_job import embedded_job
from tests.support.job_config import job_config

pytestmark = pytest.mark.process


def job(tmp_path: Path, **overrides: Any) -> RunConfig:
    return job_config(
        tmp_path,
        **{
            "tasks": 8,
            "concurrency": 16,
            "policy": {"latency_ms": 60, "error_rate": 0.0},
            "snapshot": {"every_seconds": 0.4, "keep": 50, "deadline_seconds": 5},
            **overrides,
        },
    )


def _tool_status(content: object) -> object:
    try:
        parsed = orjson.loads(str(content))
    except orjson.JSONDecodeError:
        return None
    return parsed.get("status") if isinstance(parsed, dict) else None


async def test_snapshots_of_a_live_job_hold_what_the_servers_held(tmp_path: Path) -> None:
    # Episodes in waves of four, each turn 200 ms: the job lasts several snapshot intervals,
    # so snapshots land with episodes in flight even when a loaded machine delays the first
    # ones (at 16 at once and 60 ms a turn, CI's job had ended before a snapshot caught one).
    config = job(tmp_path, concurrency=4, policy={"latency_ms": 200, "error_rate": 0.0})
    async with embedded_job(config) as h:
        summary = await h.trainer.run()
    assert summary.episodes == 16 and not summary.failed_groups
    manifests = h.published()
    assert manifests, "no snapshot was published during the job"
    with_episodes = [m for m in manifests if m.episodes]
    assert with_episodes, "no snapshot caught an episode in flight"
    m = with_episodes[0]
    assert {p.replica for p in m.participants} == {"replica-0", "replica-1"}
    assert len(m.participants) == 6
    folder = h.store.snapshot_dir(m.snapshot_id)
    for saved in m.episodes:
        agent_dir = h.store.participant_dir(m.snapshot_id, "agent", f"agent-{saved.replica}")
        _, agent_records = read_participant_state(
            agent_dir,
            kind="agent",
            instance=f"agent-{saved.replica}",
            checkpoint_id=m.checkpoint_id,
            root=h.store.root,
        )
        (session,) = [
            r
            for r in join_parts(agent_records)  # a long transcript is saved in parts
            if r.get("kind") == "session" and r["episode"]["rollout_id"] == saved.rollout_id
        ]
        # The agent's turn count is what the manifest says, and the model server's call
        # ledger holds one recorded call per completed turn of that episode — plus, at most,
        # the cut turn's call whose answer was still on its way to the agent.
        assert session["turn"] == saved.turns_completed
        model_dir = h.store.participant_dir(m.snapshot_id, "model", f"model-{saved.replica}")
        _, model_records = read_participant_state(
            model_dir,
            kind="model",
            instance=f"model-{saved.replica}",
            checkpoint_id=m.checkpoint_id,
            root=h.store.root,
        )
        calls = [r for r in model_records if r["episode"]["rollout_id"] == saved.rollout_id]
        assert saved.turns_completed <= len(calls) <= saved.turns_completed + 1
        # Every calendar event the episode created before the cut is in the saved tool state.
        created = [
            m2
            for m2 in session["messages"]
            if m2.get("role") == "tool" and _tool_status(m2.get("content")) == "created"
        ]
        res_dir = h.store.participant_dir(m.snapshot_id, "resources", f"resources-{saved.replica}")
        _, res_records = read_participant_state(
            res_dir,
            kind="resources",
            instance=f"resources-{saved.replica}",
            checkpoint_id=m.checkpoint_id,
            root=h.store.root,
        )
        (state,) = [r for r in res_records if r["rollout_id"] == saved.rollout_id]
        env = get_environment("workplace")
        record = EpisodeRecord.model_validate(state)
        task = TaskRow.model_validate(state["task"])
        # An episode no tool call had touched yet is saved as its fresh start (the task).
        calendar = (
            env.start(task)
            if record.fresh_start
            else env.restore_state(task, record.exported_state())
        )
        events = orjson.loads(env.call(calendar, "calendar_search_events", {"query": ""}))
        assert len(events) == len(created)
    # The ledger saved with the snapshot holds every saved episode as in flight.
    ledger_doc = read_trainer_document(h.store, m.snapshot_id, LEDGER_FILE)
    assert str(folder)
    assert ledger_doc["schema_version"] >= 1
    # Metrics: every published snapshot is measured, in Prometheus and in metrics.jsonl.
    events = [
        orjson.loads(line) for line in (config.workdir / "metrics.jsonl").read_bytes().splitlines()
    ]
    snaps = [e for e in events if e["event"] == "snapshot" and e["outcome"] == "published"]
    assert len(snaps) >= len(manifests)
    assert all(e["pause_seconds"] > 0 for e in snaps)


async def test_the_trainers_full_collections_run_on_the_schedule_for_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Due after every pause (not only 10 s apart), so a short job shows several. RATIO too:
    # the schedule is the process's, and an earlier test's long full collection (a big heap
    # late in the suite) times RATIO would otherwise push the next one past this job's end.
    monkeypatch.setattr(collector_schedule_module, "MIN_GAP_S", 0.0)
    monkeypatch.setattr(collector_schedule_module, "RATIO", 0.0)
    schedule = collector_schedule()
    thresholds = gc.get_threshold()
    full: list[float] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(time.monotonic())

    attached: list[bool] = []

    async def watch() -> None:
        while True:
            attached.append(schedule.attached and gc.get_threshold()[2] > 10**9)
            await asyncio.sleep(0.05)

    # Periodic snapshots only: train checkpoints' back-to-back saves keep the hold taken.
    config = job(
        tmp_path,
        tasks=16,
        policy={"latency_ms": 100, "error_rate": 0.0},
        train={"batch_size": 4, "checkpoint_every_steps": None},
    )
    gc.callbacks.append(record)
    try:
        # As run_job, the trainer's entry point, installs it (embedded_job builds the
        # trainer itself); the servers' processes install their own.
        with installed():
            async with embedded_job(config) as h:
                watcher = asyncio.create_task(watch())
                summary = await h.trainer.run()
                watcher.cancel()
    finally:
        gc.callbacks.remove(record)
    assert summary.episodes == 32 and not summary.failed_groups
    # CPython's own full collections were off from the run's start (its discovery) to its end:
    # once back on, on for good (the watcher may see the run's own close before it stops)
    assert True in attached
    since = attached[attached.index(True) :]
    assert since == sorted(since, reverse=True), since
    # ... and the schedule ran them instead, after pauses (none runs inside one: the
    # collector is held from the barrier closing to 0.25 s after it reopens).
    published = [r for r in h.trainer.coordinator.history if r.published]  # type: ignore[union-attr]
    assert len(published) >= 2 and full
    # After the run, the collector is as it was: thresholds back, nothing left frozen.
    assert not schedule.attached and gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0 and gc.isenabled()


async def test_restart_only_server_is_refused_unless_allowed(tmp_path: Path) -> None:
    config = job(tmp_path, environment="math", replicas=1, max_turns=1)
    async with embedded_job(config) as h:
        with pytest.raises(ConfigError, match=r"restart-only server\(s\) agent@replica-0"):
            await h.trainer.run()


async def test_allowed_restart_only_servers_save_no_session_and_never_block(tmp_path: Path) -> None:
    config = job(
        tmp_path,
        environment="math",
        replicas=1,
        max_turns=1,
        tasks=24,
        # Slow enough that several snapshots land while episodes are in flight, even on a
        # loaded machine.
        policy={"latency_ms": 400, "error_rate": 0.0},
        snapshot={"every_seconds": 0.2, "allow_restart_only": True, "keep": 50},
    )
    async with embedded_job(config) as h:
        summary = await h.trainer.run()
    assert summary.episodes == 48
    manifests = h.published()
    assert manifests
    # A restart-only agent never saves a session and never blocks a snapshot. (Which
    # in-flight episodes a cut lists as restarts depends on timing: a policy call admitted
    # before the gate closed finishes during the drain. The participant-level report of
    # restarts is pinned in tests/integration/test_participants.py.)
    assert all(m.episodes == [] for m in manifests)
    assert h.trainer.coordinator is not None
    assert all(r.published for r in h.trainer.coordinator.history)


class StepsEndingInSaves:
    """Train steps that end while a snapshot is being taken (they wait for one to start)."""

    def __init__(self) -> None:
        self.ended: list[tuple[int, float]] = []
        self.trainer: Trainer | None = None

    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        assert self.trainer is not None and self.trainer.coordinator is not None
        deadline = time.monotonic() + 5
        coordinator, barrier = self.trainer.coordinator, self.trainer.barrier
        # The coordinator exposes no event for "a save started"; a test may poll for it. The
        # barrier closed, not only the save's lock taken: the lock is held from before the
        # snapshot's start (the release flush), and a step ending then ends before it.
        while not (coordinator.saving and not barrier.is_open) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        self.ended.append((step, time.time()))
        return {"rollouts": float(len(batch))}


async def test_a_train_step_ending_during_a_save_does_not_discard_it(tmp_path: Path) -> None:
    hooks = StepsEndingInSaves()
    config = job(
        tmp_path,
        tasks=12,
        train={"batch_size": 4, "checkpoint_every_steps": None},
        snapshot={"every_seconds": 0.1, "keep": 200, "deadline_seconds": 5},
    )
    async with embedded_job(config, hooks=hooks) as h:
        hooks.trainer = h.trainer
        summary = await h.trainer.run()
    assert summary.train_steps >= 3
    manifests = h.published()
    overlapping = [
        m for m in manifests if any(m.created_at <= t <= m.published_at for _, t in hooks.ended)
    ]
    assert overlapping, "no train step ended during a save; the test did not exercise the case"
    failed = (
        [r for r in h.trainer.coordinator.history if not r.published]
        if h.trainer.coordinator
        else []
    )
    assert failed == []
