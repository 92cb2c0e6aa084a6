"""The generation cut: a policy call in flight at a snapshot is saved as its prefix, and the
replacement call after a restore continues from it instead of decoding it all again.

Owns:

- :class:`PartialCall`: what the model server has received so far of one in-flight call it
  streams from the engine (token ids, the engine's logprob entries, text, and whether a
  tool-call or reasoning delta began), appended as chunks arrive. A snapshot takes its
  *lengths* only (:meth:`PartialCall.freeze`, O(1) in the pause: the lists only grow, so
  the first n items never change); the ids are sliced and packed after the pause.
- :class:`CallPrefix`: the saved form (versioned by ``format``), with the policy version of
  each segment and a digest over ids, logprobs, text, prompt and segments.
- The refusal rules (:func:`refusal`): when continuing would be wrong the call is
  regenerated from scratch, and the reason counted. Reasons: ``constrained_decoding``
  (``response_format``, a named or ``required`` ``tool_choice``, guided / structured
  output fields), ``utf8_split`` (the prefix ends inside a UTF-8 character),
  ``tool_call`` / ``reasoning`` (a tool-call or reasoning delta had begun),
``engine_unsupported`` (no prefix
  continuation for this engine, or switched off), ``engine_refused`` (the engine answered
  the continuation with a 4xx), ``digest_mismatch``, ``policy_newer`` (the prefix's policy
  version is newer than the engine's current one), ``max_tokens`` (the prefix used the
  budget up), ``streamed_caller`` and ``choices`` (only plain, one-choice calls continue),
  ``request_changed`` (the replacement's request body is not the cut call's: another
  conversation, seed or sampling setting would not continue the same generation).
- The continuation request per engine (:func:`continuation_body`): the partial assistant
  message with ``continue_final_message: true`` (vLLM also ``add_generation_prompt:
  false``; SGLang's request has no such field), ``max_tokens`` reduced by the prefix.
  The engine retokenizes the prefix text; the stitched record keeps the ids that were
  sampled.
- Stitching (:func:`stitch`): content, ids and logprobs are prefix + continuation, the
  prompt is the original call's, usage counts both; one call to the agent.

Does not own: proxying or the ledger (the model server and its call ledger), nor when a
snapshot is taken (the fence, through the model participant).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from rollpoint.protocol.ids import Identifier
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.token_data import (
    TokenSegment,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)

HEADER_TOKEN_SEGMENTS = "x-rollpoint-token-segments"
"""On a continued call's reply: ``version:count,version:count`` of its completion tokens."""

REFUSALS = (
    "constrained_decoding",
    "utf8_split",
    "tool_call",
    "reasoning",
    "engine_unsupported",
    "engine_refused",
    "digest_mismatch",
    "policy_newer",
    "max_tokens",
    "streamed_caller",
    "choices",
    "request_changed",
)

_CONSTRAINING_FIELDS = (
    # vLLM (chat_completion/protocol.py): structured_outputs, and the older guided_* fields.
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    # SGLang (openai/protocol.py): regex, ebnf; json_schema on its native API.
    "regex",
    "ebnf",
    "json_schema",
)
_CONTINUABLE_ENGINES = ("vllm", "sglang")
STREAMS_TOKEN_IDS = ("vllm",)
"""Engines whose chat stream carries token ids (``token_ids`` per chunk): only their calls
have a prefix to save. SGLang's OpenAI-compatible stream has none (its continuation
request is still built, for a prefix saved by a build that had them)."""


def segments_header(segments: list[TokenSegment]) -> str:
    return ",".join(f"{s.policy_version}:{s.tokens}" for s in segments)


def parse_segments_header(value: str | None) -> list[TokenSegment] | None:
    """The header's segments; None when absent or malformed (a call of one segment)."""
    if not value:
        return None
    out = []
    for part in value.split(","):
        version, _, count = part.partition(":")
        if not (version.isdigit() and count.isdigit()):
            return None
        out.append(TokenSegment(policy_version=int(version), tokens=int(count)))
    return out


