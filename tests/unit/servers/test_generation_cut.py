"""The generation cut's pieces on their own: what a stream tells about a prefix (UTF-8,
tool-call and reasoning deltas), the refusal rules, the continuation request each engine
takes (wire fixtures under tests/fixtures/engines), the digest, and saved prefixes of an
older format still installing (goldens under tests/golden/records)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.model.generation_cut import (
    CallPrefix,
    PartialCall,
    continuation_body,
    refusal,
    request_digest,
)
from rollpoint.servers.model.model_participant import ModelParticipant
from rollpoint.servers.model.model_server import ModelServer, ModelServerSettings

FIXTURES = Path(__file__).parents[2] / "fixtures" / "engines"
GOLDEN = Path(__file__).parents[2] / "golden" / "records"


def chunk(content: str | None = None, ids: list[int] | None = None, **delta: Any) -> Any:
    pieces = content.encode() if content is not None else b""
    entries = [
        {"token": f"t{i}", "logprob": -0.5, "bytes": list(b), "top_logprobs": []}
        for i, b in enumerate(delta.pop("token_bytes", [pieces] if ids else []))
    ]
    if content is not None:
        delta["content"] = content
    return {
        "choices": [
            {"index": 0, "delta": delta, "token_ids": ids or [], "logprobs": {"content": entries}}
        ]
    }


def prefix_after(*chunks: Any) -> CallPrefix:
    call = PartialCall("r1", 0, 0, 2)
    for c in chunks:
        call.feed(c)
    prefix = call.freeze().prefix("vllm")
    assert prefix is not None
    return prefix


def payload(**more: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **more}


def why(prefix: CallPrefix, **more: Any) -> str | None:
    return refusal(payload(**more), prefix, engine="vllm", enabled=True, policy_version=2)


def test_a_whole_text_prefix_is_continued() -> None:
    prefix = prefix_after(chunk("Let", [1]), chunk(" me", [2]))
    assert (prefix.text, prefix.ids(), prefix.count) == ("Let me", [1, 2], 2)
    assert prefix.utf8_complete and why(prefix) is None


def test_a_prefix_ending_inside_a_utf8_character_is_refused() -> None:
    euro = "€".encode()  # three bytes: a byte-level token may stop after two
    split = prefix_after(chunk("a", [1]), chunk("", [2], token_bytes=[euro[:2]]))
    assert not split.utf8_complete and why(split) == "utf8_split"
    whole = prefix_after(
        chunk("a", [1]),
        chunk("", [2], token_bytes=[euro[:2]]),
        chunk("€", [3], token_bytes=[euro[2:]]),
    )
    assert whole.utf8_complete and why(whole) is None
    # Without bytes, the replacement character an engine sends for a torn one tells.
    torn = prefix_after(
        {"choices": [{"index": 0, "delta": {"content": "a\ufffd"}, "token_ids": [1, 2]}]}
    )
    assert why(torn) == "utf8_split"


def test_a_prefix_inside_a_tool_call_or_reasoning_is_refused() -> None:
    head = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    tool = prefix_after(chunk("ok", [1]), chunk(None, [2], tool_calls=[head]))
    assert why(tool) == "tool_call"
    thinking = prefix_after(chunk(None, [1], reasoning_content="hmm"))
    assert why(thinking) == "reasoning"


@pytest.mark.parametrize(
    ("more", "reason"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "constrained_decoding"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "constrained_decoding"),
        ({"tool_choice": "required"}, "constrained_decoding"),
        ({"guided_json": {"type": "object"}}, "constrained_decoding"),
        ({"ebnf": "root ::= 'a'"}, "constrained_decoding"),
        ({"stream": True}, "streamed_caller"),
        ({"n": 2}, "choices"),
        ({"max_tokens": 2}, "max_tokens"),
        ({"response_format": {"type": "text"}, "tool_choice": "auto", "max_tokens": 3}, None),
    ],
)
def test_what_the_request_asks_decides(more: dict[str, Any], reason: str | None) -> None:
    prefix = prefix_after(chunk("Let", [1]), chunk(" me", [2]))
    assert why(prefix, **more) == reason


def test_engine_policy_and_digest_rules() -> None:
    prefix = prefix_after(chunk("Let", [1]))
    assert refusal(payload(), prefix, engine="sglang_native", enabled=True, policy_version=2) == (
        "engine_unsupported"
    )
    assert refusal(payload(), prefix, engine="vllm", enabled=False, policy_version=2) == (
        "engine_unsupported"
    )
    assert refusal(payload(), prefix, engine="vllm", enabled=True, policy_version=1) == (
        "policy_newer"
    )
    tampered = prefix.model_copy(update={"text": "Lex"})
    assert not tampered.digest_ok() and why(tampered) == "digest_mismatch"


def test_the_replacement_must_send_the_cut_calls_request() -> None:
    call = PartialCall("r1", 0, 0, 2, request=request_digest(b'{"seed":1}'))
    call.feed(chunk("Let", [1]))
    prefix = call.freeze().prefix("vllm")
    assert prefix is not None and prefix.digest_ok()
    same = request_digest(b'{"seed":1}')
    assert (
        refusal(payload(), prefix, engine="vllm", enabled=True, policy_version=2, request=same)
        is None
    )
    other = request_digest(b'{"seed":2}')
    assert refusal(
        payload(), prefix, engine="vllm", enabled=True, policy_version=2, request=other
    ) == ("request_changed")
    # The request digest is covered by the prefix's digest.
    assert not prefix.model_copy(update={"request_digest": other}).digest_ok()


@pytest.mark.parametrize(
    ("engine", "name"),
    [("vllm", "vllm_chat_continue_request.json"), ("sglang", "sglang_chat_continue_request.json")],
)
def test_the_continuation_request_has_each_engines_shape(engine: str, name: str) -> None:
    fixture = orjson.loads((FIXTURES / name).read_bytes())
    (record,) = orjson.loads((GOLDEN / "call_prefix_v1.json").read_bytes())["records"]
    prefix = CallPrefix.model_validate(record["prefix"])
    assert (prefix.text, prefix.count) == (fixture["prefix_text"], fixture["prefix_tokens"])
    body = continuation_body(fixture["caller_request"], prefix, engine)
    assert body == fixture["continuation_request"]


async def test_a_saved_prefix_of_format_1_installs_and_waits_for_its_call() -> None:
    golden = orjson.loads((GOLDEN / "call_prefix_v1.json").read_bytes())["records"]
    server = ModelServer(ModelServerSettings(upstream_url="http://127.0.0.1:9/v1"))
    participant = ModelParticipant(server)
    await participant.install(golden, [EpisodeId(rollout_id="r7")])
    prefix = server.prefixes["r7"]
    assert prefix.digest_ok() and (prefix.turn, prefix.ids(), prefix.policy_version) == (
        2,
        [10061, 752],
        3,
    )
    # Saved again by the next snapshot while its call has not come.
    records = await participant.export([EpisodeId(rollout_id="r7", attempt=1)])
    assert [r["kind"] for r in records] == ["model_prefix"]
    # Written before prefixes kept their request's digest: none, and still its own digest.
    assert records[0]["prefix"] == {**golden[0]["prefix"], "request_digest": None}
    participant.forget(["r7"])
    assert "r7" not in server.prefixes


def test_a_weight_switch_splits_the_segments_and_a_frozen_partial_keeps_what_it_saw() -> None:
    call = PartialCall("r1", 0, 0, 2)
    call.feed(chunk("Let me", ids=[11, 12]))
    frozen = call.freeze()  # a snapshot's cut, before the switch
    call.feed(chunk(" now", ids=[14]))  # still the old weights
    call.switch(3)  # keep mode: version 3 live from here
    call.switch(3)  # the same version again: nothing new
    call.feed(chunk(" see", ids=[13]))
    assert [(s.policy_version, s.tokens) for s in call.segments()] == [(2, 3), (3, 1)]
    saved = frozen.prefix("vllm")
    assert saved is not None and saved.digest_ok()
    # The snapshot is before the update: one segment, the old version.
    assert [(s.policy_version, s.tokens) for s in saved.segments] == [(2, 2)]
    after = call.freeze().prefix("vllm")
    assert after is not None
    assert [(s.policy_version, s.tokens) for s in after.segments] == [(2, 3), (3, 1)]
    # A switch before any token leaves no empty segment behind.
    fresh = PartialCall("r2", 0, 0, 2)
    fresh.switch(4)
    fresh.feed(chunk("Hi", ids=[7]))
    assert [(s.policy_version, s.tokens) for s in fresh.segments()] == [(4, 1)]
