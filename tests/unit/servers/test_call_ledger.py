"""The call ledger: filed by rollout, exported and installed all or nothing, released."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.token_data import TokenTrace
from rollpoint.servers.model import call_ledger
from rollpoint.servers.model.call_ledger import CallLedger, CallRecord


def _rec(rollout_id: str, turn: int, attempt: int = 0) -> CallRecord:
    return CallRecord(
        rollout_id=rollout_id,
        attempt=attempt,
        turn=turn,
        request_messages=1 + 2 * turn,
        last_message={"role": "user", "content": "hi"},
        response={"role": "assistant", "content": f"turn {turn}"},
        finish_reason="stop",
        prompt_tokens=10,
        completion_tokens=5,
        policy_version=3,
        latency_s=0.01,
    )


def _filled() -> CallLedger:
    ledger = CallLedger()
    for turn in range(3):
        ledger.record(_rec("r1", turn))
    ledger.record(_rec("r2", 0))
    return ledger


def test_records_are_filed_by_rollout_in_call_order() -> None:
    ledger = _filled()
    assert ledger.count == len(ledger) == 4
    assert [c.turn for c in ledger.calls("r1")] == [0, 1, 2]
    assert [c.rollout_id for c in ledger.calls("r2")] == ["r2"]
    assert ledger.calls("nope") == []


def test_export_names_only_the_rollouts_asked_for_and_is_json() -> None:
    ledger = _filled()
    exported = ledger.export(["r1", "missing", "r1"])
    assert [(r["rollout_id"], r["turn"]) for r in exported] == [("r1", 0), ("r1", 1), ("r1", 2)]
    assert orjson.loads(orjson.dumps(exported)) == exported


def test_a_records_json_form_is_its_model_dump_also_when_built_unvalidated() -> None:
    # The model server builds records with model_construct (defaults filled, nothing checked).
    built = CallRecord.model_construct(
        rollout_id="r1",
        attempt=0,
        turn=0,
        request_messages=2,
        last_message={"role": "tool", "content": "{}", "tool_call_id": "c0"},
        response={
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
        },
        finish_reason="tool_calls",
        latency_s=0.25,
        streamed=True,
        logprobs={"content": [{"token": "a", "logprob": -0.5}]},
    )
    ledger = CallLedger()
    ledger.record(built)
    ledger.record(_rec("r1", 1))

    assert ledger.calls_json("r1") == [c.model_dump(mode="json") for c in ledger.calls("r1")]
    assert CallLedger().install(ledger.export(["r1"])) == ["r1"]


def test_install_into_a_fresh_ledger_gives_the_same_records_and_is_idempotent() -> None:
    source = _filled()
    exported = source.export(["r1", "r2"])
    target = CallLedger()
    assert sorted(target.install(exported)) == ["r1", "r2"]
    assert target.calls("r1") == source.calls("r1")
    assert target.count == 4
    target.install(exported)
    assert target.count == 4
    assert target.calls("r2") == source.calls("r2")


def test_install_replaces_the_named_rollouts_only() -> None:
    ledger = _filled()
    ledger.install([_rec("r1", 0, attempt=0).model_dump(mode="json")])
    assert [c.turn for c in ledger.calls("r1")] == [0]
    assert len(ledger.calls("r2")) == 1
    assert ledger.count == 2


def test_a_bad_record_installs_nothing_and_names_the_field() -> None:
    ledger = _filled()
    good = _rec("r9", 0).model_dump(mode="json")
    bad: dict[str, Any] = {**_rec("r1", 5).model_dump(mode="json"), "attempt": "x"}
    with pytest.raises(InvalidCheckpointStateError, match="attempt"):
        ledger.install([good, bad])
    assert ledger.calls("r9") == []
    assert len(ledger.calls("r1")) == 3
    assert ledger.count == 4


def test_release_drops_rollouts_and_keeps_the_count_right() -> None:
    ledger = _filled()
    assert ledger.release(["r1", "unknown"]) == 3
    assert ledger.calls("r1") == []
    assert ledger.count == 1
    assert ledger.release(["r1"]) == 0


def test_each_export_holds_the_records_as_of_then_after_appends_installs_and_releases() -> None:
    ledger = _filled()
    first = ledger.export(["r1"])
    ledger.record(_rec("r1", 3))
    assert [r["turn"] for r in first] == [0, 1, 2]  # an earlier export is not extended
    assert ledger.export(["r1"]) == [c.model_dump(mode="json") for c in ledger.calls("r1")]
    ledger.install([_rec("r1", 0, attempt=1).model_dump(mode="json")])
    assert [(r["turn"], r["attempt"]) for r in ledger.export(["r1"])] == [(0, 1)]
    ledger.release(["r1"])
    ledger.record(_rec("r1", 5))
    assert [r["turn"] for r in ledger.export(["r1"])] == [5]


def test_the_stamp_changes_with_every_change_of_a_rollout_and_is_never_reused() -> None:
    ledger = _filled()
    seen = [ledger.stamp("r1"), ledger.stamp("r2")]
    assert ledger.stamp("unknown") is None
    ledger.calls_json("r1")
    ledger.export(["r1"])
    assert [ledger.stamp("r1"), ledger.stamp("r2")] == seen  # reading changes nothing
    for change in (
        lambda: ledger.record(_rec("r1", 3)),
        lambda: ledger.record(_rec("r1", 1, attempt=1)),  # supersedes turns 1..3
        lambda: ledger.install([_rec("r1", 0, attempt=2).model_dump(mode="json")]),
        lambda: ledger.release(["r1"]),
        lambda: ledger.record(_rec("r1", 0)),
    ):
        change()
        assert ledger.stamp("r1") not in seen
        seen.append(ledger.stamp("r1"))
        assert ledger.stamp("r2") == seen[1]
    assert seen[-2] is None  # released: no records, no stamp


def test_a_continued_attempt_supersedes_the_older_attempts_calls_from_its_turn_on() -> None:
    # Attempt 0 made turns 0..2, but the cut saved the session before turn 2 (its reply was
    # held): attempt 1 starts at turn 2, and its call replaces the one never applied.
    ledger = _filled()
    ledger.export(["r1"])  # the JSON cache must follow the drop too
    ledger.record(_rec("r1", 2, attempt=1))
    assert [(c.turn, c.attempt) for c in ledger.calls("r1")] == [(0, 0), (1, 0), (2, 1)]
    assert [(r["turn"], r["attempt"]) for r in ledger.export(["r1"])] == [(0, 0), (1, 0), (2, 1)]
    assert ledger.count == 4
    ledger.record(_rec("r1", 3, attempt=1))  # later turns of the same attempt just append
    assert [(c.turn, c.attempt) for c in ledger.calls("r1")][-2:] == [(2, 1), (3, 1)]


def test_a_record_is_dumped_when_filed_and_an_export_dumps_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = CallLedger()
    ledger.record(_rec("r1", 0))
    dumps: list[int] = []
    real = call_ledger.json_form

    def counted(rec: CallRecord) -> dict[str, Any]:
        dumps.append(rec.turn)
        return real(rec)

    monkeypatch.setattr(call_ledger, "json_form", counted)
    ledger.record(_rec("r1", 1))
    ledger.record(_rec("r1", 1, attempt=1))  # supersedes turn 1 of attempt 0
    assert dumps == [1, 1]  # on the data path, as each call is filed
    exported = ledger.export(["r1"])
    assert dumps == [1, 1]  # the checkpoint's export dumped nothing
    monkeypatch.undo()
    assert exported == [
        _rec("r1", 0).model_dump(mode="json"),
        _rec("r1", 1, 1).model_dump(mode="json"),
    ]


GOLDEN = Path(__file__).parents[2] / "golden" / "records"


def test_records_written_before_token_capture_still_install() -> None:
    old = orjson.loads((GOLDEN / "call_record_v1.json").read_bytes())["records"]
    ledger = CallLedger()
    assert ledger.install(old) == ["r7"]
    (rec,) = ledger.calls("r7")
    assert (rec.tokens, rec.completion_id, rec.policy_version) == (None, None, 2)


def test_a_token_trace_round_trips_and_a_torn_one_is_refused() -> None:
    trace = TokenTrace.build(
        engine="vllm",
        completion_ids=[5, 6],
        completion_logprobs=[-0.5, -1.0],
        prompt_ids=[1, 2],
        context=None,
    )
    ledger = CallLedger()
    ledger.record(_rec("r1", 0).model_copy(update={"tokens": trace, "completion_id": "c1"}))
    exported = orjson.loads(orjson.dumps(ledger.export(["r1"])))
    again = CallLedger()
    again.install(exported)
    assert again.calls("r1")[0].tokens == trace
    assert again.context_before("r1", 1) == [1, 2, 5, 6]
    exported[0]["tokens"]["completion_count"] = 3
    with pytest.raises(InvalidCheckpointStateError, match="completion_count 3"):
        CallLedger().install(exported)