class CallPrefix(StrictModel):
    """The frozen prefix of one call in flight at a snapshot, as the snapshot saves it."""

    format: Literal[1] = 1
    rollout_id: Identifier
    attempt: Annotated[int, Field(ge=0)]
    turn: Annotated[int, Field(ge=0)]
    engine: str
    text: str
    """The content received so far (the partial assistant message)."""
    completion_ids: str
    """Packed int32, as in :class:`~rollpoint.protocol.token_data.TokenTrace`."""
    completion_logprobs: str | None = None
    prompt_ids: str | None = None
    """The call's whole prompt, packed (None when the engine sent none)."""
    count: Annotated[int, Field(ge=1)]
    segments: Annotated[list[TokenSegment], Field(min_length=1)]
    utf8_complete: bool
    """False when the prefix's bytes end inside a UTF-8 character."""
    tool_call_started: bool = False
    reasoning_started: bool = False
    request_digest: str | None = None
    """BLAKE2b-128 of the cut call's request body: its replacement must send the same."""
    digest: str

    @property
    def policy_version(self) -> int:
        """The newest segment's version (the one the last prefix token was sampled under)."""
        return self.segments[-1].policy_version

    def ids(self) -> list[int]:
        return unpack_ids(self.completion_ids)

    def logprobs(self) -> list[float] | None:
        return None if self.completion_logprobs is None else unpack_floats(self.completion_logprobs)

    def prompt(self) -> list[int] | None:
        return None if self.prompt_ids is None else unpack_ids(self.prompt_ids)

    def digest_ok(self) -> bool:
        return self.digest == prefix_digest(
            self.engine,
            self.text,
            self.completion_ids,
            self.completion_logprobs,
            self.prompt_ids,
            self.segments,
            self.request_digest,
        )


def request_digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def prefix_digest(
    engine: str,
    text: str,
    ids: str,
    logprobs: str | None,
    prompt: str | None,
    segments: list[TokenSegment],
    request: str | None = None,
) -> str:
    h = hashlib.blake2b(digest_size=16)
    parts = [engine, text, ids, logprobs or "-", prompt or "-", segments_header(segments)]
    if request is not None:  # absent from prefixes saved before it was
        parts.append(request)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


