"""Engine adapters: read the exact token ids and logprobs out of what real engines return.

Owns, per engine, the request fields that make it return token data
(:meth:`EngineAdapter.request_fields`), reading them from a whole reply
(:meth:`EngineAdapter.read`) and from a stream of chunks (:meth:`EngineAdapter.stream`),
and the checks on what was read: a reply whose token data is malformed (a non-integer or
negative id, logprobs and ids of different lengths) raises :class:`TransportError`
naming the field and the engine, so the call fails whole and nothing is stored half.
A reply with no token data at all reads as None (the engine cannot return ids); its
per-token logprobs and token strings, when it sent those, are read by
:func:`read_token_texts`.

The shapes, checked against the engines' sources (the fixtures under
``tests/fixtures/engines/`` say which file and commit each follows):

- ``vllm`` (``vllm/entrypoints/openai/chat_completion/protocol.py``): the request sets
  ``return_token_ids: true``; the reply has top-level ``prompt_token_ids`` and per-choice
  ``token_ids``; ``logprobs.content[]`` holds ``{token, logprob, bytes, top_logprobs}``,
  where ``token`` is ``"token_id:N"`` under ``return_tokens_as_token_ids`` (an older vLLM
  without ``token_ids`` still yields ids that way). Streamed: ``prompt_token_ids`` on a
  chunk (the first), ``token_ids`` and ``logprobs.content`` per chunk choice, in order.
- ``sglang`` (``python/sglang/srt/entrypoints/openai/protocol.py``): the request sets
  ``return_token_ids`` and ``return_prompt_token_ids``; the reply has per-choice
  ``prompt_token_ids`` and ``token_ids`` and OpenAI ``logprobs.content[]``. Its stream
  chunk choices carry no ids, so a streamed SGLang call reads as None.
- ``sglang_native`` (SGLang's ``/generate``): ``output_ids``, and with
  ``return_logprob`` ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]``
  triples (``meta_info.input_token_logprobs`` likewise for the prompt, when asked from
  position 0). A native stream's events are cumulative, so its last event is read whole.

Every engine, one rule on the message itself (:func:`check_said`): an assistant message
with neither content nor tool calls is no reply. It raises :class:`TransportError` (the call
failed; the dispatcher re-sends the row), so an empty reply the engine did not send is never
filed or trained on. An empty string is content: the engine said it.

Weight updates (:class:`EngineControl`, :func:`control_for`): each engine's own pause and
resume around a weight update, as recorded wire fixtures under
``tests/fixtures/engines/pause/`` (which file and commit each follows):

- ``vllm`` (``vllm/entrypoints/serve/dev/rlhf/api_router.py``, served with
  ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=keep|wait|abort`` (the mode a query
  parameter, no body) answers ``{"status": "paused"}``; ``POST /resume`` answers
  ``{"status": "resumed"}``. Both at the server's root, not under ``/v1``.
- ``sglang`` and ``sglang_native`` (``python/sglang/srt/managers/io_struct.py``,
  ``PauseGenerationReqInput`` and ``ContinueGenerationReqInput``): ``POST
  /pause_generation`` with ``{"mode": "in_place"}`` (our ``keep``) or ``{"mode":
  "abort"}``; ``POST /continue_generation`` with ``{}``. SGLang has no ``wait`` mode: the
  model server drains its calls instead (:meth:`EngineControl.pause` answers None).

Does not own: packing or chaining what was read (:mod:`rollpoint.protocol.token_data`), or
what to do with a call that has no token data (the caller's ``capture_tokens`` setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollpoint.protocol.errors import ConfigError, TransportError
from rollpoint.protocol.token_data import is_int32_id

EngineName = Literal["vllm", "sglang", "sglang_native"]
PauseMode = Literal["keep", "wait", "abort"]
"""How a weight update treats the calls in flight: ``keep`` freezes them and they go on
under the new weights (two segments); ``wait`` lets them finish first; ``abort`` ends them
(the model server sends them again once the new weights are live)."""
_TOKEN_ID_PREFIX = "token_id:"
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class EngineTokens:
    """One choice's token data as the engine returned it (checked, not packed)."""

    completion_ids: list[int]
    logprobs: list[float] | None
    prompt_ids: list[int] | None


def _bad(engine: str, field: str, what: str) -> TransportError:
    return TransportError(f"{engine} reply: {field} {what}")


