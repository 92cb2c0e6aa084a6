"""Snapshots in an object store: ``snapshot.store: s3://…`` SIGKILLed and rerun to the end.

The test starts an S3-compatible server on loopback itself (moto's server mode, in a
thread of the test process), points ``rollpoint run`` and every server it starts at it
through the standard AWS environment variables (``AWS_ENDPOINT_URL``, keys, region), which
s3fs reads, and kills the real command with SIGKILL. Between the kill and the rerun, the
newest snapshot's manifest object is tampered with and the next one's is deleted: the rerun
must skip both, resume from the object store's third-newest snapshot, and train every row
once (I1), apply every side effect once (I2) and never regenerate a turn (I3).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from rollpoint.app.config import load_config
from rollpoint.job.tasks import load_tasks_for
from rollpoint.testing import invariants
from tests.support.moto_s3 import moto_s3
from tests.support.run_process import Finished, RunProcess

pytestmark = pytest.mark.chaos

BUCKET = "rollpoint-test"
PREFIX = "runs/job-1"
STORE = f"s3://{BUCKET}/{PREFIX}"
_RESUMED_FROM = re.compile(r"resumed\s+from\s+snapshot\s+(\S+)")


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1, its bucket, and an s3fs client of it; the run's child
    processes inherit the settings that point at it."""
    with moto_s3(monkeypatch, BUCKET) as fs:
        yield fs


@pytest.fixture
def runs() -> Iterator[list[RunProcess]]:
    started: list[RunProcess] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.kill()


