"""Bad engine data on purpose: the scripted policy's fault setting (``policy.faults``).

Owns :class:`FaultPlan`, which counts each fault's calls and corrupts the ones it names: an **oversized reply**
(the message's content padded by ``pad_bytes``, so the episode's reply outgrows
``max_reply_bytes``), **bad token data** in a stream (a token id of 2**31, ``"13"``,
``13.0`` or -1, or a logprob of 0.5, ``"x"`` or null, in the first chunk that carries
one), and a **tool call without an id** (the id dropped from a streamed tool call's first
delta). These are the engine-data breaks of issue 33 (items 5 and 6): ``rollpoint chaos``
turns them on for the run a trial names, since a fault proxy cannot rewrite a stream.

A fault's ``calls`` count only the calls it can corrupt, from 1, in the order they
reach the policy: every call for ``oversized_reply``; streamed calls whose chunks carry
token ids (``id_*``) or logprobs (``logprob_*``) for ``token_data``; streamed calls whose
choice 0 is a tool call for ``tool_call_id``. The engine start check's probe
(:data:`~rollpoint.policy.engine_check.START_CHECK_PROMPT`) is never counted: it decides
the run's token settings, it is not an episode's call. With ``fault_log`` set, every
corruption is appended there (one JSON line: ``call``, ``corrupt``, ``how``, ``reply_id``,
``field``, ``ts``) before the reply leaves, so a test knows it struck.

Off by default (no faults). Does not own the setting's vocabulary
(:class:`~rollpoint.protocol.engine_faults.EngineFault`, read by the run config too), the
replies themselves
(:mod:`rollpoint.policy.scripted_policy`) nor how rollpoint refuses the bad data
(:mod:`rollpoint.policy.stream_chunk_check`, :mod:`rollpoint.http.ndjson_lines`).
"""

from __future__ import annotations

import time
from typing import Any, BinaryIO

import orjson

from rollpoint.protocol.engine_faults import BAD_VALUES, PADDING, EngineFault


class FaultPlan:
    """The faults of one policy process: each one's call count, and its corruptions."""

    def __init__(self, faults: list[EngineFault], log: BinaryIO | None = None) -> None:
        self.faults = faults
        self.log = log
        self._seen = [0] * len(faults)

    def padding(self) -> str:
        """The padding for the call arriving now (``""``: none); counts it for every
        ``oversized_reply`` fault."""
        pad = 0
        for i, fault in enumerate(self.faults):
            if fault.corrupt == "oversized_reply":
                self._seen[i] += 1
                if self._seen[i] in fault.calls:
                    assert fault.pad_bytes is not None
                    pad += fault.pad_bytes
        if not pad:
            return ""
        return (PADDING * (pad // len(PADDING) + 1))[:pad]

    def note_padding(self, reply_id: str, pad: int) -> None:
        for i, fault in enumerate(self.faults):
            if fault.corrupt == "oversized_reply" and self._seen[i] in fault.calls:
                self._write(i, fault, reply_id, f"content padded by {pad} bytes")

    def corrupt_stream(self, reply_id: str, chunks: list[bytes], tool_call: bool) -> list[bytes]:
        """``chunks`` (SSE ``data:`` lines) with the stream faults due on this call applied;
        counts the call for every stream fault it can get."""
        for i, fault in enumerate(self.faults):
            if fault.corrupt == "oversized_reply":
                continue
            if fault.corrupt == "tool_call_id" and not tool_call:
                continue
            if fault.corrupt == "token_data" and _find(chunks, fault) is None:
                continue  # nothing of that field in this stream: not one of its calls
            self._seen[i] += 1
            if self._seen[i] not in fault.calls:
                continue
            found = _find(chunks, fault)
            if found is None:
                continue
            at, event, field = found
            chunks = [*chunks[:at], _sse(event), *chunks[at + 1 :]]
            self._write(i, fault, reply_id, field)
        return chunks

    def _write(self, index: int, fault: EngineFault, reply_id: str, field: str) -> None:
        if self.log is None:
            return
        line = {
            "call": self._seen[index],
            "corrupt": fault.corrupt,
            "how": fault.how,
            "reply_id": reply_id,
            "field": field,
            "ts": time.time(),
        }
        self.log.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _find(chunks: list[bytes], fault: EngineFault) -> tuple[int, dict[str, Any], str] | None:
    """The first chunk ``fault`` can corrupt, corrupted (a new object), and the field it
    spoiled; None when no chunk carries the field."""
    for at, chunk in enumerate(chunks):
        if not chunk.startswith(b"data: {"):
            continue
        event = orjson.loads(chunk[len(b"data: ") :])
        for choice in event.get("choices") or ():
            spoiled = _spoil(choice, fault)
            if spoiled is not None:
                return at, event, f"choices[{choice.get('index', 0)}].{spoiled}"
    return None


def _spoil(choice: dict[str, Any], fault: EngineFault) -> str | None:
    """Corrupt ``choice`` in place as ``fault`` says; the field spoiled, or None."""
    if fault.corrupt == "tool_call_id":
        for k, call in enumerate((choice.get("delta") or {}).get("tool_calls") or ()):
            if call.get("id") is not None:
                del call["id"]
                return f"delta.tool_calls[{k}].id"
        return None
    assert fault.how is not None
    bad = BAD_VALUES[fault.how]
    if fault.how.startswith("id_"):
        ids = choice.get("token_ids")
        if ids:
            ids[-1] = bad
            return f"token_ids[{len(ids) - 1}]"
        return None
    content = (choice.get("logprobs") or {}).get("content")
    if content:
        content[-1]["logprob"] = bad
        return f"logprobs.content[{len(content) - 1}].logprob"
    return None