def _ids(engine: str, field: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise _bad(engine, field, "is not a list of token ids")
    # The common case in one pass of builtins (a prompt is thousands of ids, every call);
    # the slow loop only runs to name the first bad item.
    if set(map(type, value)) <= {int} and (
        not value or (min(value) >= 0 and max(value) <= _INT32_MAX)
    ):
        return value
    for i, item in enumerate(value):
        if not is_int32_id(item):
            raise _bad(engine, f"{field}[{i}]", f"is not a token id: {item!r}")
    return value


def _logprob(engine: str, field: str, value: Any) -> float:
    if type(value) not in (int, float) or math.isnan(value) or value > 0:
        raise _bad(engine, field, f"is not a logprob: {value!r}")
    return float(value)


def _content(engine: str, field: str, logprobs: Any) -> list[Any] | None:
    """``logprobs.content`` of a choice, or None when the engine sent no logprobs."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, dict):
        raise _bad(engine, field, "is not an object")
    content = logprobs.get("content")
    if content is None:
        return None
    if not isinstance(content, list):
        raise _bad(engine, f"{field}.content", "is not a list")
    return content


def _content_logprobs(engine: str, field: str, content: list[Any]) -> list[float]:
    try:  # the common case in one pass; the loop below names the first bad entry
        fast = [entry["logprob"] for entry in content]
    except (TypeError, KeyError):
        fast = None
    # (NaN fails ``max(...) <= 0`` only when it is not first: test it on its own.)
    if (
        fast is not None
        and set(map(type, fast)) <= {float}
        and (not fast or (max(fast) <= 0 and not any(map(math.isnan, fast))))
    ):
        return fast
    out = []
    for i, entry in enumerate(content):
        if not isinstance(entry, dict):
            raise _bad(engine, f"{field}[{i}]", "is not an object")
        out.append(_logprob(engine, f"{field}[{i}].logprob", entry.get("logprob")))
    return out


def _ids_from_tokens(engine: str, field: str, content: list[Any]) -> list[int] | None:
    """Ids spelled ``token_id:N`` in the tokens (``return_tokens_as_token_ids``), else None."""
    ids = []
    for i, entry in enumerate(content):
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
            return None
        digits = token[len(_TOKEN_ID_PREFIX) :]
        if not digits.isdigit() or not is_int32_id(int(digits)):
            raise _bad(engine, f"{field}[{i}].token", f"is not a token id: {token!r}")
        ids.append(int(digits))
    return ids


def _checked(
    engine: str, field: str, ids: list[int], logprobs: list[float] | None
) -> list[float] | None:
    if logprobs is not None and len(logprobs) != len(ids):
        raise _bad(
            engine,
            f"{field}.logprobs.content",
            f"has {len(logprobs)} entries for {len(ids)} token ids",
        )
    return logprobs


def _choice(engine: str, reply: Any, index: int) -> dict[str, Any]:
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) <= index:
        raise _bad(engine, "choices", f"has no choice {index}")
    choice = choices[index]
    if not isinstance(choice, dict):
        raise _bad(engine, f"choices[{index}]", "is not an object")
    return choice


def read_token_texts(engine: str, reply: Any) -> tuple[list[str], list[float]] | None:
    """Choice 0's token strings and logprobs from OpenAI ``logprobs.content`` (every
    OpenAI-compatible engine's shape), for a reply without ids; None when it has none.
    Malformed entries raise :class:`TransportError` naming the field, as ids do."""
    field = "choices[0].logprobs"
    content = _content(engine, field, _choice(engine, reply, 0).get("logprobs"))
    if content is None:
        return None
    logprobs = _content_logprobs(engine, f"{field}.content", content)
    tokens = []
    for i, entry in enumerate(content):
        token = entry.get("token")
        if not isinstance(token, str):
            raise _bad(engine, f"{field}.content[{i}].token", f"is not a string: {token!r}")
        tokens.append(token)
    return tokens, logprobs


def check_said(message: dict[str, Any], where: str) -> None:
    """Raise :class:`TransportError` when ``message`` (an assistant message, nulls kept or
    dropped) has neither content nor tool calls (see the module docstring)."""
    if message.get("content") is None and not message.get("tool_calls"):
        raise TransportError(f"{where}: the policy's reply has neither content nor tool calls")


class TokenStream(Protocol):
    """Reads one choice's token data from the parsed events of a stream, in order."""

    def feed(self, event: dict[str, Any]) -> None: ...

    def result(self) -> EngineTokens | None: ...


class EngineAdapter(Protocol):
    name: str

    def request_fields(self) -> dict[str, Any]:
        """What a chat completion request adds so the engine returns token data."""
        ...

    def read(self, reply: Any, index: int = 0) -> EngineTokens | None:
        """Choice ``index``'s token data; None when the reply has none."""
        ...

    def stream(self, index: int = 0) -> TokenStream: ...


class VllmAdapter:
    name = "vllm"

    def request_fields(self) -> dict[str, Any]:
        return {"return_token_ids": True, "logprobs": True}

    def read(self, reply: Any, index: int = 0) -> EngineTokens | None:
        choice = _choice(self.name, reply, index)
        field = f"choices[{index}]"
        return self._tokens(
            field,
            choice.get("token_ids"),
            _content(self.name, f"{field}.logprobs", choice.get("logprobs")),
            reply.get("prompt_token_ids"),
        )

    def _tokens(
        self, field: str, raw_ids: Any, content: list[Any] | None, raw_prompt: Any
    ) -> EngineTokens | None:
        where = f"{field}.logprobs.content"
        if raw_ids is not None:
            ids = _ids(self.name, f"{field}.token_ids", raw_ids)
        elif content is not None:
            found = _ids_from_tokens(self.name, where, content)
            if found is None:
                return None
            ids = found
        else:
            return None
        logprobs = None if content is None else _content_logprobs(self.name, where, content)
        prompt = None
        if raw_prompt is not None:
            prompt = _ids(self.name, "prompt_token_ids", raw_prompt)
        return EngineTokens(ids, _checked(self.name, field, ids, logprobs), prompt)

    def stream(self, index: int = 0) -> TokenStream:
        return _VllmStream(self, index)


class _VllmStream:
    def __init__(self, adapter: VllmAdapter, index: int) -> None:
        self._adapter = adapter
        self._index = index
        self._ids: list[Any] | None = None
        self._content: list[Any] | None = None
        self._prompt: Any = None

    def feed(self, event: dict[str, Any]) -> None:
        engine = self._adapter.name
        if event.get("prompt_token_ids") is not None:
            self._prompt = event["prompt_token_ids"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != self._index:
                continue
            ids = choice.get("token_ids")
            if ids is not None:
                if not isinstance(ids, list):
                    raise _bad(engine, f"chunk choices[{self._index}].token_ids", "is not a list")
                self._ids = [*(self._ids or ()), *ids]
            content = _content(
                engine, f"chunk choices[{self._index}].logprobs", choice.get("logprobs")
            )
            if content is not None:
                self._content = [*(self._content or ()), *content]

    def result(self) -> EngineTokens | None:
        return self._adapter._tokens(
            f"choices[{self._index}]", self._ids, self._content, self._prompt
        )


class SglangAdapter:
    """SGLang's OpenAI-compatible server: ids on the choice, plain OpenAI logprobs."""

    name = "sglang"

    def request_fields(self) -> dict[str, Any]:
        return {"return_token_ids": True, "return_prompt_token_ids": True, "logprobs": True}

    def read(self, reply: Any, index: int = 0) -> EngineTokens | None:
        choice = _choice(self.name, reply, index)
        field = f"choices[{index}]"
        raw_ids = choice.get("token_ids")
        if raw_ids is None:
            return None
        ids = _ids(self.name, f"{field}.token_ids", raw_ids)
        content = _content(self.name, f"{field}.logprobs", choice.get("logprobs"))
        where = f"{field}.logprobs.content"
        logprobs = None if content is None else _content_logprobs(self.name, where, content)
        raw_prompt = choice.get("prompt_token_ids")
        prompt = None
        if raw_prompt is not None:
            prompt = _ids(self.name, f"{field}.prompt_token_ids", raw_prompt)
        return EngineTokens(ids, _checked(self.name, field, ids, logprobs), prompt)

    def stream(self, index: int = 0) -> TokenStream:
        return _NoIds()


class _NoIds:
    def feed(self, event: dict[str, Any]) -> None:
        return None

    def result(self) -> EngineTokens | None:
        return None


class SglangNativeAdapter:
    """SGLang's native ``/generate``: ``output_ids`` and ``meta_info`` logprob triples."""

    name = "sglang_native"

    def request_fields(self) -> dict[str, Any]:
        return {"return_logprob": True}

    def read(self, reply: Any, index: int = 0) -> EngineTokens | None:
        if isinstance(reply, list):  # a batch of prompts answers a list
            if len(reply) <= index:
                raise _bad(self.name, "reply", f"has no item {index}")
            reply = reply[index]
        if not isinstance(reply, dict):
            raise _bad(self.name, "reply", "is not an object")
        meta = reply.get("meta_info")
        meta = meta if isinstance(meta, dict) else {}
        triples = meta.get("output_token_logprobs")
        raw_ids = reply.get("output_ids")
        if raw_ids is None and triples is None:
            return None
        logprobs = None
        triple_ids = None
        if triples is not None:
            triple_ids, logprobs = self._triples("meta_info.output_token_logprobs", triples)
        if raw_ids is not None:
            ids = _ids(self.name, "output_ids", raw_ids)
            if triple_ids is not None and triple_ids != ids:
                raise _bad(
                    self.name, "meta_info.output_token_logprobs", "names other ids than output_ids"
                )
        else:
            assert triple_ids is not None
            ids = triple_ids
        prompt = None
        if meta.get("input_token_logprobs") is not None:
            prompt, _ = self._triples(
                "meta_info.input_token_logprobs", meta["input_token_logprobs"], prompt=True
            )
        return EngineTokens(ids, _checked(self.name, "meta_info", ids, logprobs), prompt)

    def _triples(
        self, field: str, triples: Any, *, prompt: bool = False
    ) -> tuple[list[int], list[float]]:
        if not isinstance(triples, list):
            raise _bad(self.name, field, "is not a list")
        ids, logprobs = [], []
        for i, triple in enumerate(triples):
            if not isinstance(triple, list) or len(triple) < 2:
                raise _bad(self.name, f"{field}[{i}]", "is not a [logprob, token_id, text] triple")
            if not is_int32_id(triple[1]):
                raise _bad(self.name, f"{field}[{i}][1]", f"is not a token id: {triple[1]!r}")
            ids.append(triple[1])
            # The first prompt position has no logprob (None): nothing precedes it.
            if not (prompt and triple[0] is None):
                logprobs.append(_logprob(self.name, f"{field}[{i}][0]", triple[0]))
        return ids, logprobs

    def stream(self, index: int = 0) -> TokenStream:
        return _LastEvent(self, index)


class _LastEvent:
    def __init__(self, adapter: SglangNativeAdapter, index: int) -> None:
        self._adapter = adapter
        self._index = index
        self._last: Any = None

    def feed(self, event: dict[str, Any]) -> None:
        self._last = event

    def result(self) -> EngineTokens | None:
        return None if self._last is None else self._adapter.read(self._last, self._index)


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One control request to the engine: ``POST`` to ``path`` under its root URL."""

    path: str
    params: dict[str, str]
    body: dict[str, Any] | None


class EngineControl(Protocol):
    name: str

    def pause(self, mode: PauseMode) -> EngineCall | None:
        """The request that pauses the engine in ``mode``; None when it has no such mode
        (the caller drains its calls instead)."""
        ...

    def resume(self) -> EngineCall: ...


class VllmControl:
    name = "vllm"

    def pause(self, mode: PauseMode) -> EngineCall | None:
        return EngineCall("/pause", {"mode": mode}, None)

    def resume(self) -> EngineCall:
        return EngineCall("/resume", {}, None)


class SglangControl:
    _MODES: dict[str, str] = {"keep": "in_place", "abort": "abort"}

    def __init__(self, name: str) -> None:
        self.name = name

    def pause(self, mode: PauseMode) -> EngineCall | None:
        sglang_mode = self._MODES.get(mode)
        if sglang_mode is None:
            return None
        return EngineCall("/pause_generation", {}, {"mode": sglang_mode})

    def resume(self) -> EngineCall:
        return EngineCall("/continue_generation", {}, {})


CONTROLS: dict[str, EngineControl] = {
    c.name: c for c in (VllmControl(), SglangControl("sglang"), SglangControl("sglang_native"))
}


def control_for(engine: str) -> EngineControl:
    try:
        return CONTROLS[engine]
    except KeyError:
        known = ", ".join(sorted(CONTROLS))
        raise ConfigError(f"unknown engine {engine!r}; known engines: {known}") from None


ADAPTERS: dict[str, EngineAdapter] = {
    a.name: a for a in (VllmAdapter(), SglangAdapter(), SglangNativeAdapter())
}


def adapter_for(engine: str) -> EngineAdapter:
    try:
        return ADAPTERS[engine]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS))
        raise ConfigError(f"unknown engine {engine!r}; known engines: {known}") from None
