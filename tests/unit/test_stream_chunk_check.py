"""Engine data checked where it arrives (issue 33, item 6): the model server's stream reader
refuses a chunk with a bad token id, logprob or a tool call without an id, naming the
engine and the field, before the generation cut's partial output keeps any of it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from rollpoint.protocol.errors import TransportError
from rollpoint.servers.model.generation_cut import PartialCall
from rollpoint.servers.model.stream_assembler import StreamAssembler


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _chunk(ids: list[Any], logprobs: list[Any] | None = None, **delta: Any) -> dict[str, Any]:
    entries = [{"token": f"t{i}", "logprob": lp} for i, lp in enumerate(logprobs or [])]
    choice: dict[str, Any] = {"index": 0, "delta": {"content": "x", **delta}, "token_ids": ids}
    if logprobs is not None:
        choice["logprobs"] = {"content": entries}
    return {"id": "c1", "choices": [choice]}


def _reader() -> tuple[StreamAssembler, PartialCall]:
    partial = PartialCall("r1", 0, 0, 0)
    return StreamAssembler(partial=partial, engine="vllm"), partial


@pytest.mark.parametrize("bad", [2**31, "13", 13.0, -1, True])
def test_a_bad_token_id_in_a_chunk_fails_the_call_and_reaches_no_prefix(bad: Any) -> None:
    reader, partial = _reader()
    reader.feed(_sse(_chunk([5, 6], [-0.1, -0.2])))
    with pytest.raises(
        TransportError, match=r"^vllm reply: chunk choices\[0\]\.token_ids\[1\] is not a token id"
    ):
        reader.feed(_sse(_chunk([7, bad], [-0.1, -0.2])))
    assert partial.ids == [5, 6]


@pytest.mark.parametrize("bad", [0.5, "x", None])
def test_a_bad_logprob_in_a_chunk_fails_the_call(bad: Any) -> None:
    reader, partial = _reader()
    with pytest.raises(TransportError, match=r"^vllm reply: chunk choices\[0\]\.logprobs\.content"):
        reader.feed(_sse(_chunk([7], [bad])))
    assert partial.ids == [] and partial.entries == []


def test_a_bad_prompt_id_in_a_chunk_fails_the_call() -> None:
    reader, partial = _reader()
    with pytest.raises(TransportError, match=r"chunk prompt_token_ids\[0\]"):
        reader.feed(_sse({"prompt_token_ids": [-3], **_chunk([1])}))
    assert partial.prompt is None


def test_a_streamed_tool_call_without_an_id_is_a_transport_error() -> None:
    reader, _ = _reader()
    call = {"index": 0, "type": "function", "function": {"name": "send_email", "arguments": ""}}
    with pytest.raises(TransportError, match=r"delta\.tool_calls\[0\]\.id is missing"):
        reader.feed(_sse(_chunk([1], tool_calls=[call])))
    # Its later deltas carry only arguments: no id needed there.
    ok, _ = _reader()
    ok.feed(_sse(_chunk([1], tool_calls=[{**call, "id": "call_1"}])))
    ok.feed(_sse(_chunk([2], tool_calls=[{"index": 0, "function": {"arguments": "{}"}}])))
