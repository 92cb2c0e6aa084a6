"""The model participant on its own (no sockets): readiness, export/install, retire, forget."""

from __future__ import annotations

import copy

import orjson
import pytest
from pydantic import JsonValue

from rollpoint.participant.participant import Participant
from rollpoint.protocol.control import RetireOutcomeKind
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.model.call_ledger import CallRecord
from rollpoint.servers.model.episode_tag import EpisodeTag
from rollpoint.servers.model.model_participant import ModelParticipant
from rollpoint.servers.model.model_server import ModelServer, ModelServerSettings


def _rec(rollout_id: str, turn: int, attempt: int = 0) -> CallRecord:
    return CallRecord(
        rollout_id=rollout_id,
        attempt=attempt,
        turn=turn,
        request_messages=1 + 2 * turn,
        last_message={"role": "user", "content": "hi"},
        response={"role": "assistant", "content": f"turn {turn}"},
    )


def _server() -> ModelServer:
    server = ModelServer(ModelServerSettings(upstream_url="http://127.0.0.1:9/v1"))
    for turn in range(3):
        server.ledger.record(_rec("r1", turn))
    server.ledger.record(_rec("r2", 0))
    return server


def _ep(rollout_id: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


def test_it_is_a_participant_named_after_its_server() -> None:
    participant = ModelParticipant(_server())
    assert isinstance(participant, Participant)
    assert (participant.kind, participant.name, participant.replica) == (
        "model",
        "model",
        "replica-0",
    )


async def test_a_running_call_does_not_block_the_cut_and_is_counted() -> None:
    # The generation cut: the agent holds a reply landing during the cut, so prepare
    # never waits for a call to finish.
    server = _server()
    participant = ModelParticipant(server)
    async with server.gate.admit():
        with server.running.track(EpisodeTag("r1", 0, 3)):
            await participant.close_admission()
            report = participant.readiness()
    assert (report.ready, report.blockers, report.blocker_count) == (True, [], 0)
    assert report.counts["in_flight"] == 1


async def test_export_then_install_gives_the_same_ledger_and_names_each_episode() -> None:
    source = ModelParticipant(_server())
    records = await source.export([_ep("r1"), _ep("r2"), _ep("unknown")])
    assert {(r["kind"], orjson.dumps(r["episode"])) for r in records} == {
        ("model_call", b'{"rollout_id":"r1","attempt":0}'),
        ("model_call", b'{"rollout_id":"r2","attempt":0}'),
    }
    target_server = ModelServer(ModelServerSettings(upstream_url="http://127.0.0.1:9/v1"))
    target = ModelParticipant(target_server)
    stored = orjson.loads(orjson.dumps(records))
    assert await target.install(stored, [_ep("r1")]) == [_ep("r1", 1)]
    assert [c.turn for c in target_server.ledger.calls("r1")] == [0, 1, 2]
    assert target_server.ledger.calls("r2") == []  # not in the scope


async def test_an_export_hands_out_unchanged_calls_records_again_and_never_changes_them() -> None:
    server = _server()
    participant = ModelParticipant(server)
    first = await participant.export([_ep("r1"), _ep("r2")])
    kept = copy.deepcopy(first)
    server.ledger.record(_rec("r1", 3))  # r1 makes a call after the cut
    second = await participant.export([_ep("r1"), _ep("r2")])
    assert first == kept  # what the first export handed out did not change
    calls = [r["call"] for r in second]
    assert [(c["rollout_id"], c["turn"]) for c in calls if isinstance(c, dict)] == [
        ("r1", 0),
        ("r1", 1),
        ("r1", 2),
        ("r1", 3),
        ("r2", 0),
    ]
    # Calls that did not change come back as the very same records (a snapshot's writer
    # then references them without encoding: RecordMemo), the new one is new.
    assert all(new is old for new, old in zip(second[:3], first[:3], strict=True))
    assert second[4] is first[3] and all(second[3] is not old for old in first)
    # Saved for another attempt, the same calls make a new record naming it.
    third = await participant.export([_ep("r1"), _ep("r2", 1)])
    assert third[4] is not second[4]
    assert third[4]["episode"] == {"rollout_id": "r2", "attempt": 1}
    assert third[:4] == second[:4] and third[0]["call"] is second[0]["call"]


async def test_a_bad_record_installs_nothing() -> None:
    server = _server()
    participant = ModelParticipant(server)
    records = await participant.export([_ep("r1")])
    other: JsonValue = {"rollout_id": "r2", "attempt": 0}
    stray: dict[str, JsonValue] = {**records[0], "episode": other}
    truncated: dict[str, JsonValue] = {"kind": "model_call"}
    for broken in ([*records, truncated], [*records, stray]):
        server.ledger.release(["r1"])
        with pytest.raises(InvalidCheckpointStateError):
            await participant.install(broken, [_ep("r1"), _ep("r2")])
        assert server.ledger.calls("r1") == [] and len(server.ledger.calls("r2")) == 1


async def test_install_makes_the_snapshot_the_truth_for_every_scoped_rollout() -> None:
    server = _server()
    participant = ModelParticipant(server)
    saved = await participant.export([_ep("r1")])
    server.ledger.record(_rec("r1", 3))  # made after the cut
    assert await participant.install(saved, [_ep("r1"), _ep("r2")]) == [_ep("r1", 1)]
    assert [c.turn for c in server.ledger.calls("r1")] == [0, 1, 2]
    assert server.ledger.calls("r2") == []  # scoped, saved without calls


def test_retire_reports_running_calls_cancelled_and_others_unknown() -> None:
    server = _server()
    participant = ModelParticipant(server)
    with server.running.track(EpisodeTag("r1", 0, 3)):
        outcomes = participant.retire({"r1": 0, "r2": 0})
    assert [(o.episode.key, o.outcome) for o in outcomes] == [
        ("r1#0", RetireOutcomeKind.CANCELLED),
        ("r2#0", RetireOutcomeKind.UNKNOWN),
    ]


def test_forget_drops_the_ledger_records_of_known_rollouts() -> None:
    server = _server()
    participant = ModelParticipant(server)
    assert participant.forget(["r1", "nope", "r1"]) == ["r1"]
    assert server.ledger.calls("r1") == [] and server.ledger.count == 1
    assert participant.stats()["recorded_calls"] == 1
    assert participant.ack([_ep("r2")]) == []
