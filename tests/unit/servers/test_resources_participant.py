"""The resources participant on its own (no sockets): freeze, export/install, modes, forget."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import JsonValue

from rollpoint.envs.registry import get_environment
from rollpoint.participant.participant import Participant
from rollpoint.protocol.control import RetireOutcomeKind
from rollpoint.protocol.episode import EpisodeStart, ToolCall
from rollpoint.protocol.errors import IdempotencyConflictError, InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import ParticipantManifest
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.resources import live_episode
from rollpoint.servers.resources.episode_record import EpisodeRecord, call_fingerprint, pack_state
from rollpoint.servers.resources.episode_service import ResourcesService
from rollpoint.servers.resources.resources_participant import ResourcesParticipant
from rollpoint.store.participant_state import read_participant_state, write_participant_state
from rollpoint.tuning.deferred_value import DeferredValue

EVENT = {"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}


def _ep(rollout_id: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


def _write(
    root: Path, records: list[dict[str, JsonValue]], checkpoint_id: str = "c1"
) -> ParticipantManifest:
    """The records as a checkpoint's writer stores them."""
    return write_participant_state(
        str(root / checkpoint_id),
        kind="resources",
        instance="resources-replica-0",
        checkpoint_id=checkpoint_id,
        records=records,
    )


def _stored(
    root: Path, records: list[dict[str, JsonValue]], checkpoint_id: str = "c1"
) -> list[dict[str, JsonValue]]:
    """The records written by the checkpoint's writer, then read back as a restore reads them."""
    _write(root, records, checkpoint_id)
    _, read = read_participant_state(
        str(root / checkpoint_id),
        kind="resources",
        instance="resources-replica-0",
        checkpoint_id=checkpoint_id,
    )
    return read


