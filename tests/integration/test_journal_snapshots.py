"""Pause-free snapshots of a live job (``snapshot.mode: journal``, issue 37 item 2).

Real server processes with their journals on, the real trainer and coordinator. What the
servers themselves report decides: each fence counts the times it closed admission
(``counts.admission_closes`` in its status), each model server the policy calls it answered
(``calls_total``) and those running (``in_flight``). At the point of a save where the
trainer is about to capture its ledger (every participant has checkpointed in journal mode;
every one has prepared in a cut), the test waits until the model servers answered more
calls than were running when it began: calls admitted during the snapshot. A cut cannot
get there (its model gates are closed, so only the calls already running finish), which
the second test shows.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.config import RunConfig
from rollpoint.protocol.participant import ParticipantKind
from tests.support.embedded_job import EmbeddedJob, embedded_job
from tests.support.job_config import job_config

pytestmark = pytest.mark.process

ADMITTED_DURING = 3
"""Calls admitted and answered while the save waits at its capture point."""


def job(tmp_path: Path, mode: str) -> RunConfig:
    return job_config(
        tmp_path,
        **{
            "tasks": 8,
            "concurrency": 8,
            "policy": {"latency_ms": 40, "error_rate": 0.0},
            "journal": {"enabled": True},
            "snapshot": {"every_seconds": 600, "keep": 50, "deadline_seconds": 20, "mode": mode},
            "train": {"checkpoint_every_steps": 1000},
        },
    )


async def model_counts(h: EmbeddedJob) -> tuple[int, int]:
    """(calls answered, calls running) summed over the model servers, from their status."""
    models = [p for p in h.participants() if p.address.kind == ParticipantKind.MODEL]
    statuses = await asyncio.gather(*(m.status() for m in models))
    return (
        sum(s.counts["calls_total"] for s in statuses),
        sum(s.counts["in_flight"] for s in statuses),
    )


async def save_while_watching(h: EmbeddedJob, wait_s: float) -> dict[str, Any]:
    """Run the job; once a few calls are done, take one save and, at its capture point,
    wait (at most ``wait_s``) for calls admitted after that point to be answered."""
    coordinator = h.trainer.coordinator
    assert coordinator is not None
    seen: dict[str, Any] = {}

    async def watch() -> None:
        answered, running = await model_counts(h)
        target = answered + running + ADMITTED_DURING
        give_up = time.monotonic() + wait_s
        now = answered
        while now < target and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
            now, _ = await model_counts(h)
        seen.update(answered=answered, running=running, at_capture=now, target=target)

    run = asyncio.create_task(h.trainer.run())
    while (await model_counts(h))[0] < 4:
        assert not run.done(), "the job ended before the save"
        await asyncio.sleep(0.02)
    coordinator.before_capture = watch
    report = await coordinator.save()
    coordinator.before_capture = None
    seen["report"] = report
    seen["summary"] = await run
    return seen


async def test_a_journal_snapshot_never_closes_admission_and_calls_go_on_through_it(
    tmp_path: Path,
) -> None:
    config = job(tmp_path, "journal")
    async with embedded_job(config) as h:
        seen = await save_while_watching(h, wait_s=30)
        closes = {p.label: (await p.status()).counts["admission_closes"] for p in h.participants()}
    report, summary = seen["report"], seen["summary"]
    assert report.published, report.blocked_by
    assert seen["at_capture"] >= seen["target"], seen
    # No participant ever closed admission, for this save or any other of the run.
    assert set(closes.values()) == {0}, closes
    assert summary.episodes == 8 * config.group_size and not summary.failed_groups
    events = [
        orjson.loads(line)
        for line in (config.workdir / "metrics.jsonl").read_bytes().splitlines()
        if b'"snapshot"' in line
    ]
    published = [e for e in events if e.get("outcome") == "published"]
    assert published and all(e["pause_seconds"] == 0 for e in published), published
    manifests = h.published()
    assert manifests and all(m.pause_seconds == 0 for m in manifests)
    ours = next(m for m in manifests if m.snapshot_id == report.snapshot_id)
    assert ours.journaled and ours.episodes == []


async def test_a_cut_closes_admission_so_no_call_is_admitted_at_its_capture(
    tmp_path: Path,
) -> None:
    config = job(tmp_path, "cut")
    async with embedded_job(config) as h:
        seen = await save_while_watching(h, wait_s=1.5)
        closes = [(await p.status()).counts["admission_closes"] for p in h.participants()]
    assert seen["report"].published, seen["report"].blocked_by
    # Only the calls running at the close finish: none admitted after it.
    assert seen["at_capture"] <= seen["answered"] + seen["running"], seen
    assert min(closes) >= 1, closes
