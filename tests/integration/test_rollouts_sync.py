"""The façade from a synchronous loop: ``rollpoint.SyncRollouts`` on the embedded runtime.

A real job (real server processes) is driven from plain Python with no event loop of the
caller's: every batch comes through the iterator once, ``snapshot()`` publishes a snapshot
from the caller's thread, and each row is trained once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from rollpoint import SyncRollouts
from rollpoint.app.config import RunConfig
from rollpoint.protocol.errors import BadRequestError, ConfigError
from rollpoint.store.snapshot_store import SnapshotStore
from tests.support.small_job import small_job

pytestmark = pytest.mark.integration


def job(tmp_path: Path) -> RunConfig:
    return small_job(tmp_path)


def test_a_synchronous_loop_pulls_every_batch_once_and_snapshots_from_its_thread(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    steps, rows, published = [], 0, []
    with SyncRollouts(config) as run:
        assert run.resumed_from is None and run.resumed_step == 0
        for batch in run.batches():
            steps.append(batch.step)
            rows += len(batch.samples)
            if batch.step == 1:
                published.append(run.snapshot().published)
            batch.done({"rows": float(len(batch.samples))})
        summary = run.summary()
    assert steps == [1, 2, 3] and rows == 12 == summary.episodes
    assert published == [True]
    trained = [
        orjson.loads(x) for x in (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    ]
    assert len({(r["group_id"], r["row"]) for r in trained}) == len(trained) == 12


def test_the_state_handed_over_with_a_step_comes_back_with_the_run_resumed_there(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    with SyncRollouts(config) as run:
        assert run.resumed_state is None
        for batch in run.batches():
            if batch.step == 3:
                break  # step 2 is checkpointed and its snapshot taken before step 3 comes
            batch.done(state={"weights": f"w/step-{batch.step}.pt", "cursor": batch.step * 4})

    with SyncRollouts(config) as run:
        assert run.resumed_step == 2
        assert run.resumed_state == {"weights": "w/step-2.pt", "cursor": 8}
        for batch in run.batches():
            batch.done()  # no new state: the last one is kept with the step
        run.summary()
    step_3 = orjson.loads((config.workdir / "checkpoints" / "step-00000003.json").read_bytes())
    assert step_3["trainer_state"] == {"weights": "w/step-2.pt", "cursor": 8}


def test_steps_the_trainer_makes_durable_later_are_where_a_rerun_resumes(
    tmp_path: Path,
) -> None:
    # A trainer whose weight saves run in the background: steps are done not durable, and
    # marked durable once the save lands. Only marked steps are checkpointed.
    config = job(tmp_path)
    checkpoints = config.workdir / "checkpoints"
    with SyncRollouts(config) as run:
        for batch in run.batches():
            if batch.step == 3:
                assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002.json"]
                break  # stopped with step 3 never done
            batch.done(state={"weights": f"w{batch.step}"}, durable=False)
            if batch.step == 2:
                with pytest.raises(BadRequestError, match=r"step 9 is not a trained step .*"):
                    run.mark_durable(9)
                run.mark_durable(2)  # covers step 1, never marked
                run.mark_durable(1)  # already covered: nothing happens

    with SyncRollouts(config) as run:
        assert run.resumed_step == 2 and run.resumed_state == {"weights": "w2"}
        for batch in run.batches():
            batch.done()
        run.summary()
    trained = [
        orjson.loads(x) for x in (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    ]
    assert len({(r["group_id"], r["row"]) for r in trained}) == len(trained) == 12


def test_steps_never_made_durable_are_trained_again_after_a_rerun(tmp_path: Path) -> None:
    config = job(tmp_path)
    with SyncRollouts(config) as run:
        for batch in run.batches():
            if batch.step == 3:
                break
            batch.done(durable=False)
    assert not (config.workdir / "checkpoints").exists() or not any(
        (config.workdir / "checkpoints").iterdir()
    )

    with SyncRollouts(config) as run:
        assert run.resumed_step == 0  # the only durable point: nothing trained
        steps = [batch.step for batch in run.batches()]
        run.summary()
    assert steps == [1, 2, 3]
    trained = [
        orjson.loads(x) for x in (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    ]
    assert len({(r["group_id"], r["row"]) for r in trained}) == len(trained) == 12


def test_settings_changed_in_code_are_what_the_run_does_and_what_a_rerun_is_checked_by(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    store = tmp_path / "elsewhere"
    settings = dataclasses.replace(config.job_settings(), snapshot_store=str(store))
    with SyncRollouts(settings) as run:
        assert run.settings is settings
        for batch in run.batches():
            batch.done()
        summary = run.summary()
    assert summary.episodes == 12
    listed = SnapshotStore(str(store), clean_leftovers=False).list_snapshots()
    assert listed and all(s.valid for s in listed)
    assert not (config.workdir / "snapshots").exists()
    # The snapshot's keys come from the settings: a rerun told another task count is
    # refused by the restore, naming the key, before any server starts.
    assert settings.tasks is not None
    more = settings.tasks + 1
    with (
        pytest.raises(
            ConfigError,
            match=rf"config key 'tasks' is {more} but snapshot \S+ was taken with {settings.tasks}",
        ),
        SyncRollouts(dataclasses.replace(settings, tasks=more)),
    ):
        pass