def _made(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record of a checkpoint export with its deferred packed state made."""
    packed = record["packed_state"]
    return {
        **record,
        "packed_state": packed.value() if isinstance(packed, DeferredValue) else packed,
    }


class _CountedPack:
    """Stands in for ``pack_state`` to count the states packed."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, state: Mapping[str, Any]) -> str:
        self.calls += 1
        return pack_state(state)


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> _CountedPack:
    counted = _CountedPack()
    monkeypatch.setattr(live_episode, "pack_state", counted)
    return counted


async def _service(
    environment: str, *rollout_ids: str, reproducible: bool = False
) -> ResourcesService:
    """``reproducible=False``: every state is copied and packed, even of an episode no tool
    call touched (what the packing tests look at); True: the environment's own setting."""
    env = get_environment(environment)
    if not reproducible:
        env.reproducible_start = False  # type: ignore[misc]
    service = ResourcesService(env)
    (task,) = env.make_tasks(1, seed=3)
    for rollout_id in rollout_ids:
        await service.start(EpisodeStart(episode=_ep(rollout_id), task=task))
    return service


async def test_modes_follow_the_environment() -> None:
    workplace = ResourcesParticipant(await _service("workplace"))
    math = ResourcesParticipant(await _service("math"))
    assert isinstance(workplace, Participant)
    assert (workplace.mode, math.mode) == (CheckpointMode.TURN, CheckpointMode.RESTART_ONLY)


async def test_a_frozen_service_holds_tool_calls_and_stays_ready() -> None:
    service = await _service("workplace", "r1")
    participant = ResourcesParticipant(service)
    await participant.close_admission()
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    held = asyncio.create_task(service.call_tool("calendar_create_event", call))
    await participant.wait_changed(1.0)  # woken by the call reaching the gate
    assert participant.stats()["waiting"] == 1 and participant.readiness().ready
    assert not held.done()
    await participant.open_admission()
    assert (await asyncio.wait_for(held, 1)).is_error is False


async def test_export_names_scoped_episodes_and_install_takes_only_the_scope(
    tmp_path: Path,
) -> None:
    source = ResourcesParticipant(await _service("workplace", "r1", "r2"))
    records = await source.export([_ep("r1", 1), _ep("r2"), _ep("unknown")])
    assert [(r["kind"], r["episode"]) for r in records] == [
        ("episode_state", {"rollout_id": "r1", "attempt": 1}),
        ("episode_state", {"rollout_id": "r2", "attempt": 0}),
    ]
    target_service = await _service("workplace")
    target = ResourcesParticipant(target_service)
    assert await target.install(_stored(tmp_path, records), [_ep("r2")]) == [_ep("r2", 1)]
    assert target_service.rollout_ids() == ["r2"]


async def test_a_bad_record_installs_nothing() -> None:
    source = ResourcesParticipant(await _service("workplace", "r1", "r2"))
    records = await source.export([_ep("r1"), _ep("r2")])
    other: JsonValue = {"rollout_id": "r1", "attempt": 0}
    broken = [records[0], {**records[1], "episode": other}]
    target_service = await _service("workplace")
    with pytest.raises(InvalidCheckpointStateError):
        await ResourcesParticipant(target_service).install(broken, [_ep("r1"), _ep("r2")])
    assert target_service.rollout_ids() == []


async def test_a_restart_only_environment_exports_nothing_and_never_blocks() -> None:
    participant = ResourcesParticipant(await _service("math", "m1"))
    assert await participant.export([_ep("m1")]) == []
    assert participant.readiness().ready and participant.readiness().restarts == []


async def test_retire_is_unknown_and_forget_releases_state() -> None:
    service = await _service("workplace", "r1")
    participant = ResourcesParticipant(service)
    (outcome,) = participant.retire({"r1": 2})
    assert (outcome.episode, outcome.outcome) == (_ep("r1", 2), RetireOutcomeKind.UNKNOWN)
    assert participant.forget(["r1", "nope"]) == ["r1"]
    assert service.episode_count == 0 and participant.ack([_ep("r1")]) == []


async def test_a_checkpoint_packs_the_state_and_old_unpacked_records_still_install(
    tmp_path: Path,
) -> None:
    service = await _service("workplace", "r1")
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)
    (packed,) = _stored(tmp_path, await ResourcesParticipant(service).export([_ep("r1")]))
    parsed = EpisodeRecord.model_validate(packed)
    # Built without pydantic, it is exactly the validated record's dump.
    assert packed == parsed.model_dump(mode="json")
    assert packed["state"] is None and isinstance(packed["packed_state"], str)
    exported = service.environment.export_state(service._episodes["r1"].state)
    assert parsed.exported_state() == exported
    assert len(packed["packed_state"]) * 10 < len(orjson.dumps(exported))
    # A record written before packing carries the export as is, and still installs.
    old = {**packed, "state": exported}
    del old["packed_state"]
    for record in (packed, old):
        target_service = await _service("workplace")
        assert await ResourcesParticipant(target_service).install([record], [_ep("r1")]) == [
            _ep("r1", 1)
        ]
        replay = await target_service.call_tool("calendar_create_event", call)
        assert replay.replayed  # the idempotency table came back with the state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"packed_state": "not base64!"}, "packed_state does not decode"),
        ({"packed_state": "aGVsbG8="}, "packed_state does not decode"),
        ({"state": {"sqlite": "AAAA"}}, "exactly one of 'state', 'packed_state' and 'fresh_start'"),
        ({"packed_state": None}, "exactly one of 'state', 'packed_state' and 'fresh_start'"),
    ],
)
async def test_a_bad_packed_state_is_refused_with_a_clear_error(
    change: dict[str, JsonValue], message: str
) -> None:
    (record,) = await ResourcesParticipant(await _service("workplace", "r1")).export([_ep("r1")])
    target_service = await _service("workplace")
    with pytest.raises(InvalidCheckpointStateError, match=message):
        await ResourcesParticipant(target_service).install([{**record, **change}], [_ep("r1")])
    assert target_service.rollout_ids() == []


async def test_a_checkpoint_packs_again_only_an_episode_a_tool_call_changed(
    packs: _CountedPack,
) -> None:
    service = await _service("workplace", "r1", "r2")
    participant = ResourcesParticipant(service)
    before = {
        r["rollout_id"]: _made(r)["packed_state"]
        for r in await participant.export([_ep("r1"), _ep("r2")])
    }
    assert packs.calls == 2
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)
    after = {
        r["rollout_id"]: _made(r)["packed_state"]
        for r in await participant.export([_ep("r1"), _ep("r2")])
    }
    assert packs.calls == 3  # unchanged r2: the packed form is reused
    assert after["r2"] is before["r2"]
    assert after["r1"] != before["r1"]
    unpacked = EpisodeRecord.model_validate(
        _made((await participant.export([_ep("r1")]))[0])
    ).exported_state()
    assert unpacked == service.environment.export_state(service._episodes["r1"].state)


