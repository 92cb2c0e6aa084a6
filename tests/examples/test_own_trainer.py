"""examples/own_trainer.py as its user would run it: on `rollpoint serve` servers, SIGKILLed
after a snapshot, rerun to the end.

The example uses only the façade (``rollpoint.Rollouts``); the servers outlive the killed
trainer, as a trainer's own cluster's would. Held to: every row trained exactly once
(I1, from ``train_data.jsonl``), every calendar event created once (I2), the rerun resumed from a snapshot and continued episodes
there, and a continued episode kept the turns it had made before the kill (its pre-cut
model calls are the first attempt's, not regenerated).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from rollpoint.envs import get_environment
from rollpoint.testing import invariants
from tests.support.run_dir import has_checkpoint, newest_holds_depth, published
from tests.support.serve_process import served, workplace_serve_config

EXAMPLE = Path(__file__).parents[2] / "examples" / "own_trainer.py"
TASKS, GROUP_SIZE = 16, 2  # what the example's config says
_RESUMED = re.compile(r"resumed from (\S+) at step (\d+): (\d+) episodes continued; weights (\S+)")


def _start(served_file: Path, workdir: Path, out: Path) -> subprocess.Popen[bytes]:
    with out.open("ab") as sink:
        return subprocess.Popen(
            [sys.executable, str(EXAMPLE), str(served_file), str(workdir)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


_FINAL = re.compile(r"stopped by SIGTERM: snapshot (\S+) holds the run")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_own_trainer_killed_after_a_snapshot_resumes_and_trains_every_row_once(
    tmp_path: Path, signum: int
) -> None:
    # SIGKILL: the rerun resumes from the last snapshot taken. SIGTERM (a scheduler's
    # preemption notice): the example's StopRequest takes one final snapshot, exits 143
    # without a traceback, and the rerun resumes from that snapshot.
    # 200 ms a policy call: the example's 32 episodes outlast several snapshots.
    config, _ = workplace_serve_config(tmp_path, tasks=TASKS, group_size=GROUP_SIZE, latency_ms=200)
    workdir, out = tmp_path / "trainer", tmp_path / "trainer.out"
    with served(config) as deployment:
        served_file = tmp_path / "served.json"
        served_file.write_bytes(orjson.dumps(deployment))
        store = Path(deployment["snapshot_store"])
        first = _start(served_file, workdir, out)
        try:
            deadline = time.monotonic() + 120
            before: set[str] | None = None
            while True:
                assert first.poll() is None, (
                    f"the trainer ended before the kill:\n{out.read_text()}"
                )
                assert time.monotonic() < deadline, f"no kill moment in 120 s:\n{out.read_text()}"
                if before is None and has_checkpoint(workdir):
                    before = published(store)
                if before is not None and newest_holds_depth(store, before, 1):
                    break
                time.sleep(0.01)
            os.killpg(first.pid, signum)
            code = first.wait(timeout=60)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
        killed_at = len(out.read_text())
        final = _FINAL.search(out.read_text())
        if signum == signal.SIGTERM:
            assert code == 143 and final, out.read_text()
            assert "Traceback" not in out.read_text(), out.read_text()
        rerun = _start(served_file, workdir, out)
        assert rerun.wait(timeout=240) == 0, out.read_text()[killed_at:]

    said = out.read_text()[killed_at:]
    assert "Traceback" not in said, said
    match = _RESUMED.search(said)
    assert match and int(match.group(3)) > 0, said
    if final is not None:
        assert match.group(1) == final.group(1), "the rerun did not resume at the final snapshot"
    tasks = get_environment("workplace").make_tasks(TASKS, 0)
    rollouts, unreadable = invariants.read_train_data(workdir)
    found = [
        *unreadable,
        *invariants.check_exactly_once(rollouts, invariants.expected_rows(tasks, GROUP_SIZE)),
        # Each event an episode created is in the calendar once, as the environment's own
        # search (in the transcript) lists it: the killed trainer's attempts, still running
        # on the servers at the kill, were stopped before the saved ones went back in.
        *invariants.check_side_effects_once(
            rollouts, invariants.created_titles(tasks), full_reward="all"
        ),
    ]
    assert found == [], invariants.report(found)
    kept = [
        r
        for r in rollouts
        if r.attempt >= 1
        and r.model_calls is not None
        and any(c.attempt < r.attempt for c in r.model_calls)
    ]
    assert kept, "no continued rollout kept a turn from before the kill"
    # The weights the rerun loaded are the ones saved at the step it resumed at, as the
    # state the example handed over with that step names them.
    assert Path(match.group(4)) == workdir / "weights" / f"step-{match.group(2)}.json"
    assert Path(match.group(4)).exists()
