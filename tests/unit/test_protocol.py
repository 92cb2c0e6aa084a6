"""Identities and the error tree: what crosses the wire comes back as the same thing."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rollpoint.protocol import errors
from rollpoint.protocol.episode import RowFailure, RowRefused, RunReply, RunRequest
from rollpoint.protocol.ids import EpisodeId, is_identifier, new_rollout_id


def test_episode_key_round_trip_and_next_attempt() -> None:
    ep = EpisodeId(rollout_id="r7", attempt=0)
    assert ep.key == "r7#0"
    assert EpisodeId.from_key("r7#0") == ep
    assert ep.next_attempt().key == "r7#1"


def test_a_copy_with_another_attempt_has_its_own_key_and_fields_alone_decide_equality() -> None:
    ep = EpisodeId(rollout_id="r7", attempt=0)
    assert ep.key == "r7#0"  # cached on the instance now
    moved = ep.model_copy(update={"attempt": 3})
    assert (moved.key, moved.attempt) == ("r7#3", 3)
    assert ep == EpisodeId(rollout_id="r7")  # one has its key cached, the other not
    assert ep.model_dump() == {"rollout_id": "r7", "attempt": 0}
    assert pickle.loads(pickle.dumps(moved)).key == "r7#3"


@given(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,40}", fullmatch=True), st.integers(0, 10_000))
def test_episode_key_parses_back_for_any_identifier(rollout: str, attempt: int) -> None:
    ep = EpisodeId(rollout_id=rollout, attempt=attempt)
    assert EpisodeId.from_key(ep.key) == ep


@pytest.mark.parametrize("key", ["r7", "r7#", "r7#x", "#"])
def test_malformed_episode_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError):
        EpisodeId.from_key(key)


@pytest.mark.parametrize("bad", ["", "../etc", "a b", "x" * 129, "-lead"])
def test_identifiers_refuse_unsafe_names(bad: str) -> None:
    assert not is_identifier(bad)
    with pytest.raises(ValidationError):
        EpisodeId(rollout_id=bad)


def test_new_rollout_ids_are_unique_identifiers() -> None:
    ids = {new_rollout_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(is_identifier(i) for i in ids)


def test_strict_wire_models_refuse_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="extra"):
        RunRequest.model_validate({"rows": [], "surprise": 1})
    with pytest.raises(ValidationError):
        RunRequest.model_validate({"rows": []})  # at least one row


def test_row_results_are_told_apart_by_kind() -> None:
    from pydantic import TypeAdapter

    from rollpoint.protocol.episode import RowResult

    adapter: TypeAdapter[RunReply | RowFailure | RowRefused] = TypeAdapter(RowResult)
    ep = {"rollout_id": "r1", "attempt": 0}
    refused = adapter.validate_python(
        {"kind": "refused", "episode": ep, "group_id": "g", "row": 0, "reason": "x"}
    )
    assert isinstance(refused, RowRefused)
    failed = adapter.validate_python(
        {
            "kind": "failed",
            "episode": ep,
            "group_id": "g",
            "row": 1,
            "code": "c",
            "message": "m",
            "transport": True,
        }
    )
    assert isinstance(failed, RowFailure) and failed.transport


@pytest.mark.parametrize(
    "cls",
    [
        errors.InvalidPhaseError,
        errors.CheckpointConflictError,
        errors.StaleCheckpointError,
        errors.StaleAttemptError,
        errors.AttemptConflictError,
        errors.AttemptCancelledError,
        errors.EnvironmentMismatchError,
        errors.EnvironmentRaisedError,
        errors.DeadlineExceededError,
        errors.InvalidCheckpointStateError,
        errors.UnauthorizedError,
        errors.NotFoundError,
    ],
)
def test_errors_round_trip_through_the_wire_envelope(cls: type[errors.RollpointError]) -> None:
    original = cls("the reason")
    rebuilt = errors.error_from_wire(original.status, original.to_wire(), peer="agent-replica-0")
    assert type(rebuilt) is cls
    assert "the reason" in rebuilt.message and "agent-replica-0" in rebuilt.message
    assert rebuilt.retryable == original.retryable


TREE = [errors.RollpointError, *errors._all_subclasses(errors.RollpointError)]


def test_each_code_belongs_to_one_class_and_has_one_status() -> None:
    # A class that forgets its own code inherits its parent's: two classes, one code, and
    # possibly two statuses. Codes are unique, so each code has its class's one status.
    owners: dict[str, list[str]] = {}
    for cls in TREE:
        owners.setdefault(cls.code, []).append(cls.__name__)
        assert 400 <= cls.status <= 599, f"{cls.__name__}: status {cls.status}"
    assert {code: names for code, names in owners.items() if len(names) > 1} == {}
    for cls in TREE[1:]:
        assert errors.error_class_for(cls.code) is cls


def test_row_failure_codes_and_tool_argument_errors_are_in_the_tree() -> None:
    from rollpoint.envs import ToolArgumentError

    assert ToolArgumentError is errors.ToolArgumentError
    table = {cls.code: (cls.status, cls.retryable) for cls in TREE}
    assert table["internal"] == (500, False)
    assert table["environment_mismatch"] == (422, False)  # bad data: fails the group
    assert table["environment_error"] == (500, False)  # the environment's bug: not retried
    assert table["attempt_conflict"] == (409, True)  # plumbing: re-sent fresh
    assert table["cancelled"] == (409, True)
    assert table["bad_request"] == (400, False)
    assert table["tool_argument_invalid"] == (400, False)


def test_the_protocol_reference_gives_each_code_the_trees_status() -> None:
    # Every error table of docs/protocol.md (a row: | `code` | status | ...), against the tree.
    reference = Path(__file__).parents[2] / "docs" / "protocol.md"
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3})[ |]", reference.read_text(), re.MULTILINE)
    documented: dict[str, set[int]] = {}
    for code, status in rows:
        documented.setdefault(code, set()).add(int(status))
    tree = {cls.code: cls.status for cls in TREE}
    assert {code: statuses for code, statuses in documented.items() if len(statuses) > 1} == {}
    assert {code: s.pop() for code, s in documented.items()} == {
        code: tree[code] for code in documented if code in tree
    }
    refusals = {cls.code for cls in errors._all_subclasses(errors.ProtocolError)}
    assert refusals <= set(documented), "a refusal code the reference does not list"


def test_off_protocol_replies_become_transport_or_protocol_errors() -> None:
    assert isinstance(errors.error_from_wire(502, "Bad Gateway", peer="p"), errors.TransportError)
    assert type(errors.error_from_wire(418, {"x": 1}, peer="p")) is errors.ProtocolError


def test_errors_pickle_with_their_message() -> None:
    err = pickle.loads(pickle.dumps(errors.StaleAttemptError("r7#0 was retired")))
    assert isinstance(err, errors.StaleAttemptError) and err.message == "r7#0 was retired"
