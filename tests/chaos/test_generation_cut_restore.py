"""The generation cut across a real crash: a seeded ``rollpoint run`` with token capture,
whose scripted policy decodes one token a chunk (reasoning before every tool call), is
SIGKILLed mid-generation after a snapshot and rerun. Every call the rerun continued from a
saved prefix has final ids = the prefix saved in the snapshot + what the engine decoded
after it; the engine's own log shows it was given the prefix and decoded only the rest
(and that the result is what the uninterrupted call had planned), and the trained turn
carries both segments with their policy versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.servers.model.generation_cut import CallPrefix
from rollpoint.testing import invariants
from tests.chaos.test_crash_recovery import (
    _RESUMED_FROM,
    Start,
    continued,
    crash,
    published,
    rerun_until_ok,
    start,
    wait_for_resumable_snapshot,
    write_config,
)
from tests.chaos.test_token_restore import engine_log
from tests.support.records import state_records
from tests.support.train_schema import check_train_rows

pytestmark = pytest.mark.chaos
__all__ = ["start"]


def saved_prefixes(workdir: Path, snapshot_id: str) -> dict[tuple[str, int], CallPrefix]:
    """(rollout, turn) → the prefix the snapshot saved for a call in flight at it."""
    folder = workdir / invariants.SNAPSHOT_STORE_DIR / "snapshots" / snapshot_id
    found: dict[tuple[str, int], CallPrefix] = {}
    store_root = folder.parent.parent
    for state in (folder / "participants" / "model").iterdir():
        for record in state_records(state, store_root):
            if record["kind"] == "model_prefix":
                prefix = CallPrefix.model_validate(record["prefix"])
                found[(prefix.rollout_id, prefix.turn)] = prefix
    return found


def latest(workdir: Path) -> str:
    return max(published(workdir), key=lambda name: name.rsplit("-", 2)[1])


def test_continued_calls_are_prefix_plus_continuation_and_the_prefix_is_not_decoded_again(
    tmp_path: Path, start: Start
) -> None:
    log = tmp_path / "engine.jsonl"
    config = write_config(
        tmp_path,
        seed=7,
        policy={
            "latency_ms": 20,
            "error_rate": 0,
            "capture_tokens": "required",
            "call_log": str(log),
            "sampling": {"logprobs": True},
            "token_latency_ms": 4,
            "reasoning_tokens": 120,
        },
        snapshot={"every_seconds": 0.5, "keep": 1000},
    )
    workdir = tmp_path / "run"
    run = start(config)
    wait_for_resumable_snapshot(run, workdir)
    # Killed right after a snapshot that cut calls mid-generation (one taken while no call
    # was decoding has nothing to continue).
    run.wait_until(lambda: bool(saved_prefixes(workdir, latest(workdir))), "a cut snapshot")
    crash(run)
    before_kill = log.stat().st_size

    reruns = rerun_until_ok(start, config)
    assert continued(reruns[0]) > 0, reruns[0].stderr[-2000:]
    match = _RESUMED_FROM.search(reruns[0].stderr)
    assert match, reruns[0].stderr[-2000:]
    prefixes = saved_prefixes(workdir, match.group(1))
    assert prefixes, f"snapshot {match.group(1)} (the rerun resumed from) saved no prefix"
    planned = [c["token_ids"] for e in engine_log(log, before_kill).values() for c in e["choices"]]
    logged = engine_log(log, log.stat().st_size)

    lines = [orjson.loads(raw) for raw in (workdir / "train_data.jsonl").read_bytes().splitlines()]
    check_train_rows(lines)  # the shipped schema: continued episodes, calls cut and continued
    checked = 0
    for line in lines:
        for turn in line["turns"]:
            if not turn["segments"]:
                continue
            prefix = prefixes[(line["rollout_id"], turn["turn"])]
            entry: dict[str, Any] = logged[turn["completion_id"]]
            (choice,) = entry["choices"]
            ids = turn["completion_token_ids"]
            # The engine was given the saved prefix and decoded only what follows it.
            assert entry["prefix_token_ids"] == prefix.ids()
            assert entry["request"]["continue_final_message"] is True
            assert len(choice["token_ids"]) == len(ids) - prefix.count
            assert ids == [*prefix.ids(), *choice["token_ids"]]
            # ... and the stitched call is what the cut call would have been.
            assert ids in planned
            # Both segments, each with the version it was sampled under.
            first, second = turn["segments"]
            assert first == {"policy_version": prefix.policy_version, "tokens": prefix.count}
            assert second == {
                "policy_version": turn["policy_version"],
                "tokens": len(ids) - prefix.count,
            }
            assert turn["attempt"] == line["attempt"] > prefix.attempt
            checked += 1
    assert checked > 0, "no trained call was continued from a saved prefix"
