"""One job per snapshot store (issue 33, item 4): a second job pointed at a store holding
the first one's snapshots is refused at start in one line naming both, and the first job's
snapshots stay (before, the second started over and its retention pruned them all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpoint.store.job_identity import JOB_FILE, STORE_JOB_FILE, read_workdir_job
from tests.integration.test_cli_run import rollpoint, train_lines, write_config

pytestmark = pytest.mark.integration


def _job(tmp_path: Path, name: str, store: Path) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return write_config(
        folder, replicas=1, snapshot={"store": str(store), "keep": 2, "every_seconds": 0.2}
    )


def _snapshots(store: Path) -> set[str]:
    return {p.name for p in (store / "snapshots").iterdir()}


def test_a_second_job_on_a_store_is_refused_in_one_line_naming_both(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first, second = _job(tmp_path, "a", store), _job(tmp_path, "b", store)
    done = rollpoint("run", str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    job_a = read_workdir_job(tmp_path / "a" / "run")
    assert job_a is not None
    kept = _snapshots(store)
    assert kept

    refused = rollpoint("run", str(second))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    (line,) = [line for line in refused.stderr.splitlines() if line.strip()]
    assert (
        f"snapshot store {store} belongs to job {job_a.job_id} (workdir {tmp_path / 'a' / 'run'})"
        in line
    )
    job_b = read_workdir_job(tmp_path / "b" / "run")
    assert job_b is not None and job_b.job_id != job_a.job_id
    assert f"not to this job {job_b.job_id} (workdir {tmp_path / 'b' / 'run'})" in line
    assert _snapshots(store) == kept

    # The store's own record of its job lost: every snapshot still names the job that took it.
    (store / STORE_JOB_FILE).unlink()
    refused = rollpoint("run", str(second))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    (line,) = [line for line in refused.stderr.splitlines() if line.strip()]
    assert f"holds {len(kept)} snapshot(s) of job {job_a.job_id}" in line
    assert f"not of this job {job_b.job_id} (workdir {tmp_path / 'b' / 'run'})" in line
    assert _snapshots(store) == kept
    assert not (store / STORE_JOB_FILE).exists()  # not claimed by the refused job

    # The first job still opens on its store (its run is finished: it says so) and
    # trains nothing twice.
    again = rollpoint("run", str(first))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished already" in again.stderr
    assert len(train_lines(tmp_path / "a" / "run")) == 8


def test_fresh_force_keeps_the_workdirs_job_identity(tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = _job(tmp_path, "a", store)
    assert rollpoint("run", str(config)).returncode == 0
    before = (tmp_path / "a" / "run" / JOB_FILE).read_bytes()
    forced = rollpoint("run", str(config), "--fresh", "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert (tmp_path / "a" / "run" / JOB_FILE).read_bytes() == before
