"""Weight updates across a real crash: a trainer on the façade (its servers its children)
pushes new weights in ``keep`` mode before every step's ``done``, against a scripted engine
that outlives it as a real engine would; it is SIGKILLed after a snapshot taken past two
updates, and rerun to the end. Every trained turn's version — and the segments of a call
that spanned an update, or was cut at the kill and continued — is the engine's own account
of which weights sampled its tokens, and every row is trained once."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from tests.chaos.test_crash_recovery import published
from tests.support.live_server import serve_app
from tests.support.run_process import RunProcess

pytestmark = pytest.mark.chaos

TRAINER = Path(__file__).parents[1] / "support" / "weights_trainer.py"
TASKS, GROUP_SIZE = 6, 2
_RESUMED = re.compile(r"resumed at step (\d+); (\d+) continued; live (\d+)")


def write_config(tmp_path: Path, engine_url: str) -> Path:
    config = {
        "workdir": str(tmp_path / "run"),
        "environment": "workplace",
        "tasks": TASKS,
        "group_size": GROUP_SIZE,
        "max_turns": 4,
        "replicas": 1,
        "concurrency": 4,
        "policy": {
            "base_url": engine_url + "/v1",
            "capture_tokens": "required",
            "sampling": {"logprobs": True},
        },
        "train": {"batch_size": 4},
        "snapshot": {"every_seconds": 0.3, "keep": 1000},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def runs_of(turn: dict[str, Any]) -> list[list[int]]:
    """The turn's stamped versions, as runs of tokens."""
    if not turn["segments"]:
        return [[turn["policy_version"], len(turn["completion_token_ids"])]]
    runs: list[list[int]] = []
    for s in turn["segments"]:
        if runs and runs[-1][0] == s["policy_version"]:
            runs[-1][1] += s["tokens"]
        else:
            runs.append([s["policy_version"], s["tokens"]])
    return runs


def first(spans: list[list[int]], count: int) -> list[list[int]]:
    out, left = [], count
    for version, n in spans:
        if left and min(n, left):
            out.append([version, min(n, left)])
        left -= min(n, left)
    return out


def engine_accounts(
    turn: dict[str, Any], spans: dict[str, Any], planned: dict[str, Any]
) -> list[list[list[int]]]:
    """Every account the engine's logs give of the turn's tokens: one, or for a call
    continued from a saved prefix one per generation that could have sampled the prefix
    (a call made again after the kill plans the same tokens as the one it replaces)."""
    own = spans[turn["completion_id"]]
    assert not own["aborted"]
    prefix = planned[turn["completion_id"]].get("prefix_token_ids")
    if not prefix:
        return [own["spans"]]
    assert [*prefix, *planned[turn["completion_id"]]["choices"][0]["token_ids"]] == turn[
        "completion_token_ids"
    ]
    accounts = []
    for gid, line in planned.items():
        if gid == turn["completion_id"] or gid not in spans:
            continue
        if line["choices"][0]["token_ids"][: len(prefix)] != prefix:
            continue
        runs = first(spans[gid]["spans"], len(prefix))
        if sum(n for _, n in runs) != len(prefix):
            continue  # it never sampled the whole prefix
        for version, n in own["spans"]:
            if runs and runs[-1][0] == version:
                runs[-1][1] += n
            else:
                runs.append([version, n])
        accounts.append(runs)
    return accounts


def test_every_turns_version_is_the_engines_across_a_kill_between_weight_updates(
    tmp_path: Path,
) -> None:
    weights, calls = tmp_path / "weights.jsonl", tmp_path / "calls.jsonl"
    policy = PolicySettings(
        seed=3,
        error_rate=0.0,
        weights_log=str(weights),
        call_log=str(calls),
        reasoning_tokens=40,
        token_latency_ms=4.0,
    )
    with serve_app(create_policy_app(policy)) as url:
        config = write_config(tmp_path, url)
        workdir = tmp_path / "run"
        first_run = RunProcess(config, url, launcher=(str(TRAINER),))
        try:
            first_run.wait_until(lambda: "live 2" in first_run.stderr, "two weight updates")
            before = published(workdir)
            first_run.wait_until(lambda: bool(published(workdir) - before), "a snapshot after")
        except BaseException:
            first_run.kill()
            raise
        survivors = first_run.kill()
        assert survivors == [], survivors
        rerun = RunProcess(config, url, launcher=(str(TRAINER),)).finish(timeout_s=180)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = _RESUMED.search(rerun.stderr)
    assert resumed, rerun.stderr[-3000:]
    assert int(resumed.group(1)) >= 1 and int(resumed.group(2)) > 0

    spans = {x["id"]: x for x in map(orjson.loads, weights.read_bytes().splitlines())}
    planned = {x["id"]: x for x in map(orjson.loads, calls.read_bytes().splitlines())}
    lines = [orjson.loads(raw) for raw in (workdir / "train_data.jsonl").read_bytes().splitlines()]
    assert sorted((x["group_id"], x["row"]) for x in lines) == sorted(
        {(x["group_id"], x["row"]) for x in lines}
    )
    assert len(lines) == TASKS * GROUP_SIZE  # every row trained once
    versions: set[int] = set()
    spanned = 0
    for line in lines:
        for turn in line["turns"]:
            stamped = runs_of(turn)
            assert stamped in engine_accounts(turn, spans, planned), (line["rollout_id"], turn)
            versions.update(v for v, _ in stamped)
            spanned += len(stamped) > 1
    assert len(versions) >= 3 and spanned >= 1
    # The continued episodes' turns from before the kill keep the versions that sampled them.
    assert any(t["attempt"] < x["attempt"] for x in lines for t in x["turns"])
