"""The start check of the policy engine: what it gives, and what the run does with that.

Owns, once per run at start (with ``policy.capture_tokens``), asking the engine for one
token and deciding from its answers:

- **token capture**: whether its plain reply carries token ids (read by the adapter of
  ``policy.engine``). None when it did not answer in time or at all: nothing is known, so
  capture stays on (a call whose reply has none is stored without).
- **the generation cut**: whether a call in flight at a snapshot can be cut and continued
  token-exactly after a restore. That needs the engine's *stream* to carry token ids (the
  prefix saved is ids, not text) and an engine that continues a partial assistant message
  (``continue_final_message``): vLLM's OpenAI-compatible server does both; SGLang's stream
  carries no ids; an engine that returns no ids at all (llama.cpp's server, most hosted
  APIs) gives nothing to continue from. Where the cut cannot be exact it is off: a call in
  flight at a snapshot is not cut, it runs to its end (the snapshot does not stop it), and
  after a crash it is decoded again from its start.

What was found is said once, by engine name and URL, in one warning line (the log, and the
console through the CLI's handler); ``required`` on either setting turns that line into a
:class:`LaunchError` instead.

Does not own: reading token data out of replies (:mod:`rollpoint.policy.engine_adapters`),
nor the cut itself (:mod:`rollpoint.servers.model.generation_cut`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from rollpoint.http.client import HttpClient
from rollpoint.policy.engine_adapters import EngineAdapter, adapter_for
from rollpoint.protocol.errors import LaunchError, RollpointError, TransportError

log = logging.getLogger(__name__)

START_CHECK_TIMEOUT_S = 30.0
"""How long the start check waits for the engine's answer to each one-token call."""

CONTINUES_PARTIAL_MESSAGES = ("vllm", "sglang")
"""Engines whose chat API continues a partial assistant message (``continue_final_message``)."""

Setting = bool | Literal["required"]


@dataclass(frozen=True, slots=True)
class EngineCheck:
    """What the start check found, and the decision on the generation cut."""

    ids: bool | None
    """The plain reply carries token ids (None: not checked, no answer)."""
    cut: bool
    """The model servers stream and cut calls: the cut can be exact (or was not checked)."""


START_CHECK_PROMPT = [{"role": "user", "content": "Say OK."}]
"""The start check's one-token probe (the scripted policy's faults never count it)."""


async def check_engine(
    base_url: str,
    *,
    engine: str,
    model: str,
    api_key: str | None,
    capture: Setting,
    cut: Setting,
    timeout_s: float = START_CHECK_TIMEOUT_S,
) -> EngineCheck:
    """Ask the engine (see the module docstring); ``capture`` and ``cut`` are
    ``policy.capture_tokens`` and ``policy.generation_cut`` (the cut only with capture)."""
    adapter = adapter_for(engine)
    cut_on = bool(capture) and bool(cut)
    where = f"policy engine '{engine}' at {base_url}"
    async with HttpClient(token=api_key, timeout_s=timeout_s, connect_timeout_s=5) as client:
        body = {
            "model": model,
            "messages": START_CHECK_PROMPT,
            "max_tokens": 1,
            **adapter.request_fields(),
        }
        try:
            ids, why = await _plain_ids(client, base_url, adapter, body)
        except TransportError as exc:  # no answer: nothing is known about its token data
            text = f"could not check whether {where} returns token ids ({exc.message})"
            _refuse_if(capture == "required", text, "capture_tokens")
            _refuse_if(cut_on and cut == "required", text, "generation_cut")
            _warn(f"{text}; token capture stays on")
            return EngineCheck(ids=None, cut=cut_on)
        if not ids:
            text = f"{where} returns no token ids{why}"
            _refuse_if(capture == "required", text, "capture_tokens")
            _refuse_if(cut_on and cut == "required", text, "generation_cut")
            off = f", and without the generation cut ({_UNCUT})" if cut_on else ""
            _warn(f"{text}; the run goes on without token data{off}")
            return EngineCheck(ids=False, cut=False)
        if not cut_on:
            return EngineCheck(ids=True, cut=False)
        if engine not in CONTINUES_PARTIAL_MESSAGES:
            why = "it cannot continue a partial assistant message"
        else:
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            try:
                streamed = await _stream_ids(client, base_url, api_key, adapter, stream)
            except RollpointError as exc:
                streamed, why = False, f"its streamed reply failed: {exc.message}"
            else:
                why = "its stream carries no token ids"
            if streamed:
                return EngineCheck(ids=True, cut=True)
    text = f"{where} cannot continue a cut generation token-exactly ({why})"
    _refuse_if(cut == "required", text, "generation_cut")
    _warn(f"{text}; the generation cut is off: {_UNCUT}")
    return EngineCheck(ids=True, cut=False)


_UNCUT = "a call in flight at a snapshot runs to its end, and is decoded again after a restore"


async def check_token_capture(
    base_url: str,
    *,
    engine: str,
    model: str,
    api_key: str | None,
    required: bool,
    timeout_s: float = START_CHECK_TIMEOUT_S,
) -> bool | None:
    """Token capture's half of :func:`check_engine`: whether the engine returns ids."""
    found = await check_engine(
        base_url,
        engine=engine,
        model=model,
        api_key=api_key,
        capture="required" if required else True,
        cut=False,
        timeout_s=timeout_s,
    )
    return found.ids


async def _plain_ids(
    client: HttpClient, base_url: str, adapter: EngineAdapter, body: dict[str, Any]
) -> tuple[bool, str]:
    """Whether the plain reply has ids, and why not (raises TransportError: no answer)."""
    try:
        reply = await client.post_json(f"{base_url}/chat/completions", body)
    except TransportError:
        raise
    except RollpointError as exc:  # an answer: an error instead of the token data
        return False, f": {exc.message}"
    try:
        return adapter.read(reply) is not None, ""
    except RollpointError as exc:
        return False, f": {exc.message}"


async def _stream_ids(
    client: HttpClient,
    base_url: str,
    api_key: str | None,
    adapter: EngineAdapter,
    body: dict[str, Any],
) -> bool:
    """Whether the streamed reply's chunks carry token ids."""
    url = f"{base_url}/chat/completions"
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    try:
        async with client.session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            raw = await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise TransportError(f"POST {url}: {type(exc).__name__}: {exc}") from None
    if status >= 400:
        raise TransportError(f"HTTP {status}: {raw[:200].decode(errors='replace')}")
    reader = adapter.stream()
    for line in raw.splitlines():
        data = line.strip()
        if not data.startswith(b"data:") or data[5:].strip() in (b"", b"[DONE]"):
            continue
        try:
            event = orjson.loads(data[5:])
        except orjson.JSONDecodeError:
            return False
        if isinstance(event, dict):
            reader.feed(event)
    return reader.result() is not None


def _refuse_if(required: bool, text: str, key: str) -> None:
    if required:
        raise LaunchError(f"{text}; policy.{key} is 'required'")


def _warn(text: str) -> None:
    # Once: the log, and the console through the CLI's handler of library warnings (a
    # print as well showed the line twice there).
    log.warning(text)