def write_config(tmp_path: Path) -> Path:
    config = {
        "workdir": str(tmp_path / "run"),
        "environment": "workplace",
        "tasks": 16,
        "group_size": 2,
        "max_turns": 8,
        "replicas": 2,
        "concurrency": 8,
        "policy": {"latency_ms": 60, "error_rate": 0},
        "snapshot": {"every_seconds": 0.3, "store": STORE, "keep": 3},
        "train": {"batch_size": 4},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def published(fs: Any) -> list[str]:
    """Snapshot ids whose manifest object exists and decodes, oldest first (by publication
    time)."""
    fs.invalidate_cache()
    stamped = []
    for manifest in fs.glob(f"{BUCKET}/{PREFIX}/snapshots/*/manifest.json"):
        try:
            published_at = orjson.loads(fs.cat_file(manifest))["published_at"]
        except orjson.JSONDecodeError:
            continue  # the one the test tampered with
        except FileNotFoundError:
            continue  # pruned by the run between the listing and the read (a CI run)
        stamped.append((published_at, manifest.split("/")[-2]))
    return [snapshot_id for _, snapshot_id in sorted(stamped)]


def objects(fs: Any, snapshot_id: str) -> set[str]:
    fs.invalidate_cache()
    return set(fs.find(f"{BUCKET}/{PREFIX}/snapshots/{snapshot_id}"))


def start(runs: list[RunProcess], config: Path) -> RunProcess:
    runs.append(RunProcess(config))
    return runs[-1]


def finish(runs: list[RunProcess], config: Path) -> Finished:
    done = start(runs, config).finish(timeout_s=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return done


@pytest.mark.timeout(400)  # ~40 s alone; an S3 round trip per object on a loaded machine
def test_a_run_on_an_object_store_killed_and_rerun_trains_every_row_once(
    tmp_path: Path, s3: Any, runs: list[RunProcess]
) -> None:
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    run = start(runs, config)
    run.wait_until(lambda: any((workdir / "checkpoints").glob("step-*.json")), "a train checkpoint")
    after_checkpoint = set(published(s3))
    run.wait_until(
        lambda: len(set(published(s3)) - after_checkpoint) >= 3,
        "three snapshots in the object store after the first train checkpoint",
        timeout_s=120,
        poll_s=0.25,
    )
    survivors = run.kill()
    assert survivors == [], f"processes outlived the killed run: {survivors}"
    # Nothing of the store is local: the snapshots are objects only.
    assert not (workdir / invariants.SNAPSHOT_STORE_DIR).exists()

    *older, usable, missing, tampered = published(s3)
    manifest = f"{BUCKET}/{PREFIX}/snapshots/{tampered}/manifest.json"
    document = orjson.loads(s3.cat_file(manifest))
    s3.pipe_file(manifest, orjson.dumps(document)[:-40])  # a torn or tampered object
    s3.rm_file(f"{BUCKET}/{PREFIX}/snapshots/{missing}/manifest.json")
    kept_objects = objects(s3, usable)

    rerun = finish(runs, config)

    match = _RESUMED_FROM.search(rerun.stderr)
    assert match, rerun.stderr[-3000:]
    assert match.group(1) == usable, (match.group(1), usable, missing, tampered)
    loaded = load_config(config)
    rollouts, unreadable = invariants.read_train_data(workdir)
    tasks = load_tasks_for(loaded.job_settings())
    found = [
        *unreadable,
        *invariants.check_exactly_once(rollouts, invariants.expected_rows(tasks, 2)),
        *invariants.check_side_effects_once(
            rollouts, invariants.created_titles(tasks), full_reward="all"
        ),
        *invariants.check_no_regenerated_turns(rollouts),
    ]
    assert found == [], invariants.report(found)
    # The rerun published on the object store; retention removed whole snapshots only,
    # and never an object a kept snapshot references.
    final = published(s3)
    assert final and final[-1] not in {usable, missing, tampered, *older}
    s3.invalidate_cache()
    prefixes = {p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/{PREFIX}/snapshots")}
    assert prefixes == set(final), f"left behind: {sorted(prefixes - set(final))}"
    shared = (
        set(s3.ls(f"{BUCKET}/{PREFIX}/objects"))
        if s3.exists(f"{BUCKET}/{PREFIX}/objects")
        else set()
    )
    named = set().union(*(referenced(s3, snapshot_id) for snapshot_id in final))
    # A write the kill cut short leaves its temp file; retention deletes it 10 minutes on
    # (docs/protocol.md §8), so only a named records file must be named by a kept snapshot.
    unnamed = {o for o in shared - named if not o.rsplit("/", 1)[-1].startswith(".records-")}
    assert not unnamed, f"records files no kept snapshot names: {sorted(unnamed)}"
    for snapshot_id in final:
        found_objects = objects(s3, snapshot_id) | shared
        missing_objects = referenced(s3, snapshot_id) - found_objects
        assert not missing_objects, f"{snapshot_id} lost {sorted(missing_objects)}"
        # The manifest is the publication point: written after every object it names.
        stamps = {o: s3.info(o)["LastModified"] for o in found_objects}
        manifest_at = stamps.pop(f"{BUCKET}/{PREFIX}/snapshots/{snapshot_id}/manifest.json")
        named_here = referenced(s3, snapshot_id)
        assert all(manifest_at >= at for o, at in stamps.items() if o in named_here), (
            snapshot_id,
            stamps,
        )
    if usable in final:
        assert objects(s3, usable) == kept_objects


def referenced(fs: Any, snapshot_id: str) -> set[str]:
    """Every object a published snapshot's manifest names, directly or through a
    participant's manifest or a trainer file kept as records (their records files)."""
    folder = f"{BUCKET}/{PREFIX}/snapshots/{snapshot_id}"
    manifest = orjson.loads(fs.cat_file(f"{folder}/manifest.json"))
    names = {f"{folder}/manifest.json"}
    names |= {f"{folder}/{entry['path']}" for entry in manifest["files"].values()}
    with_parts = [p["manifest_path"] for p in manifest["participants"]]
    with_parts += [e["path"] for e in manifest["files"].values() if e["format"] == "records"]
    for relative in with_parts:
        path = f"{folder}/{relative}"
        state = orjson.loads(fs.cat_file(path))
        names.add(path)
        names |= {
            f"{BUCKET}/{PREFIX}/objects/{part['file']}"
            if part["shared"]
            else f"{path.rpartition('/')[0]}/{part['file']}"
            for part in state["parts"]
        }
    return names