async def test_an_export_reuses_the_state_of_unchanged_episodes_and_never_changes_a_record(
    tmp_path: Path, packs: _CountedPack
) -> None:
    service = await _service("workplace", "r1", "r2")
    participant = ResourcesParticipant(service)
    first = await participant.export([_ep("r1"), _ep("r2")])
    at_cut = service.environment.export_state(service._episodes["r1"].state)
    # A copy of everything but the deferred values themselves (compared by identity).
    kept = copy.deepcopy(first, {id(r["packed_state"]): r["packed_state"] for r in first})
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)  # r1 goes on after the cut
    second = await participant.export([_ep("r1"), _ep("r2")])
    assert first == kept  # what the first export handed out did not change
    # Its writer runs after r1 changed, and still writes the state of the cut.
    written = _stored(tmp_path, first)
    assert EpisodeRecord.model_validate(written[0]).exported_state() == at_cut
    assert second[0] is not first[0]
    assert _made(second[0])["packed_state"] != _made(first[0])["packed_state"]
    parsed = EpisodeRecord.model_validate(_made(second[0]))
    assert parsed.exported_state() == service.environment.export_state(
        service._episodes["r1"].state
    )
    assert [(t.turn, t.call_index) for t in parsed.tool_results] == [(0, 0)]
    # r2 did not change: its packed state and results are handed out again, not remade
    assert second[1] == first[1]
    assert second[1]["packed_state"] is first[1]["packed_state"]
    assert second[1]["tool_results"] is first[1]["tool_results"]
    # Saved for another attempt, the same state makes a new record naming it.
    packed = packs.calls
    (third,) = await participant.export([_ep("r2", 1)])
    assert third is not second[1] and third["episode"] == {"rollout_id": "r2", "attempt": 1}
    assert _made(third)["packed_state"] == _made(second[1])["packed_state"]
    assert packs.calls == packed  # not packed again


# ---- packing deferred to the snapshot's writer ---------------------------------------------
async def test_a_checkpoint_export_leaves_packing_to_the_writer(
    tmp_path: Path, packs: _CountedPack
) -> None:
    service = await _service("workplace", "r1")
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)
    exported = service.environment.export_state(service._episodes["r1"].state)

    (record,) = await ResourcesParticipant(service).export([_ep("r1")])

    assert packs.calls == 0  # the pause only took the environment's export
    assert isinstance(record["packed_state"], DeferredValue)
    (stored,) = _stored(tmp_path, [record])
    assert packs.calls == 1
    # Written as an eager pack of the same export would be.
    assert stored["packed_state"] == pack_state(exported)
    target = await _service("workplace")
    assert await ResourcesParticipant(target).install([stored], [_ep("r1")]) == [_ep("r1", 1)]
    assert target.environment.export_state(target._episodes["r1"].state) == exported


async def test_an_unchanged_episode_is_packed_once_across_two_checkpoints(
    tmp_path: Path, packs: _CountedPack
) -> None:
    service = await _service("workplace", "r1")
    participant = ResourcesParticipant(service)

    first = _stored(tmp_path, await participant.export([_ep("r1")]), "c1")
    second = _stored(tmp_path, await participant.export([_ep("r1")]), "c2")

    assert packs.calls == 1
    assert second == first


async def test_the_plain_export_gives_packed_strings_that_a_checkpoint_reuses(
    packs: _CountedPack,
) -> None:
    service = await _service("workplace", "r1")

    (plain,) = service.export_episodes([_ep("r1")])
    (checkpoint,) = await ResourcesParticipant(service).export([_ep("r1")])

    assert isinstance(plain["packed_state"], str)
    assert _made(checkpoint)["packed_state"] == plain["packed_state"]
    assert packs.calls == 1


async def test_a_failing_pack_is_named_by_the_writer_and_by_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(state: Mapping[str, Any]) -> str:
        raise ValueError("state is not JSON")

    monkeypatch.setattr(live_episode, "pack_state", broken)
    service = await _service("workplace", "r1", "r2")
    records = await ResourcesParticipant(service).export([_ep("r1"), _ep("r2")])

    with pytest.raises(InvalidCheckpointStateError) as written:
        _write(tmp_path, records)
    assert written.value.message == (
        "record 0 cannot be encoded: packed state of rollout r1 could not be made: "
        "ValueError: state is not JSON"
    )
    target = await _service("workplace")
    with pytest.raises(InvalidCheckpointStateError) as installed:
        await ResourcesParticipant(target).install(records, [_ep("r1"), _ep("r2")])
    assert installed.value.message == (
        "record 0: packed state of rollout r1 could not be made: ValueError: state is not JSON"
    )
    assert target.rollout_ids() == []


