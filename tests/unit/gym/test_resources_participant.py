"""The resources participant on its own (no sockets): freeze, export/install, modes, forget."""

from __future__ import annotations

import asyncio
import copy
import json

import orjson
import pytest
from pydantic import JsonValue

from rollpoint.envs.registry import get_environment
from rollpoint.gym.participant import Participant
from rollpoint.gym.resources_participant import ResourcesParticipant
from rollpoint.gym.resources_server import EpisodeRecord, ResourcesService
from rollpoint.protocol.control import RetireOutcomeKind
from rollpoint.protocol.episode import EpisodeStart, ToolCall
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import CheckpointMode

EVENT = {"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}


def _ep(rollout_id: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


async def _service(environment: str, *rollout_ids: str) -> ResourcesService:
    env = get_environment(environment)
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


async def test_export_names_scoped_episodes_and_install_takes_only_the_scope() -> None:
    source = ResourcesParticipant(await _service("workplace", "r1", "r2"))
    records = await source.export([_ep("r1", 1), _ep("r2"), _ep("unknown")])
    assert [(r["kind"], r["episode"]) for r in records] == [
        ("episode_state", {"rollout_id": "r1", "attempt": 1}),
        ("episode_state", {"rollout_id": "r2", "attempt": 0}),
    ]
    target_service = await _service("workplace")
    target = ResourcesParticipant(target_service)
    stored = orjson.loads(orjson.dumps(records))
    assert await target.install(stored, [_ep("r2")]) == [_ep("r2", 1)]
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


async def test_a_checkpoint_packs_the_state_and_old_unpacked_records_still_install() -> None:
    service = await _service("workplace", "r1")
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)
    (packed,) = await ResourcesParticipant(service).export([_ep("r1")])
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
        stored = orjson.loads(orjson.dumps([record]))
        assert await ResourcesParticipant(target_service).install(stored, [_ep("r1")]) == [
            _ep("r1", 1)
        ]
        replay = await target_service.call_tool("calendar_create_event", call)
        assert replay.replayed  # the idempotency table came back with the state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"packed_state": "not base64!"}, "packed_state does not decode"),
        ({"packed_state": "aGVsbG8="}, "packed_state does not decode"),
        ({"state": {"sqlite": "AAAA"}}, "exactly one of 'state' and 'packed_state'"),
        ({"packed_state": None}, "exactly one of 'state' and 'packed_state'"),
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


async def test_a_checkpoint_packs_again_only_an_episode_a_tool_call_changed() -> None:
    service = await _service("workplace", "r1", "r2")
    participant = ResourcesParticipant(service)
    before = {
        r["rollout_id"]: r["packed_state"] for r in await participant.export([_ep("r1"), _ep("r2")])
    }
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)
    after = {
        r["rollout_id"]: r["packed_state"] for r in await participant.export([_ep("r1"), _ep("r2")])
    }
    assert after["r2"] is before["r2"]  # unchanged: the packed form is reused
    assert after["r1"] != before["r1"]
    unpacked = EpisodeRecord.model_validate(
        {**(await participant.export([_ep("r1")]))[0]}
    ).exported_state()
    assert unpacked == service.environment.export_state(service._episodes["r1"].state)


async def test_an_export_reuses_the_records_of_unchanged_episodes_and_never_changes_them() -> None:
    service = await _service("workplace", "r1", "r2")
    participant = ResourcesParticipant(service)
    first = await participant.export([_ep("r1"), _ep("r2")])
    kept = copy.deepcopy(first)
    call = ToolCall(episode=_ep("r1"), turn=0, call_index=0, arguments=json.dumps(EVENT))
    await service.call_tool("calendar_create_event", call)  # r1 goes on after the cut
    second = await participant.export([_ep("r1"), _ep("r2")])
    assert first == kept  # what the first export handed out did not change
    assert second[0] is not first[0]
    assert second[0]["packed_state"] != first[0]["packed_state"]
    parsed = EpisodeRecord.model_validate(second[0])
    assert parsed.exported_state() == service.environment.export_state(
        service._episodes["r1"].state
    )
    assert [(t.turn, t.call_index) for t in parsed.tool_results] == [(0, 0)]
    assert second[1] is first[1]  # r2 did not change: its record is handed out again
    # Saved for another attempt, the same state makes a new record naming it.
    (third,) = await participant.export([_ep("r2", 1)])
    assert third is not second[1] and third["episode"] == {"rollout_id": "r2", "attempt": 1}
    assert third["packed_state"] is second[1]["packed_state"]  # not packed again
