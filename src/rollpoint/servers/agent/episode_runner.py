"""The agent loop of one episode: policy call → tool calls → … → verify.

Owns: the HTTP conversation of one session with the model server (OpenAI chat completions
carrying the episode headers and a seed derived from the rollout id) and the resources
server (start, tools, verify), the tool list (fetched once per app), and where the turn
boundaries of an episode are. At each boundary it awaits the book's ``boundary`` (which
parks the session while a checkpoint is open)::

    start ─▶ ┌▶ boundary ─▶ pending tool calls? ─▶ apply them (running_tools) ──┐
             │      │       pending final answer? ─▶ verify ("final")          │
             │      │       turn == max_turns?    ─▶ verify ("max_turns")      │
             │      └─────▶ policy call (awaiting_model) → pending response ───┤
             └─────────────────────────────────────────────────────────────────┘

A policy reply that arrives while a checkpoint is cut is held unapplied until the cut
reopens (``boundary.hold_reply``), so the session is saved as before that call. Every
policy response is *pending* until the next boundary has passed: a session parked with
one is saved with it unapplied, and its tool calls are applied after the restore, under
the same idempotency keys ``(rollout_id, turn, call_index)``.

Does not own: sessions, parking, or what a failure means for the row (the book turns
errors into :class:`~rollpoint.protocol.episode.RowFailure`): a peer that is down, times
out or answers off-protocol raises :class:`TransportError`, and so does a policy reply with
neither content nor tool calls (never a turn of the transcript), and a resources server
that no longer knows an episode this agent started there (it lost its state: restarted
empty); a refusal about the data (422) raises the peer's :class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from rollpoint.agent_loops import AgentLoop
from rollpoint.http.client import HttpClient
from rollpoint.policy.engine_adapters import (
    EngineAdapter,
    adapter_for,
    check_said,
    read_token_texts,
)
from rollpoint.protocol.episode import (
    EpisodeStart,
    ModelCall,
    RunReply,
    ToolCall,
    ToolResult,
    VerifyReply,
    VerifyRequest,
)
from rollpoint.protocol.errors import ConfigError, NotFoundError, TransportError
from rollpoint.protocol.ids import (
    HEADER_ATTEMPT,
    HEADER_POLICY_VERSION,
    HEADER_ROLLOUT_ID,
    HEADER_TURN,
)
from rollpoint.protocol.token_data import TokenTexts, TokenTrace, context_after
from rollpoint.servers.agent.play_contract import TurnBoundary
from rollpoint.servers.agent.session import Session, SessionState
from rollpoint.servers.model.generation_cut import HEADER_TOKEN_SEGMENTS, parse_segments_header

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def episode_seed(rollout_id: str) -> int:
    """The sampling seed of an episode: stable across attempts, processes and machines."""
    digest = hashlib.blake2b(rollout_id.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def turn_seed(rollout_id: str, turn: int) -> int:
    """The sampling seed of one turn of an episode (``policy.sampling.seed: turn``)."""
    digest = hashlib.blake2b(f"{rollout_id}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


_M = TypeVar("_M", bound=BaseModel)


def _parse(model: type[_M], reply: Any, peer: str) -> _M:
    try:
        return model.model_validate(reply)
    except ValidationError:
        raise TransportError(f"{peer}: reply is not a {model.__name__}") from None


def _assistant_message(reply: Any, url: str) -> dict[str, Any]:
    try:
        message = reply["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise TransportError(f"{url}: reply is not an OpenAI chat completion") from None
    if not isinstance(message, dict):
        raise TransportError(f"{url}: choice 0 has no message object")
    # Engines pad messages with nulls; keep role and content, drop the other empty keys.
    cleaned = {k: v for k, v in message.items() if v is not None}
    cleaned.setdefault("role", "assistant")
    cleaned.setdefault("content", None)
    # Neither content nor tool calls: a failed call (re-sent), never a turn of the transcript.
    check_said(cleaned, url)
    return cleaned


def held_calls(session: Session) -> list[tuple[int, int]]:
    """The ``(turn, call_index)`` keys of the tool calls the resources server answered for
    ``session`` so far: every call of each turn whose tools were applied, but those with a
    name no route takes (answered here, :meth:`EpisodeRunner._tool_call`)."""
    applied = session.turn - (1 if session.pending_response is not None else 0)
    held = []
    for call in session.model_calls:
        if call.turn >= applied:
            continue
        for index, tool_call in enumerate(_tool_calls(call.response)):
            fn = tool_call.get("function") if isinstance(tool_call, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if isinstance(name, str) and _TOOL_NAME.match(name):
                held.append((call.turn, index))
    return held


def _tool_calls(message: dict[str, Any]) -> list[Any]:
    calls = message.get("tool_calls")
    return calls if isinstance(calls, list) else []


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


class EpisodeRunner:
    """Plays sessions against one model server and one resources server."""

    def __init__(
        self,
        client: HttpClient,
        *,
        model_url: str,
        resources_url: str,
        environment: str,
        model_name: str,
        model_timeout_s: float,
        tool_timeout_s: float,
        sampling: dict[str, Any] | None = None,
        seed_policy: Literal["episode", "turn", "none"] = "episode",
        engine: str | None = None,
        loop: AgentLoop | None = None,
    ) -> None:
        """``sampling``: fields every policy call carries; ``engine``: the adapter whose
        token data to request and keep (None: no token capture)."""
        self._client = client
        self._completions_url = f"{model_url.rstrip('/')}/v1/chat/completions"
        self._resources = resources_url.rstrip("/")
        self._environment = environment
        self._model_name = model_name
        self._model_timeout_s = model_timeout_s
        self._tool_timeout_s = tool_timeout_s
        self._tools: asyncio.Task[list[Any]] | None = None
        self._seed_policy = seed_policy
        self._adapter: EngineAdapter | None = None if engine is None else adapter_for(engine)
        # Built once: the sampling settings, then what the adapter needs to return ids.
        self._fixed: dict[str, Any] = dict(sampling or {})
        if self._adapter is not None:
            self._fixed.update(self._adapter.request_fields())
            # llama.cpp's server returns logprobs only when top_logprobs is set (0 is the
            # OpenAI default, so other engines answer as without it).
            self._fixed.setdefault("top_logprobs", 0)
        self._loop = loop

    async def play(self, session: Session, boundary: TurnBoundary) -> RunReply:
        await self._start(session)
        tools = await self.tools()
        while True:
            await boundary(session)
            pending = session.pending_response
            if pending is not None:
                if not _tool_calls(pending):
                    return await self._verify(session, "final")
                session.move(SessionState.RUNNING_TOOLS)
                await self._apply_tools(session, pending)
                continue
            if session.turn >= session.row.max_turns:
                return await self._verify(session, "max_turns")
            session.move(SessionState.AWAITING_MODEL)
            session.pending_response = await self._policy_call(session, tools, boundary)

    async def tools(self) -> list[Any]:
        """The environment's tool specs, fetched once per app (again after a failed fetch)."""
        if self._tools is None:
            self._tools = asyncio.ensure_future(self._fetch_tools())
        task = self._tools
        try:
            return await asyncio.shield(task)
        except BaseException:
            if task.done() and (task.cancelled() or task.exception() is not None):
                self._tools = None
            raise

    async def aclose(self) -> None:
        """Stop a tool fetch still in flight (app shutdown)."""
        if self._tools is not None and not self._tools.done():
            self._tools.cancel()
            await asyncio.gather(self._tools, return_exceptions=True)

    async def _fetch_tools(self) -> list[Any]:
        url = f"{self._resources}/tools"
        reply = await self._client.get_json(url, timeout_s=self._tool_timeout_s)
        if not isinstance(reply, dict) or not isinstance(reply.get("tools"), list):
            raise TransportError(f"{url}: reply has no 'tools' list")
        if reply.get("environment") != self._environment:
            raise ConfigError(
                f"{url} serves environment {reply.get('environment')!r}, "
                f"this agent plays {self._environment!r}"
            )
        tools: list[Any] = reply["tools"]
        return tools

    async def _start(self, session: Session) -> None:
        body = EpisodeStart(
            episode=session.episode, task=session.row.task, held_calls=held_calls(session)
        )
        await self._client.post_json(
            f"{self._resources}/episodes/start",
            body.model_dump(mode="json"),
            timeout_s=self._tool_timeout_s,
        )

    async def _policy_call(
        self, session: Session, tools: list[Any], boundary: TurnBoundary
    ) -> dict[str, Any]:
        episode = session.episode
        messages: list[dict[str, Any]] = session.messages
        loop_state = session.loop_state
        if self._loop is not None:
            messages, loop_state = self._loop.prompt(loop_state, messages, session.turn)
        body: dict[str, Any] = {
            **self._fixed,
            "model": self._model_name,
            "messages": messages,
        }
        if self._seed_policy == "episode":
            body["seed"] = episode_seed(episode.rollout_id)
        elif self._seed_policy == "turn":
            body["seed"] = turn_seed(episode.rollout_id, session.turn)
        if tools:
            body["tools"] = tools
        headers = {
            HEADER_ROLLOUT_ID: episode.rollout_id,
            HEADER_ATTEMPT: str(episode.attempt),
            HEADER_TURN: str(session.turn),
        }
        started = time.perf_counter()
        reply, reply_headers = await self._client.request_json_with_headers(
            "POST",
            self._completions_url,
            body=body,
            headers=headers,
            timeout_s=self._model_timeout_s,
        )
        latency = time.perf_counter() - started
        # A reply that lands while a checkpoint is cut waits unapplied: the cut saves this
        # session as before the call, so it never has to wait for a generation.
        await boundary.hold_reply(session)
        message = _assistant_message(reply, self._completions_url)
        # Read (and checked) before anything is kept: malformed token data fails the call.
        tokens = self._tokens(session, reply)
        texts = self._token_texts(reply) if tokens is None else None
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        version = reply_headers.get(HEADER_POLICY_VERSION, "0")
        completion_id = reply.get("id")
        finish = reply["choices"][0].get("finish_reason")
        session.add_model_call(
            ModelCall(
                turn=session.turn,
                attempt=episode.attempt,
                response=message,
                prompt_tokens=_int(usage.get("prompt_tokens")),
                completion_tokens=_int(usage.get("completion_tokens")),
                policy_version=int(version) if version.isdigit() else 0,
                latency_s=latency,
                completion_id=completion_id if isinstance(completion_id, str) else None,
                finish_reason=finish if isinstance(finish, str) else None,
                tokens=tokens,
                segments=parse_segments_header(reply_headers.get(HEADER_TOKEN_SEGMENTS)),
                token_texts=texts,
            )
        )
        session.add_message(message)
        if self._loop is not None:
            session.loop_state = loop_state  # kept with the reply: the turn boundary
        session.turn += 1
        return message

    def _tokens(self, session: Session, reply: Any) -> TokenTrace | None:
        """The token trace of choice 0, chained on the episode's earlier calls; None without
        capture or when the engine sent no token data."""
        if self._adapter is None:
            return None
        read = self._adapter.read(reply)
        if read is None:
            return None
        return TokenTrace.build(
            engine=self._adapter.name,
            completion_ids=read.completion_ids,
            completion_logprobs=read.logprobs,
            prompt_ids=read.prompt_ids,
            context=context_after(call.tokens for call in session.model_calls),
        )

    def _token_texts(self, reply: Any) -> TokenTexts | None:
        """Without ids: the engine's token strings and logprobs, when it sent them."""
        if self._adapter is None:
            return None
        read = read_token_texts(self._adapter.name, reply)
        if read is None:
            return None
        return TokenTexts.build(engine=self._adapter.name, tokens=read[0], logprobs=read[1])

    async def _apply_tools(self, session: Session, message: dict[str, Any]) -> None:
        turn = session.turn - 1  # the pending response belongs to the last policy call
        for index, call in enumerate(_tool_calls(message)):
            content = await self._tool_call(session, turn, index, call)
            call_id = call.get("id") if isinstance(call, dict) else None
            session.add_message(
                {
                    "role": "tool",
                    "tool_call_id": call_id if isinstance(call_id, str) else f"call_{turn}_{index}",
                    "content": content,
                }
            )
        session.pending_response = None

    async def _tool_call(self, session: Session, turn: int, index: int, call: Any) -> str:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            # The model's mistake, answered to the model: never a URL we cannot route.
            return f"error: no such tool: {name!r}"
        assert isinstance(fn, dict)
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):
            arguments = "{}" if arguments is None else str(arguments)
        url = f"{self._resources}/tools/{name}"
        body = ToolCall(episode=session.episode, turn=turn, call_index=index, arguments=arguments)
        reply = await self._episode_call(session, url, body)
        result = _parse(ToolResult, reply, url)
        if result.is_error and not result.content.lower().startswith("error"):
            # Tool errors reach the model marked as such, as real agent loops do; the
            # policy retries a step only when it sees the mark.
            return f"error: {result.content}"
        return result.content

    async def _episode_call(self, session: Session, url: str, body: BaseModel) -> Any:
        """A resources call about an episode this agent started there. One the server no
        longer knows (404) means the server lost its state: restarted empty on the same
        address, as a container behind a stable service address is. The episode cannot go
        on there, through no fault of its row: a transport failure (the trainer re-sends
        the row fresh), not a data failure that would fail the whole group."""
        try:
            return await self._client.post_json(
                url, body.model_dump(mode="json"), timeout_s=self._tool_timeout_s
            )
        except NotFoundError as exc:
            raise TransportError(
                f"{url}: the resources server no longer has episode {session.episode.key}, "
                f"which this agent started there: it lost its state ({exc.message})"
            ) from None

    async def _verify(
        self, session: Session, finish_reason: Literal["final", "max_turns"]
    ) -> RunReply:
        session.move(SessionState.VERIFYING)
        pending = session.pending_response
        final = pending.get("content") if pending is not None else None
        url = f"{self._resources}/episodes/verify"
        body = VerifyRequest(
            episode=session.episode, final_message=final if isinstance(final, str) else None
        )
        reply = await self._episode_call(session, url, body)
        verdict = _parse(VerifyReply, reply, url)
        session.pending_response = None
        row = session.row
        return RunReply(
            episode=session.episode,
            task_id=row.task.task_id,
            group_id=row.group_id,
            row=row.row,
            reward=verdict.reward,
            messages=session.messages,
            model_calls=session.model_calls,
            turns=session.turn,
            finish_reason=finish_reason,
        )
