"""Snapshots that fail, on a live job: the failed one is never published, the run goes on.

Each test runs a real job (the real trainer and coordinator; every environment server a
real uvicorn server on loopback, in a thread of the test process, so it starts in a fraction of a second
and takes a short lease grace) with one participant's control plane behind a
:class:`~rollpoint.testing.FaultProxy`: that participant answers garbage, answers too late,
drops off the network or loses a reply, in one phase of a save. The data plane stays
direct. The test takes the snapshots itself (``coordinator.save()``) while the job runs,
so each fault lands on the save it is meant for, and then checks what a user relies on:
the job finishes with every (group, row) trained exactly once, the failed snapshot left
nothing behind, every participant is serving again, and the next snapshot commits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import orjson
import pytest

from rollpoint.app.config import RunConfig
from rollpoint.envs import get_environment
from rollpoint.http.client import HttpClient
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.control import CONTROL_PREFIX, Phase
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import SnapshotError
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.participant_state import MANIFEST_NAME
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing import Fault, FaultProxy, LocalCluster
from rollpoint.testing.faulty_store import ERRNOS, fail_writes, heal, store_url
from rollpoint.trainer.control.control_plane import ControlPlane, participant_clients
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.record.workdir_record import TRAIN_DATA_FILE
from rollpoint.trainer.snapshot.coordinator import SaveReport, SnapshotCoordinator
from rollpoint.trainer.train_hooks import TrainHooks, TrainSample
from rollpoint.trainer.trainer import RunSummary, Trainer
from tests.support.job_config import job_config
from tests.support.polling import eventually
from tests.support.records import records_paths

pytestmark = pytest.mark.integration

PREPARE = f"{CONTROL_PREFIX}/prepare"
COMMIT = f"{CONTROL_PREFIX}/commit"
RESUME = f"{CONTROL_PREFIX}/resume"
CONFIRM = f"{CONTROL_PREFIX}/confirm"
DEADLINE_S = 4.0
"""Each save's deadline: a fault that answers late waits past it, and a good save's writes
must finish within it on a loaded machine too (at 1.5 s, 4 workers on a busy 2-core machine
saw a good save's confirm fail: "the write outlived the deadline")."""
LEASE_GRACE_S = 1.0
POLICY_LATENCY_MS = 60.0
TASKS, GROUP_SIZE = 8, 2
MODEL, AGENT, RESOURCES = ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES


def job(tmp_path: Path, **snapshot: Any) -> RunConfig:
    """Long enough for a failed save and a good one mid-run; snapshots only when asked."""
    return job_config(
        tmp_path,
        tasks=TASKS,
        group_size=GROUP_SIZE,
        concurrency=4,
        policy={},
        train={"batch_size": 4, "checkpoint_every_steps": None},
        snapshot={"keep": 50, "deadline_seconds": DEADLINE_S, "retry_after_seconds": 0} | snapshot,
    )


@dataclass
class Harness:
    config: RunConfig
    trainer: Trainer
    store: SnapshotStore
    proxy: FaultProxy
    direct: dict[str, ParticipantClient]
    """Every participant by label, reached without the proxy."""
    held_back: list[TaskRow] = field(default_factory=list)
    """The job's last tasks, not given to the trainer yet (:meth:`send_held_back`)."""

    def send_held_back(self) -> None:
        """Give the trainer the tasks held back; it ends once they are trained too."""
        self.trainer.add_groups(self.held_back)
        self.trainer.end_groups()

    @property
    def coordinator(self) -> SnapshotCoordinator:
        assert self.trainer.coordinator is not None
        return self.trainer.coordinator

    async def phases(self) -> dict[str, Phase]:
        replies = await asyncio.gather(*(c.status() for c in self.direct.values()))
        return {label: reply.phase for label, reply in zip(self.direct, replies, strict=True)}

    async def start(self) -> asyncio.Task[RunSummary]:
        """Start the job; return once episodes are in flight."""
        run = asyncio.create_task(self.trainer.run())
        await eventually(
            lambda: run.done() or self.trainer.ledger.in_flight_count() >= 2,
            "episodes in flight",
        )
        assert not run.done(), "the job ended before any fault could be injected"
        return run


@asynccontextmanager
async def harness(
    config: RunConfig,
    behind_proxy: ParticipantKind = AGENT,
    hooks: TrainHooks | None = None,
    *,
    hold_back: int = 0,
) -> AsyncIterator[Harness]:
    """The job's deployment, with replica-0's ``behind_proxy`` participant behind a proxy.
    With ``hold_back``, the trainer starts on all but the job's last ``hold_back`` tasks and
    does not end until the test sends them (``Harness.send_held_back``)."""
    token = secrets.token_urlsafe(16)
    root = config.snapshot_root()
    store = SnapshotStore(root, keep=config.snapshot.keep)
    metrics = TrainerMetrics(config.workdir / "metrics.jsonl")
    with LocalCluster(
        control_token=token,
        snapshot_root=root,
        replicas=config.replicas,
        lease_grace_s=LEASE_GRACE_S,
        latency_ms=POLICY_LATENCY_MS,
        seed=config.seed,
    ) as cluster:
        deployment = cluster.deployment()
        async with HttpClient(token=token) as http:
            clients = participant_clients(deployment, http)
            (target,) = [
                c
                for c in clients
                if c.address.kind == behind_proxy and c.address.replica == "replica-0"
            ]
            async with FaultProxy(target.address.url) as proxy:
                proxied = ParticipantClient(replace(target.address, url=proxy.url), http)
                participants = [proxied if c is target else c for c in clients]
                control = ControlPlane(participants, store, metrics)
                tasks = get_environment(config.environment).make_tasks(TASKS, config.seed)
                first, held = tasks[: TASKS - hold_back], tasks[TASKS - hold_back :]
                trainer = Trainer(
                    config.trainer_settings(),
                    deployment,
                    first,
                    control=control,
                    hooks=hooks or SimulatedTrainer(config.train.step_seconds),
                    more_groups=bool(held),
                )
                direct = {c.label: c for c in clients}
                yield Harness(config, trainer, store, proxy, direct, held)


# --- what every test checks ------------------------------------------------------------


def assert_trained_exactly_once(h: Harness, summary: RunSummary) -> None:
    assert summary.failed_groups == {}
    assert summary.episodes == TASKS * GROUP_SIZE
    rows = [
        orjson.loads(line)
        for line in (h.config.workdir / TRAIN_DATA_FILE).read_bytes().splitlines()
    ]
    trained = Counter((r["group_id"], r["row"]) for r in rows)
    assert set(trained.values()) == {1}, f"trained more than once: {trained.most_common(3)}"
    assert len(trained) == TASKS * GROUP_SIZE


def assert_left_nothing(h: Harness, report: SaveReport, root: Path | None = None) -> None:
    """A failed snapshot is not published, listed, or left half-written anywhere (under
    ``root``: the store's local folder when the store is named by a URL)."""
    assert not report.published and report.manifest is None
    listed = {s.snapshot_id for s in h.store.list_snapshots(include_invalid=True)}
    assert report.snapshot_id not in listed
    root = root or Path(h.store.root)
    assert not (root / "snapshots" / report.snapshot_id).exists()
    assert not (root / "staging" / report.snapshot_id).exists()


async def assert_all_idle(h: Harness) -> None:
    phases = await h.phases()
    assert set(phases.values()) == {Phase.IDLE}, phases


async def assert_commits(h: Harness) -> SaveReport:
    report = await h.coordinator.save()
    assert report.published, report.blocked_by
    assert h.store.verify(report.snapshot_id).checkpoint_id == report.snapshot_id
    return report


def resumes_sent(h: Harness) -> int:
    return h.proxy.stats.by_route.get(f"POST {RESUME}", 0)


# --- prepare and commit ----------------------------------------------------------------

FAILED_SAVES = [
    pytest.param(
        AGENT,
        lambda: Fault.garbage(path=PREPARE, forward=True),
        r"agent@replica-0 prepare: .*not JSON",
        id="prepare-answers-garbage",
    ),
    pytest.param(
        AGENT,
        lambda: Fault.delay(DEADLINE_S + 0.3, path=PREPARE),
        r"agent@replica-0 prepare: .*deadline",
        id="prepare-arrives-after-the-deadline",
    ),
    pytest.param(
        RESOURCES,
        lambda: Fault.garbage(path=COMMIT, forward=True),
        r"resources@replica-0 commit: .*not JSON",
        id="commit-answers-garbage",
    ),
    pytest.param(
        MODEL,
        lambda: Fault.delay(DEADLINE_S + 0.3, path=COMMIT),
        r"model@replica-0 commit: .*deadline",
        id="commit-arrives-after-the-deadline",
    ),
    pytest.param(
        AGENT,
        lambda: Fault.drop_reply(path=COMMIT),
        r"agent@replica-0 commit: .*Disconnected",
        id="commit-reply-lost",
    ),
]


@pytest.mark.parametrize(("behind_proxy", "fault", "blocked_by"), FAILED_SAVES)
async def test_a_failed_save_leaves_nothing_and_the_run_goes_on(
    tmp_path: Path,
    behind_proxy: ParticipantKind,
    fault: Callable[[], Fault],
    blocked_by: str,
) -> None:
    async with harness(job(tmp_path), behind_proxy) as h:
        run = await h.start()
        rule = h.proxy.add(fault())
        failed = await h.coordinator.save()
        assert rule.hits == 1
        assert re.search(blocked_by, failed.blocked_by), failed.blocked_by
        assert_left_nothing(h, failed)
        # The abort reopened everyone at once (no lease had to lapse), resuming each once.
        await assert_all_idle(h)
        assert resumes_sent(h) == 1
        await assert_commits(h)
        summary = await run
        await assert_all_idle(h)
    assert_trained_exactly_once(h, summary)


# The write runs after the pause (detached) and is confirmed before the publish. Confirm is
# idempotent, so one lost or garbled confirm is sent again; a second failure fails the save
# like a failed commit, and nothing is published.
CONFIRM_FAULTS = [
    pytest.param(
        AGENT,
        lambda times: Fault.drop_reply(path=CONFIRM, times=times),
        r"agent@replica-0 confirm: .*Disconnected",
        id="confirm-reply-lost",
    ),
    pytest.param(
        RESOURCES,
        lambda times: Fault.garbage(path=CONFIRM, forward=True, times=times),
        r"resources@replica-0 confirm: .*not JSON",
        id="confirm-answers-garbage",
    ),
]


def confirms_sent(h: Harness) -> int:
    return h.proxy.stats.by_route.get(f"POST {CONFIRM}", 0)


@pytest.mark.parametrize(("behind_proxy", "fault", "blocked_by"), CONFIRM_FAULTS)
async def test_a_confirm_that_fails_once_is_sent_again_and_the_snapshot_is_kept(
    tmp_path: Path,
    behind_proxy: ParticipantKind,
    fault: Callable[[int], Fault],
    blocked_by: str,
) -> None:
    async with harness(job(tmp_path), behind_proxy) as h:
        run = await h.start()
        rule = h.proxy.add(fault(1))
        report = await h.coordinator.save()
        assert rule.hits == 1
        assert report.published, report.blocked_by
        assert confirms_sent(h) == 2
        assert h.store.verify(report.snapshot_id).checkpoint_id == report.snapshot_id
        summary = await run
        await assert_all_idle(h)
    assert_trained_exactly_once(h, summary)


@pytest.mark.parametrize(("behind_proxy", "fault", "blocked_by"), CONFIRM_FAULTS)
async def test_a_confirm_that_fails_twice_fails_the_save_and_leaves_nothing(
    tmp_path: Path,
    behind_proxy: ParticipantKind,
    fault: Callable[[int], Fault],
    blocked_by: str,
) -> None:
    async with harness(job(tmp_path), behind_proxy) as h:
        run = await h.start()
        rule = h.proxy.add(fault(2))
        failed = await h.coordinator.save()
        assert rule.hits == 2
        assert re.search(blocked_by, failed.blocked_by), failed.blocked_by
        assert_left_nothing(h, failed)
        await assert_all_idle(h)
        assert resumes_sent(h) == 1
        await assert_commits(h)
        summary = await run
        await assert_all_idle(h)
    assert_trained_exactly_once(h, summary)


async def test_a_prepare_that_never_answers_is_aborted_at_the_deadline(tmp_path: Path) -> None:
    deadline_s = 0.5  # nothing runs: every other participant is ready at once
    async with harness(job(tmp_path, deadline_seconds=deadline_s), AGENT) as h:
        rule = h.proxy.add(Fault.hold(path=PREPARE))
        failed = await h.coordinator.save()
        assert rule.hits == 1
        assert "agent@replica-0" in failed.blocked_by
        assert_left_nothing(h, failed)
        await assert_all_idle(h)
        assert failed.pause_s < deadline_s + 1.0, f"paused {failed.pause_s:.1f}s"


async def test_a_participant_cut_off_in_prepare_reopens_when_its_lease_lapses(
    tmp_path: Path,
) -> None:
    async with harness(job(tmp_path), AGENT) as h:
        run = await h.start()
        # The agent gets the prepare and closes; then the network drops it: its reply,
        # the renewals and both resumes are lost.
        rule = h.proxy.add(Fault.refuse(path=PREPARE, forward=True))
        failed = await h.coordinator.save()
        assert rule.hits == 1
        assert "agent@replica-0 prepare" in failed.blocked_by
        assert_left_nothing(h, failed)
        status = await h.direct["agent@replica-0"].status()
        assert status.phase in (Phase.PREPARING, Phase.PREPARED)
        assert status.checkpoint_id == failed.snapshot_id
        assert status.lease_expires_at is not None
        others = {k: v for k, v in (await h.phases()).items() if k != "agent@replica-0"}
        assert set(others.values()) == {Phase.IDLE}
        await h.proxy.heal()
        await wait_reopened_by_lease(h, "agent@replica-0", status.lease_expires_at)
        await assert_commits(h)
        summary = await run
        await assert_all_idle(h)
    assert_trained_exactly_once(h, summary)


async def wait_reopened_by_lease(h: Harness, label: str, lease_expires_at: float) -> None:
    async def idle() -> bool:
        return (await h.direct[label].status()).phase == Phase.IDLE

    await eventually(idle, f"{label} reopened by its lease", within_s=DEADLINE_S + 5)
    # Reopened by the lease (not sooner, nobody could resume it), and within seconds of it.
    assert lease_expires_at - 0.1 <= time.time() <= lease_expires_at + 1.5


# --- resume ----------------------------------------------------------------------------


async def test_a_lost_resume_reply_is_retried_and_the_snapshot_is_kept(tmp_path: Path) -> None:
    async with harness(job(tmp_path), AGENT) as h:
        run = await h.start()
        rule = h.proxy.add(Fault.drop_reply(path=RESUME))
        report = await h.coordinator.save()
        assert rule.hits == 1
        # The agent did resume; the retry finds it idle. The cut was good: it is published.
        assert report.published, report.blocked_by
        assert resumes_sent(h) == 2
        await assert_all_idle(h)
        await assert_commits(h)
        summary = await run
        await assert_all_idle(h)
    assert_trained_exactly_once(h, summary)


async def test_a_resume_that_never_arrives_is_covered_by_the_lease(tmp_path: Path) -> None:
    async with harness(job(tmp_path), AGENT) as h:
        run = await h.start()
        rule = h.proxy.add(Fault.reset(path=RESUME, times=2))
        report = await h.coordinator.save()
        assert rule.hits == 2  # the resume and its one retry
        assert report.published, report.blocked_by
        status = await h.direct["agent@replica-0"].status()
        assert status.phase == Phase.COMMITTED and status.checkpoint_id == report.snapshot_id
        assert status.lease_expires_at is not None
        assert status.lease_expires_at - time.time() < DEADLINE_S + LEASE_GRACE_S + 0.5
        await wait_reopened_by_lease(h, "agent@replica-0", status.lease_expires_at)
        await assert_all_idle(h)
        await assert_commits(h)
        summary = await run
        await assert_all_idle(h)
    assert_trained_exactly_once(h, summary)


async def test_the_save_after_a_lost_resume_does_not_wait_for_the_lease(tmp_path: Path) -> None:
    async with harness(job(tmp_path), AGENT) as h:
        run = await h.start()
        h.proxy.add(Fault.reset(path=RESUME, times=2))
        assert (await h.coordinator.save()).published
        # Snapshots can come faster than a lease lapses; the next one must still commit.
        try:
            await assert_commits(h)
        finally:
            summary = await run
    assert_trained_exactly_once(h, summary)


# --- the store's disk --------------------------------------------------------------------


@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
async def test_a_store_failing_every_write_fails_that_save_and_the_next_one_commits(
    tmp_path: Path, error: Literal["ENOSPC", "EIO"]
) -> None:
    # The store on the fault-injecting disk rollpoint chaos fills (every process writing
    # the store, the trainer and each participant server, meets the failure). The disk
    # fails for exactly one save: the test takes it, then heals the disk.
    folder = tmp_path / "snapshots"
    async with harness(job(tmp_path, store=store_url(folder)), AGENT) as h:
        run = await h.start()
        await assert_commits(h)
        fail_writes(folder, error)
        try:
            failed = await h.coordinator.save()
        finally:
            heal(folder)
        assert os.strerror(ERRNOS[error]) in failed.blocked_by, failed.blocked_by
        assert_left_nothing(h, failed, root=folder)
        await assert_all_idle(h)
        await assert_commits(h)
        summary = await run
        await assert_all_idle(h)
    assert_trained_exactly_once(h, summary)


# --- the failure budget ----------------------------------------------------------------


async def test_three_failed_snapshots_in_a_row_stop_the_run_naming_each_blocker(
    tmp_path: Path,
) -> None:
    async with harness(job(tmp_path, every_seconds=0.2), AGENT) as h:
        rule = h.proxy.add(Fault.garbage(path=PREPARE, times=None))
        with pytest.raises(SnapshotError) as stopped:
            await h.trainer.run()
        history = h.coordinator.history
        assert [r.published for r in history] == [False, False, False]
        message = stopped.value.message
        assert message.startswith("3 snapshots failed in a row; stopping the run")
        for report in history:
            assert f"{report.snapshot_id}: agent@replica-0 prepare" in message
            assert_left_nothing(h, report)
        assert rule.hits == 3
        await assert_all_idle(h)


async def test_a_run_whose_last_snapshot_fails_saves_again_before_it_ends(
    tmp_path: Path,
) -> None:
    # The chaos run's trials 85 and 473: the snapshot after the last step failed (a server
    # stopped for a moment), and the run ended with its newest snapshot behind its steps.
    last_step = TASKS * GROUP_SIZE // 4
    proxy: list[FaultProxy] = []

    class FailTheLastSave(SimulatedTrainer):
        async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
            if step == last_step:  # the next save is this step's checkpoint's: it fails
                proxy[0].add(Fault.garbage(path=PREPARE, times=2))
            return await super().train_step(step, batch)

    config = job(tmp_path, retry_after_seconds=30)
    config = config.model_copy(
        update={"train": config.train.model_copy(update={"checkpoint_every_steps": 1})}
    )
    async with harness(config, AGENT, hooks=FailTheLastSave()) as h:
        proxy.append(h.proxy)
        summary = await h.trainer.run()
        history = h.coordinator.history
    assert_trained_exactly_once(h, summary)
    assert [r.published for r in history[-3:]] == [False, False, True]
    last = h.store.latest()
    assert last is not None and last.snapshot_id == history[-1].snapshot_id
    assert last.train_step == last_step


# --- corrupt and partial snapshots -----------------------------------------------------


async def test_corrupt_or_partial_snapshots_are_never_listed_as_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with harness(job(tmp_path), AGENT, hold_back=1) as h:
        run = await h.start()
        first = await assert_commits(h)
        second = await assert_commits(h)
        # The newest must hold a record the older two do not (a write adds only what
        # changed since the participant's previous one): a policy call finished after the
        # second's cut. The last group is sent only now, so one does, however fast or slow
        # the rest of the job went (it may have finished before the second).
        calls = await model_calls(h)
        h.send_held_back()
        await eventually(
            lambda: more_model_calls(h, calls), "a policy call after the second", within_s=120
        )
        newest = await assert_commits(h)
        summary = await run
    assert_trained_exactly_once(h, summary)
    root = Path(h.store.root)
    # A crash mid-save: a staging folder, and a renamed folder whose manifest never came.
    (root / "staging" / "snap-crashed").mkdir(parents=True)
    (root / "staging" / "snap-crashed" / "ledger.json").write_bytes(b"{}")
    unpublished = root / "snapshots" / "snap-unpublished"
    (unpublished / "participants").mkdir(parents=True)
    # One byte flipped in a records file only the newest snapshot names (records files
    # are shared: one the older snapshots reference would fail them too).
    records = fresh_records_file(h.store, newest.snapshot_id, [first, second])
    data = bytearray(records.read_bytes())
    data[len(data) // 2] ^= 0x01
    records.write_bytes(bytes(data))
    # An older one lost a participant's manifest: its state folder no longer exists.
    lost = Path(h.store.participant_dir(second.snapshot_id, "model", "model-replica-1"))
    (lost / MANIFEST_NAME).unlink()

    valid = [s.snapshot_id for s in h.store.list_snapshots()]
    assert valid == [first.snapshot_id]
    every = {s.snapshot_id: s for s in h.store.list_snapshots(include_invalid=True)}
    assert set(every) == {
        first.snapshot_id,
        second.snapshot_id,
        newest.snapshot_id,
        "snap-unpublished",
    }
    assert not every["snap-unpublished"].valid
    assert "manifest" in (every["snap-unpublished"].reason or "")
    assert not every[newest.snapshot_id].valid
    assert records.name in (every[newest.snapshot_id].reason or "")
    assert "digest" in (every[newest.snapshot_id].reason or "")
    assert not every[second.snapshot_id].valid
    assert f"{MANIFEST_NAME} is missing" in (every[second.snapshot_id].reason or "")

    with caplog.at_level(logging.WARNING, logger="rollpoint.store"):
        latest = h.store.latest()
    assert latest is not None and latest.snapshot_id == first.snapshot_id
    skipped = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(skipped) == 2
    assert newest.snapshot_id in skipped[0] and records.name in skipped[0]
    assert second.snapshot_id in skipped[1]


async def model_calls(h: Harness) -> int:
    """Policy calls the model servers have finished, all replicas together (monotonic)."""
    replies = await asyncio.gather(
        *(c.status() for c in h.direct.values() if c.address.kind == MODEL)
    )
    return sum(reply.counts["calls_total"] for reply in replies)


async def more_model_calls(h: Harness, than: int) -> bool:
    return await model_calls(h) > than


def named_records_files(store: SnapshotStore, snapshot_id: str) -> list[Path]:
    """Every records file a snapshot's participant states name, in the order they name them."""
    manifest = store.load(snapshot_id)
    folder = Path(store.snapshot_dir(snapshot_id))
    paths: list[Path] = []
    for entry in manifest.participants:
        state = (folder / entry.manifest_path).parent
        paths += [p for p in records_paths(state, store.root) if p not in paths]
    return paths


def fresh_records_file(
    store: SnapshotStore, snapshot_id: str, older: list[SnapshotManifest]
) -> Path:
    """A records file ``snapshot_id`` names and none of ``older`` does."""
    seen = {p for o in older for p in named_records_files(store, o.snapshot_id)}
    fresh = [p for p in named_records_files(store, snapshot_id) if p not in seen]
    assert fresh, f"snapshot {snapshot_id} wrote no records file of its own"
    return fresh[0]
