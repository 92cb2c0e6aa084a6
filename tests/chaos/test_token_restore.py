"""Token data is exact across a restore: a seeded job with token capture (the scripted policy
as the engine, in vLLM's shape, keeping its own call log) is SIGKILLed after a snapshot and
rerun; every pre-cut turn of every continued episode carries the ids and logprobs the engine
logged for that call before the kill, and the policy version the model server stamped on it
(its call ledger in the snapshot the rerun resumed from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.protocol.token_data import as_float32
from rollpoint.testing import invariants
from tests.chaos.test_crash_recovery import (
    _RESUMED_FROM,
    Start,
    continued,
    crash,
    rerun_until_ok,
    start,
    wait_for_resumable_snapshot,
    write_config,
)
from tests.support.records import state_records

pytestmark = pytest.mark.chaos
__all__ = ["start"]  # the fixture, shared with the crash tests


def engine_log(path: Path, upto: int) -> dict[str, Any]:
    """The engine's log lines in the first ``upto`` bytes, by completion id."""
    lines = [orjson.loads(raw) for raw in path.read_bytes()[:upto].splitlines()]
    return {line["id"]: line for line in lines}


def stamped_versions(workdir: Path, snapshot_id: str) -> dict[tuple[str, int], int]:
    """(rollout, turn) → policy version, from the model servers' ledgers in the snapshot."""
    folder = workdir / invariants.SNAPSHOT_STORE_DIR / "snapshots" / snapshot_id
    versions: dict[tuple[str, int], int] = {}
    store_root = folder.parent.parent
    for state in (folder / "participants" / "model").iterdir():
        for record in state_records(state, store_root):
            if record["kind"] != "model_call":
                continue  # a saved prefix (the generation cut)
            call = record["call"]
            versions[(call["rollout_id"], call["turn"])] = call["policy_version"]
    return versions


def test_pre_cut_turns_keep_the_engines_ids_logprobs_and_stamped_version(
    tmp_path: Path, start: Start
) -> None:
    log = tmp_path / "engine.jsonl"
    config = write_config(
        tmp_path,
        seed=7,
        policy={
            "latency_ms": 60,
            "error_rate": 0,
            "capture_tokens": "required",
            "call_log": str(log),
            "sampling": {"logprobs": True, "temperature": 1.0},
        },
        # Every snapshot kept: the one the rerun resumes from is read at the end.
        snapshot={"every_seconds": 0.3, "keep": 1000},
    )
    workdir = tmp_path / "run"
    run = start(config)
    wait_for_resumable_snapshot(run, workdir)
    crash(run)
    before_kill = log.stat().st_size

    reruns = rerun_until_ok(start, config)
    assert continued(reruns[0]) > 0, reruns[0].stderr[-2000:]
    match = _RESUMED_FROM.search(reruns[0].stderr)
    assert match, reruns[0].stderr[-2000:]
    logged = engine_log(log, before_kill)
    stamped = stamped_versions(workdir, match.group(1))

    lines = [orjson.loads(raw) for raw in (workdir / "train_data.jsonl").read_bytes().splitlines()]
    assert lines and all(t["completion_token_ids"] for line in lines for t in line["turns"])
    checked = 0
    for line in lines:
        if line["attempt"] == 0:
            continue
        # Empty for an episode saved before its first policy call.
        pre_cut = [t for t in line["turns"] if t["attempt"] < line["attempt"]]
        context: list[int] = []
        for turn in line["turns"]:
            entry = logged.get(turn["completion_id"]) if turn in pre_cut else None
            if turn in pre_cut:
                assert entry is not None, (
                    f"{line['rollout_id']} turn {turn['turn']} not logged before the kill"
                )
                (choice,) = entry["choices"]
                assert turn["completion_token_ids"] == choice["token_ids"]
                assert turn["completion_logprobs"] == as_float32(choice["logprobs"])
                prompt = (
                    [*context, *turn["prompt_token_ids"]]
                    if turn["prompt_is_suffix"]
                    else turn["prompt_token_ids"]
                )
                assert prompt == entry["prompt_token_ids"]
                assert turn["policy_version"] == stamped[(line["rollout_id"], turn["turn"])]
                checked += 1
            suffix = turn["prompt_token_ids"]
            context = [
                *(context if turn["prompt_is_suffix"] else []),
                *suffix,
                *turn["completion_token_ids"],
            ]
    assert checked > 0
    # The versions differ across the run (train steps move them), so the check has teeth.
    assert len({t["policy_version"] for line in lines for t in line["turns"]}) > 1
