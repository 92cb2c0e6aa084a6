"""``rollpoint run`` on datasets as RL teams keep them: a verl-shaped Parquet file and a
directory saved by ``datasets.Dataset.save_to_disk``, each trained once per row, and a
dataset edited in place refused when the run resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollpoint.envs.math import MathEnvironment
from tests.integration.test_cli_run import rollpoint, train_lines, write_config
from tests.support.processes import descendants_of, kill_all

pytestmark = pytest.mark.integration

TASKS = 6
GROUP = 2
COLUMNS = {
    "task_id": "extra_info.index",
    "prompt": "prompt",
    "params": {
        "a": "extra_info.a",
        "b": "extra_info.b",
        "op": "extra_info.op",
        "answer": "reward_model.ground_truth",
    },
}


def verl_rows(seed: int = 7, tasks: int = TASKS) -> list[dict[str, Any]]:
    """Math tasks in verl's Parquet shape: chat-message prompt, reward_model, extra_info."""
    rows = []
    for i, task in enumerate(MathEnvironment().make_tasks(tasks, seed)):
        p = task.params
        rows.append(
            {
                "data_source": "rollpoint/math",
                "prompt": [{"role": "user", "content": task.prompt}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": p["answer"]},
                "extra_info": {"index": 1000 + i, "a": p["a"], "b": p["b"], "op": p["op"]},
            }
        )
    return rows


def job(tmp_path: Path, dataset: dict[str, Any], **overrides: Any) -> Path:
    settings: dict[str, Any] = {
        "environment": "math",
        "tasks": None,
        "dataset": dataset,
        "group_size": GROUP,
        "max_turns": 1,
        "replicas": 1,
        "snapshot": {"allow_restart_only": True},
    }
    return write_config(tmp_path, **(settings | overrides))


def assert_every_row_trained_once(workdir: Path, tasks: int = TASKS) -> None:
    lines = train_lines(workdir)
    assert len(lines) == tasks * GROUP
    assert set(Counter((line["group_id"], line["row"]) for line in lines).values()) == {1}
    assert {line["task_id"] for line in lines} == {str(1000 + i) for i in range(tasks)}
    # The scripted policy answers arithmetic right: the mapped ground truth was verified.
    assert sum(float(line["reward"]) for line in lines) / len(lines) > 0.5  # type: ignore[arg-type]


def test_a_verl_parquet_file_trains_every_row_once_and_an_edit_in_place_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    config = job(tmp_path, {"path": str(path), "columns": COLUMNS})
    first = rollpoint("run", str(config))
    assert first.returncode == 0, first.stderr
    assert_every_row_trained_once(tmp_path / "run")

    # A rerun is let through the content check (the finished run then says so).
    again = rollpoint("run", str(config))
    assert again.returncode == 0, again.stderr
    assert "has finished already" in again.stderr

    # Same path, same task ids, other arithmetic: the snapshot's rows are not these.
    pq.write_table(pa.Table.from_pylist(verl_rows(seed=8)), path)
    edited = rollpoint("run", str(config))
    assert edited.returncode == 2, edited.stderr
    assert "Traceback" not in edited.stderr
    (line,) = [ln for ln in edited.stderr.splitlines() if "dataset_content_sha256" in ln]
    assert "--fresh --force" in line
    assert len(train_lines(tmp_path / "run")) == TASKS * GROUP


def test_a_saved_datasets_directory_trains_every_row_once(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list(verl_rows()).save_to_disk(str(tmp_path / "saved"))
    config = job(tmp_path, {"path": str(tmp_path / "saved"), "columns": COLUMNS})
    result = rollpoint("run", str(config))
    assert result.returncode == 0, result.stderr
    assert_every_row_trained_once(tmp_path / "run")
    # Loading it wrote nothing into the directory: the resume sees the same content.
    # A rerun is let through the content check (the finished run then says so).
    again = rollpoint("run", str(config))
    assert again.returncode == 0, again.stderr
    assert "has finished already" in again.stderr


def test_a_dataset_edited_in_place_after_a_sigkill_is_refused_and_put_back_resumes(
    tmp_path: Path,
) -> None:
    tasks = 40
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(tasks=tasks)), path)
    original = path.read_bytes()
    config = job(
        tmp_path,
        {"path": str(path), "columns": COLUMNS},
        concurrency=2,
        policy={"latency_ms": 100, "error_rate": 0},
        train={"batch_size": 2, "checkpoint_every_steps": 1},
        snapshot={"allow_restart_only": True, "every_seconds": 0.5},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollpoint", "run", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    servers: list[int] = []
    try:
        latest = tmp_path / "run" / "snapshots" / "latest"
        deadline = time.monotonic() + 60
        while not latest.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no snapshot published within 60 s"
            time.sleep(0.05)
        servers = descendants_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
        if proc.stderr:
            proc.stderr.close()
        kill_all(servers)
    trained = tmp_path / "run" / "train_data.jsonl"
    assert not trained.exists() or len(train_lines(tmp_path / "run")) < tasks * GROUP

    # The same task ids and row count, other arithmetic, written over the file.
    pq.write_table(pa.Table.from_pylist(verl_rows(seed=8, tasks=tasks)), path)
    edited = rollpoint("run", str(config))
    assert edited.returncode == 2, edited.stderr
    assert "Traceback" not in edited.stderr
    assert any("dataset_content_sha256" in ln for ln in edited.stderr.splitlines())

    path.write_bytes(original)
    resumed = rollpoint("run", str(config))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from snapshot" in resumed.stderr
    assert_every_row_trained_once(tmp_path / "run", tasks)
