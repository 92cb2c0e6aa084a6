"""``ctx.effect`` (issue 36 item 3) against a real effects folder: the intent is durable
before ``fn`` runs, the result after; a recorded result answers without ``fn``; a replay
never calls ``fn``; names are checked."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.envs.effects import CallEffects, EffectCounts, MemoryEffects
from rollpoint.envs.registry import get_environment
from rollpoint.protocol.errors import ConfigError, EffectInDoubtError
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.resources.effect_records import EffectRecords
from tests.support.ledger_env import LEDGER_ENV, LedgerEnvironment, LedgerState, ledger_lines


def effects(
    store: Any, *, attempt: int = 0, replaying: bool = False, loop: Any = None
) -> CallEffects:
    return CallEffects(
        LedgerEnvironment(),
        LedgerState(),
        store,
        rollout_id="r1",
        attempt=attempt,
        task_id="ledger-0000",
        tool="post",
        turn=1,
        call_index=0,
        loop=loop,
        counts=EffectCounts(),
        replaying=lambda: replaying,
    )


async def test_the_intent_is_durable_before_fn_runs_and_the_result_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = EffectRecords(tmp_path / "effects")
    record = tmp_path / "effects" / "r1" / "t1-c0-ledger_post.json"
    seen: dict[str, Any] = {}

    async def fn(key: str) -> int:
        seen["key"] = key
        seen["on disk"] = orjson.loads(record.read_bytes())["state"]
        # The file, its folder, and the parents of the two folders the first effect made.
        seen["fsyncs"] = len(synced)
        return 7

    assert await effects(store).arun("ledger_post", fn) == 7
    assert seen == {"key": "r1/1/0/ledger_post", "on disk": "intent", "fsyncs": 4}
    assert orjson.loads(record.read_bytes())["state"] == "result" and len(synced) == 6

    # Another server on the same store (a new process, or another replica): the result
    # answers every later attempt, fn is not called.
    async def never(key: str) -> int:
        raise AssertionError("the effect was made again")

    again = EffectRecords(tmp_path / "effects")
    assert await effects(again, attempt=3).arun("ledger_post", never) == 7
    assert again.in_doubt() == []


async def test_a_replay_never_makes_an_effect_it_has_no_result_for(tmp_path: Path) -> None:
    called: list[str] = []

    async def fn(key: str) -> int:
        called.append(key)
        return 1

    store = EffectRecords(tmp_path / "effects")
    with pytest.raises(EffectInDoubtError, match="found no recorded result of effect"):
        await effects(store, replaying=True).arun("ledger_post", fn)
    assert called == []


async def test_a_synchronous_effect_from_a_worker_thread_goes_through_the_loop(
    tmp_path: Path,
) -> None:
    store = EffectRecords(tmp_path / "effects")
    loop = asyncio.get_running_loop()
    made = await asyncio.to_thread(effects(store, loop=loop).run, "ledger_post", lambda k: k)
    assert made == "r1/1/0/ledger_post"
    again = await asyncio.to_thread(effects(store, loop=loop).run, "ledger_post", lambda k: "x")
    assert again == made
    with pytest.raises(RuntimeError, match="on the event loop"):
        effects(store, loop=loop).run("ledger_post", lambda k: k)


def test_environment_call_records_effects_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    env = LedgerEnvironment()
    state = env.start(env.make_tasks(1, seed=0)[0])
    assert env.call(state, "post", {"amount": 3}).startswith("posted 3")
    assert [line["key"] for line in ledger_lines()] == ["local/0/0/ledger_post"]


@pytest.mark.parametrize(
    ("name", "said"),
    [("no spaces", "must be 1-64"), ("a|b", "must be 1-64"), ("refund", "not declared")],
)
def test_effect_names_are_checked(name: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        effects(MemoryEffects()).run(name, lambda k: 1)


def test_one_name_is_one_effect_per_call() -> None:
    call = effects(MemoryEffects())
    call.run("ledger_post", lambda k: 1)
    with pytest.raises(ValueError, match="made twice in one call"):
        call.run("ledger_post", lambda k: 2)


class NoVersion(LedgerEnvironment):
    checkpoint_mode = CheckpointMode.EXTERNAL


class BadEffectName(LedgerEnvironment):
    effects = frozenset({"ledger post"})


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        ("NoVersion", "checkpoint_mode external needs a version(state) method"),
        ("BadEffectName", "effect name 'ledger post' must be 1-64"),
    ],
)
def test_a_class_that_declares_wrongly_is_refused_when_the_config_is_loaded(
    cls: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)) as refused:
        get_environment(f"{__name__}:{cls}")
    assert "environment 'ledger'" in refused.value.message
