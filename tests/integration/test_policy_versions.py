"""Policy versions from the trainer, end to end: a run on the façade (real server processes,
the scripted engine outside them, so it outlives the run like a real engine) pushes new
weights twice while episodes run — once in ``keep`` mode while a generation is mid-way,
once in ``wait`` mode — is stopped after a snapshot and resumed; every trained turn's
version (and the segments of a call that spanned an update) is the engine's own account of
which weights sampled its tokens (``weights_log``), before and after the restore.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollpoint import Rollouts, RunConfig, TrainSample, parse_config
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration


@contextmanager
def engine(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    weights, calls = tmp_path / "weights.jsonl", tmp_path / "calls.jsonl"
    policy = PolicySettings(
        seed=3,
        error_rate=0.0,
        weights_log=str(weights),
        call_log=str(calls),
        reasoning_tokens=40,
        token_latency_ms=3.0,
    )
    with serve_app(create_policy_app(policy)) as url:
        yield url, weights, calls


def job(tmp_path: Path, engine_url: str) -> RunConfig:
    config = parse_config(
        {
            "workdir": str(tmp_path / "run"),
            "environment": "workplace",
            "tasks": 6,
            "group_size": 2,
            "max_turns": 4,
            "replicas": 1,
            "concurrency": 4,
            "policy": {
                "base_url": engine_url + "/v1",
                "capture_tokens": "required",
                "sampling": {"logprobs": True},
            },
            "train": {"batch_size": 4},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config


async def push(http: httpx.AsyncClient, version: int) -> None:
    """The weight push, as the scripted engine takes it."""
    reply = await http.post("/update_weight_version", json={"new_version": str(version)})
    assert reply.status_code == 200, reply.text


async def mid_generation(http: httpx.AsyncClient) -> None:
    """Return once a generation in flight has sampled some tokens (and not all)."""
    for _ in range(5000):
        state = (await http.get("/weights_state")).json()
        if any(g["sampled"] >= 3 for g in state["generations"]):
            return
        await asyncio.sleep(0.002)
    raise AssertionError("no generation was ever mid-way")


def logs(weights: Path, calls: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    spans = {line["id"]: line for line in map(orjson.loads, weights.read_bytes().splitlines())}
    planned = {line["id"]: line for line in map(orjson.loads, calls.read_bytes().splitlines())}
    return spans, planned


def _prefix_runs(generation: dict[str, Any], length: int) -> list[list[int]]:
    """The (version, tokens) runs of a generation's first ``length`` tokens."""
    runs: list[list[int]] = []
    left = length
    for version, n in generation["spans"]:
        take = min(n, left)
        if take:
            runs.append([version, take])
        left -= take
    return runs


def engine_spans(turn: Any, spans: dict[str, Any], planned: dict[str, Any]) -> list[list[int]]:
    """Which weights sampled each run of the turn's tokens, from the engine's logs alone.
    A call continued after the restore: the prefix's runs from the generation that sampled
    it (the one whose planned ids start with it), then the continuation's own."""
    ids = turn.completion_token_ids
    own = spans[turn.completion_id]
    assert not own["aborted"]
    prefix_ids = planned[turn.completion_id].get("prefix_token_ids")
    if not prefix_ids:
        return own["spans"]
    sampled = {
        i: spans[i]
        for i, line in planned.items()
        if i != turn.completion_id
        and line["choices"][0]["token_ids"][: len(prefix_ids)] == prefix_ids
        and i in spans
    }
    assert sampled, f"no generation of the engine sampled {turn.completion_id}'s prefix"
    if len(sampled) > 1:
        # Two rows of a group may plan the same tokens: the prefix is the generation the
        # cut stopped before its end, not a sibling that sampled all it planned.
        stopped = {
            i: line
            for i, line in sampled.items()
            if sum(n for _, n in line["spans"]) < len(planned[i]["choices"][0]["token_ids"])
        }
        sampled = stopped or sampled
    # Where the logs cannot tell the generations apart, they must agree on the prefix.
    (runs,) = {
        str(r): r for r in (_prefix_runs(c, len(prefix_ids)) for c in sampled.values())
    }.values()
    left = len(prefix_ids) - sum(n for _, n in runs)
    assert (
        left == 0 and [*prefix_ids, *planned[turn.completion_id]["choices"][0]["token_ids"]] == ids
    )
    for version, n in own["spans"]:
        if runs and runs[-1][0] == version:
            runs[-1][1] += n
        else:
            runs.append([version, n])
    return runs


def stamped(turn: Any) -> list[list[int]]:
    if turn.segments:
        runs: list[list[int]] = []
        for s in turn.segments:
            if runs and runs[-1][0] == s["policy_version"]:
                runs[-1][1] += s["tokens"]
            else:
                runs.append([s["policy_version"], s["tokens"]])
        return runs
    return [[turn.policy_version, len(turn.completion_token_ids)]]


async def test_every_turns_version_is_the_engines_own_across_two_updates_and_a_restore(
    tmp_path: Path,
) -> None:
    trained: list[TrainSample] = []
    with engine(tmp_path) as (url, weights, calls):
        config = job(tmp_path, url)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with Rollouts(config) as run:
                async for batch in run.batches():
                    if batch.step == 1:
                        trained += batch.samples
                        await mid_generation(http)
                        async with run.weight_update(1, mode="keep"):
                            await push(http, 1)
                        batch.done()
                    else:
                        async with run.weight_update(2, mode="wait"):
                            # A snapshot asked for in the middle of the update is taken
                            # after it, never across it.
                            held = asyncio.ensure_future(run.snapshot())
                            await push(http, 2)
                            await asyncio.sleep(0.2)
                            assert not held.done()
                        report = await held
                        assert report.manifest is not None
                        assert report.manifest.policy_version == 2
                        await run.snapshot()  # episodes in flight, turns of 0, 1 and 2
                        break  # stopped before step 2 is done: the rerun trains it again

            async with Rollouts(config) as run:
                assert run.resumed_step == 1 and run.continued > 0
                # Until the trainer says which version is live, no call reaches the engine
                # (the restored run would stamp the checkpoint's, 1): a second's chance to.
                before = weights.read_bytes()
                await asyncio.sleep(1.0)
                assert (await http.get("/weights_state")).json()["generations"] == []
                assert weights.read_bytes() == before
                await run.weights_live(2)  # the engine still runs the weights of version 2
                async for batch in run.batches():
                    trained += batch.samples
                    batch.done()
                summary = await run.summary()
        spans, planned = logs(weights, calls)

    assert summary.failed_groups == {}
    assert len({(s.group_id, s.row) for s in trained}) == len(trained) == 12  # each row once
    turns = [t for s in trained for t in s.trajectory]
    versions = set()
    spanned = 0
    for turn in turns:
        assert stamped(turn) == engine_spans(turn, spans, planned), turn.completion_id
        versions.update(v for v, _ in stamped(turn))
        spanned += len({v for v, _ in stamped(turn)}) > 1
    assert versions == {0, 1, 2}
    assert spanned >= 1, "no trained call spanned the keep-mode update"
    # The pre-crash turns of continued episodes keep the versions that sampled them.
    resumed = [s for s in trained if any(t.attempt < s.attempt for t in s.trajectory)]
    assert resumed and any(t.policy_version < 2 for s in resumed for t in s.trajectory)
