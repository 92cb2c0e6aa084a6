"""Filing a finished policy call: its reply read into a call ledger record.

Owns what one recorded call keeps (:class:`CallRecorder`): the request's length and last
message, choice 0's message as the agent keeps it (nulls dropped), its finish reason, usage,
policy version, latency and token segments, and its token data read by the engine adapter
and packed as a :class:`~rollpoint.protocol.token_data.TokenTrace` after the rollout's
earlier calls; the replies that file nothing (not a chat completion, malformed token data,
or neither content nor tool calls: a :class:`TransportError`, which a plain caller gets as a
502); and the token counts of the recorded calls, from the engine's usage.

Does not own: which calls are recorded (tagged ones whose attempt is not retired: the model
server decides), nor the ledger itself (:mod:`rollpoint.servers.model.call_ledger`).
"""

from __future__ import annotations

from typing import Any

import orjson

from rollpoint.policy.engine_adapters import EngineAdapter, EngineTokens, check_said
from rollpoint.protocol.errors import TransportError
from rollpoint.protocol.token_data import TokenSegment, TokenTrace
from rollpoint.servers.model.call_ledger import CallLedger, CallRecord
from rollpoint.servers.model.episode_tag import EpisodeTag
from rollpoint.servers.model.stream_assembler import clean_message


class CallRecorder:
    """Files the tagged calls of one model server in its call ledger."""

    def __init__(self, ledger: CallLedger, adapter: EngineAdapter, upstream_url: str) -> None:
        self.ledger = ledger
        self.upstream_url = upstream_url
        """Named by the refusal of a call that said nothing."""
        self._adapter = adapter
        self.prompt_tokens = 0
        self.completion_tokens = 0
        """Tokens of the recorded calls (those with episode headers), from the engine's usage."""

    def record_reply(
        self, tag: EpisodeTag, payload: dict[str, Any], raw: bytes, version: int, latency: float
    ) -> None:
        try:
            reply = orjson.loads(raw)
            choice = reply["choices"][0]
            message = clean_message(choice["message"])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            raise TransportError("upstream reply is not an OpenAI chat completion") from None
        # Malformed token data raises here: the call fails whole and nothing is filed.
        read = self._adapter.read(reply)
        self.record(
            tag,
            payload,
            message,
            choice.get("finish_reason"),
            reply.get("usage"),
            version=version,
            latency=latency,
            streamed=False,
            logprobs=choice.get("logprobs"),
            read=read,
            completion_id=reply.get("id"),
        )

    def record(
        self,
        tag: EpisodeTag,
        payload: dict[str, Any],
        message: dict[str, Any],
        finish: Any,
        usage: Any,
        *,
        version: int,
        latency: float,
        streamed: bool,
        logprobs: Any = None,
        read: EngineTokens | None = None,
        completion_id: Any = None,
        segments: list[TokenSegment] | None = None,
        continued_tokens: int = 0,
        regenerated: str | None = None,
    ) -> None:
        # Neither content nor tool calls: the call failed (502 to a plain caller, which
        # re-sends the row), and nothing is filed.
        check_said(message, f"upstream {self.upstream_url}")
        messages = payload["messages"]
        trace = None
        if read is not None:
            trace = TokenTrace.build(
                engine=self._adapter.name,
                completion_ids=read.completion_ids,
                completion_logprobs=read.logprobs,
                prompt_ids=read.prompt_ids,
                context=self.ledger.context_before(tag.rollout_id, tag.turn),
            )
            if read.logprobs is not None:
                logprobs = None  # the trace holds them, packed
        last = messages[-1] if messages and isinstance(messages[-1], dict) else None
        prompt, completion = _usage_tokens(usage)
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        # model_construct: the data is ours or the engine's, already parsed; validation
        # happens where records come back from disk (CallLedger.install).
        self.ledger.record(
            CallRecord.model_construct(
                rollout_id=tag.rollout_id,
                attempt=tag.attempt,
                turn=tag.turn,
                request_messages=len(messages),
                last_message=last,
                response=message,
                finish_reason=finish if isinstance(finish, str) else None,
                prompt_tokens=prompt,
                completion_tokens=completion,
                policy_version=version,
                latency_s=latency,
                streamed=streamed,
                logprobs=logprobs,
                completion_id=completion_id if isinstance(completion_id, str) else None,
                tokens=trace,
                segments=segments,
                continued_tokens=continued_tokens,
                regenerated=regenerated,
            )
        )


def _usage_tokens(usage: Any) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) else 0,
        completion if isinstance(completion, int) else 0,
    )