@dataclass(slots=True)
class PartialCall:
    """What has arrived so far of one streamed call (see the module docstring)."""

    rollout_id: str
    attempt: int
    turn: int
    version: int
    base: list[TokenSegment] = field(default_factory=list)
    """Segments already in the lists when this call began (a continued call's prefix)."""
    ids: list[int] = field(default_factory=list)
    entries: list[Any] = field(default_factory=list)
    """The engine's ``logprobs.content`` entries, in order (synthetic for a prefix)."""
    text: list[str] = field(default_factory=list)
    prompt: list[int] | None = None
    """The call's own prompt: a continuation keeps its prefix's (the engine's holds the
    prefix too)."""
    tool_call_started: bool = False
    reasoning_started: bool = False
    saw_ids: bool = False
    saw_logprobs: bool = False
    request: str | None = None
    """The request body's digest (:func:`request_digest`)."""

    def feed(self, event: dict[str, Any]) -> None:
        if self.prompt is None and isinstance(event.get("prompt_token_ids"), list):
            self.prompt = event["prompt_token_ids"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.ids.extend(ids)
                self.saw_ids = True
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                self.entries.extend(logprobs["content"])
                self.saw_logprobs = True
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if isinstance(delta.get("content"), str):
                    self.text.append(delta["content"])
                if delta.get("tool_calls"):
                    self.tool_call_started = True
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.reasoning_started = True

    def clone_start(self) -> PartialCall:
        """A copy of this call as it stands before its stream (empty, or its prefix): the
        start a call aborted for a weight update is streamed again from."""
        return PartialCall(
            rollout_id=self.rollout_id,
            attempt=self.attempt,
            turn=self.turn,
            version=self.version,
            base=list(self.base),
            ids=list(self.ids),
            entries=list(self.entries),
            text=list(self.text),
            prompt=self.prompt,
            request=self.request,
        )

    def switch(self, version: int) -> None:
        """New weights are live from now on (``keep`` mode): the tokens received so far
        close a segment of the old version, the rest of the call samples under ``version``.
        A new list, not an append: a frozen partial keeps the segments it saw."""
        if version == self.version:
            return
        sampled = len(self.ids) - sum(s.tokens for s in self.base)
        if sampled > 0:
            self.base = [*self.base, TokenSegment(policy_version=self.version, tokens=sampled)]
        self.version = version

    def segments(self, count: int | None = None) -> list[TokenSegment]:
        """The version of each run of the first ``count`` tokens (default: all so far),
        segments without tokens left out."""
        n = len(self.ids) if count is None else count
        out = [s for s in self.base if s.tokens]
        done = sum(s.tokens for s in out)
        if n > done:
            out.append(TokenSegment(policy_version=self.version, tokens=n - done))
        return out

    def freeze(self) -> FrozenPartial:
        """O(1) in the tokens: the lengths now (the content is read from the same lists
        later) and the segments as they stand (a switch after the freeze is not in it)."""
        return FrozenPartial(
            self,
            len(self.ids),
            len(self.entries),
            len(self.text),
            self.tool_call_started,
            self.reasoning_started,
            self.base,
            self.version,
        )

    @classmethod
    def continuing(
        cls, prefix: CallPrefix, *, attempt: int, version: int, prompt: list[int] | None
    ) -> PartialCall:
        """The partial output of ``prefix``'s replacement call: the prefix, then what the
        continuation decodes (a snapshot during it saves both segments)."""
        ids = prefix.ids()
        logprobs = prefix.logprobs()
        return cls(
            rollout_id=prefix.rollout_id,
            attempt=attempt,
            turn=prefix.turn,
            version=version,
            base=list(prefix.segments),
            ids=ids,
            entries=[] if logprobs is None else prefix_entries(ids, logprobs),
            text=[prefix.text],
            prompt=prompt,
            request=prefix.request_digest,
        )


def prefix_entries(ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """``logprobs.content`` entries for saved prefix tokens: the sampled logprob, the id as
    vLLM spells it under ``return_tokens_as_token_ids`` (the text and top logprobs of a
    prefix token are not saved)."""
    return [
        {"token": f"token_id:{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
        for i, lp in zip(ids, logprobs, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class FrozenPartial:
    call: PartialCall
    n_ids: int
    n_entries: int
    n_text: int
    tool_call_started: bool
    reasoning_started: bool
    base: list[TokenSegment]
    version: int

    def prefix(self, engine: str) -> CallPrefix | None:
        """The saved form (after the pause, off the event loop); None with nothing to save."""
        call = self.call
        if self.n_ids == 0:
            return None
        ids = call.ids[: self.n_ids]
        entries = call.entries[: self.n_entries]
        logprobs = None
        if len(entries) == len(ids):
            try:
                logprobs = [float(e["logprob"]) for e in entries]
            except (TypeError, KeyError, ValueError):
                logprobs = None
        text = "".join(call.text[: self.n_text])
        segments = [s for s in self.base if s.tokens]
        done = sum(s.tokens for s in segments)
        if self.n_ids > done:
            segments.append(TokenSegment(policy_version=self.version, tokens=self.n_ids - done))
        packed_ids = pack_ids(ids)
        packed_lp = None if logprobs is None else pack_floats(logprobs)
        packed_prompt = None if call.prompt is None else pack_ids(call.prompt)
        digest = prefix_digest(
            engine, text, packed_ids, packed_lp, packed_prompt, segments, call.request
        )
        return CallPrefix(
            rollout_id=call.rollout_id,
            attempt=call.attempt,
            turn=call.turn,
            engine=engine,
            text=text,
            completion_ids=packed_ids,
            completion_logprobs=packed_lp,
            prompt_ids=packed_prompt,
            count=self.n_ids,
            segments=segments,
            utf8_complete=_utf8_complete(entries, text),
            tool_call_started=self.tool_call_started,
            reasoning_started=self.reasoning_started,
            request_digest=call.request,
            digest=digest,
        )


def _utf8_complete(entries: list[Any], text: str) -> bool:
    """Whether the prefix ends on a whole character: from the tokens' bytes when the engine
    sent them (a byte-level token may stop inside a character, and engines hold such text
    back or send U+FFFD), else from the text."""
    raw = bytearray()
    for entry in entries:
        piece = entry.get("bytes") if isinstance(entry, dict) else None
        if not isinstance(piece, list):
            return not text.endswith("\ufffd")
        raw.extend(piece)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not text.endswith("\ufffd")


def refusal(
    payload: dict[str, Any],
    prefix: CallPrefix,
    *,
    engine: str,
    enabled: bool,
    policy_version: int,
    request: str | None = None,
) -> str | None:
    """Why ``prefix`` must not be continued for this request (None: continue it);
    ``request``: the digest of the replacement's request body."""
    if not enabled or engine not in _CONTINUABLE_ENGINES:
        return "engine_unsupported"
    if payload.get("stream") is True:
        return "streamed_caller"
    if payload.get("n", 1) not in (1, None):
        return "choices"
    fmt = payload.get("response_format")
    choice = payload.get("tool_choice")
    if (
        (isinstance(fmt, dict) and fmt.get("type") not in (None, "text"))
        or isinstance(choice, dict)
        or choice == "required"
        or any(payload.get(k) is not None for k in _CONSTRAINING_FIELDS)
    ):
        return "constrained_decoding"
    if not prefix.digest_ok():
        return "digest_mismatch"
    if prefix.request_digest is not None and request != prefix.request_digest:
        return "request_changed"
    if prefix.policy_version > policy_version:
        return "policy_newer"
    if prefix.tool_call_started:
        return "tool_call"
    if prefix.reasoning_started:
        return "reasoning"
    if not prefix.utf8_complete:
        return "utf8_split"
    for key in ("max_tokens", "max_completion_tokens"):
        budget = payload.get(key)
        if isinstance(budget, int) and budget <= prefix.count:
            return "max_tokens"
    return None


def continuation_body(payload: dict[str, Any], prefix: CallPrefix, engine: str) -> dict[str, Any]:
    """The request that continues ``prefix``, streamed (see the module docstring)."""
    body = {
        **payload,
        "messages": [*payload["messages"], {"role": "assistant", "content": prefix.text}],
        "continue_final_message": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if engine == "vllm":
        body["add_generation_prompt"] = False
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] -= prefix.count
    return body


def stitch(reply: dict[str, Any], prefix: CallPrefix) -> dict[str, Any]:
    """The continuation's assembled reply with the prefix put back in front (in place)."""
    choice = reply["choices"][0]
    message = choice["message"]
    message["content"] = prefix.text + (message.get("content") or "")
    ids = prefix.ids()
    if isinstance(choice.get("token_ids"), list):
        choice["token_ids"] = [*ids, *choice["token_ids"]]
    logprobs = choice.get("logprobs")
    saved = prefix.logprobs()
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list) and saved:
        logprobs["content"] = [*prefix_entries(ids, saved), *logprobs["content"]]
    prompt = prefix.prompt()
    if prompt is not None and "prompt_token_ids" in reply:
        reply["prompt_token_ids"] = prompt
    usage = reply.get("usage")
    if isinstance(usage, dict):
        completion = usage.get("completion_tokens", 0) + prefix.count
        prompt_tokens = len(prompt) if prompt is not None else usage.get("prompt_tokens", 0)
        usage.update(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
        )
    return reply


@dataclass(slots=True)
class CutCounts:
    """How replacement calls went: continued (and the decode tokens it spared) or why not."""

    continued: int = 0
    continued_tokens: int = 0
    regenerated: dict[str, int] = field(default_factory=dict)

    def refused(self, reason: str) -> None:
        self.regenerated[reason] = self.regenerated.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "continued": self.continued,
            "continued_tokens": self.continued_tokens,
            "regenerated": dict(self.regenerated),
        }