@pytest.mark.parametrize("environment", ["workplace", "blackjack"])
async def test_an_untouched_episode_is_saved_as_its_task_and_restores_to_the_same_state(
    tmp_path: Path, environment: str, packs: _CountedPack
) -> None:
    service = await _service(environment, "r1", reproducible=True)
    assert service.environment.reproducible_start
    (record,) = _stored(tmp_path, await ResourcesParticipant(service).export([_ep("r1")]))
    assert record["fresh_start"] is True
    assert (record["state"], record["packed_state"], packs.calls) == (None, None, 0)
    target = await _service(environment, reproducible=True)
    assert await ResourcesParticipant(target).install([record], [_ep("r1")]) == [_ep("r1", 1)]
    env = service.environment
    saved = env.export_state(service._episodes["r1"].state)
    assert env.export_state(target._episodes["r1"].state) == saved
    # A restored untouched episode is still saved as its task by the next checkpoint.
    (again,) = await ResourcesParticipant(target).export([_ep("r1", 1)])
    assert again["fresh_start"] is True


async def test_a_tool_call_makes_the_next_checkpoint_copy_the_state(
    tmp_path: Path, packs: _CountedPack
) -> None:
    service = await _service("workplace", "r1", "r2", reproducible=True)
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)
    stored = _stored(tmp_path, await ResourcesParticipant(service).export([_ep("r1"), _ep("r2")]))
    by_rollout = {r["rollout_id"]: r for r in stored}
    assert by_rollout["r1"]["fresh_start"] is False and packs.calls == 1
    assert by_rollout["r2"]["fresh_start"] is True
    target = await _service("workplace", reproducible=True)
    await ResourcesParticipant(target).install(stored, [_ep("r1"), _ep("r2")])
    replay = await target.call_tool("calendar_create_event", call)
    assert replay.replayed
    titles = target.environment.call(
        target._episodes["r1"].state, "calendar_search_events", {"query": ""}
    )
    assert "Team sync" in titles


async def test_the_call_fingerprint_survives_a_snapshot_and_old_records_replay_any_call(
    tmp_path: Path,
) -> None:
    service = await _service("workplace", "r1")
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    other = call.model_copy(update={"arguments": json.dumps({**EVENT, "title": "Demo"})})
    first = await service.call_tool("calendar_create_event", call)
    (stored,) = _stored(tmp_path, await ResourcesParticipant(service).export([_ep("r1")]))
    saved: dict[str, Any] = dict(EpisodeRecord.model_validate(stored).tool_results[0])
    assert saved["fingerprint"] == call_fingerprint("calendar_create_event", call.arguments)

    restored = await _service("workplace")
    await ResourcesParticipant(restored).install([stored], [_ep("r1")])
    assert await restored.call_tool("calendar_create_event", call) == first.model_copy(
        update={"replayed": True}
    )
    for tool, changed in (("calendar_create_event", other), ("email_send", call)):
        with pytest.raises(IdempotencyConflictError, match=r"rollout 'r1', turn 0, call 0"):
            await restored.call_tool(tool, changed)

    # A record saved before fingerprints existed: the key replays for any call, as before.
    (old_result,) = copy.deepcopy(stored["tool_results"])  # type: ignore[misc]
    del old_result["fingerprint"]  # type: ignore[union-attr]
    old = {**stored, "tool_results": [old_result]}
    older = await _service("workplace")
    await ResourcesParticipant(older).install([old], [_ep("r1")])
    assert (await older.call_tool("email_send", other)).replayed


def test_a_fingerprint_compares_arguments_by_value() -> None:
    same = call_fingerprint("email_send", '{"to": "a@b.c", "n": 1}')
    assert call_fingerprint("email_send", '{ "n":1,"to":"a@b.c"}') == same
    assert call_fingerprint("email_list_sent", "") == call_fingerprint("email_list_sent", "{}")
    assert call_fingerprint("email_send", '{"to": "a@b.c", "n": 2}') != same
    assert call_fingerprint("calendar_search_events", '{"to": "a@b.c", "n": 1}') != same
    # Malformed arguments are compared by their text.
    assert call_fingerprint("email_send", '{"to"') != call_fingerprint("email_send", '{"to" ')
