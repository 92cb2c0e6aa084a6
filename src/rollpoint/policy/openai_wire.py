"""Pydantic models of the OpenAI chat-completions shapes the scripted policy reads and emits.

Owns: the request we read (:class:`ChatCompletionRequest` and its parts, lenient
:class:`OpenModel` so any field a client adds is accepted and kept), and the concrete shapes we
emit (:class:`ChatCompletion`, :class:`ChatCompletionChunk`, :class:`ModelList`), which follow
OpenAI's wire format field for field: an assistant message that calls a tool has
``content: null`` and ``tool_calls: [{id, type: "function", function: {name, arguments}}]``
where ``arguments`` is a JSON *string*; stream deltas carry only the fields they set.

Does not own: deciding what to answer (:mod:`rollpoint.policy.playbook`) or the HTTP routes
(:mod:`rollpoint.policy.scripted_policy`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from rollpoint.protocol.model_base import OpenModel, StrictModel

FinishReason = Literal["stop", "tool_calls", "length"]

# Deltas omit what they do not set, as OpenAI's stream does; a full message keeps its nulls.
_OMIT_NONE: Any = Field(default=None, exclude_if=lambda v: v is None)

# ---------------------------------------------------------------------------------------------
# What we read


class ContentPart(OpenModel):
    """One part of a multi-part message content; only ``text`` parts are read."""

    type: str
    text: str | None = None


class FunctionCallIn(OpenModel):
    name: str
    arguments: str = ""
    """The raw JSON string the model produced; it may be malformed."""


class ToolCallIn(OpenModel):
    id: str
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(OpenModel):
    """One message of the conversation, any role."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    """On a ``tool`` message: the id of the assistant tool call it answers."""

    @property
    def text(self) -> str:
        """The message content as plain text (text parts joined, empty when there is none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class FunctionSpec(OpenModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(OpenModel):
    type: str = "function"
    function: FunctionSpec | None = None
    """None for non-function tool types, which the scripted policy ignores."""


class StreamOptions(OpenModel):
    include_usage: bool = False


class ChatCompletionRequest(OpenModel):
    """``POST /v1/chat/completions``: the fields the scripted policy reads; others are kept."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    """Choices to return, each decided under its own seed."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0
    return_token_ids: bool = False
    """vLLM's extension: top-level ``prompt_token_ids`` and per-choice ``token_ids``."""
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: logprob tokens spelled ``token_id:N``."""
    return_prompt_token_ids: bool = False
    """SGLang's extension: per-choice ``prompt_token_ids`` (with ``return_token_ids``)."""

    def tool_names(self) -> list[str]:
        """Names of the function tools on offer, in the order given (none when ``tool_choice``
        is ``"none"``, which forbids calling them)."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function.name for t in self.tools if t.function is not None]


# ---------------------------------------------------------------------------------------------
# What we emit


class FunctionCall(StrictModel):
    name: str
    arguments: str
    """A JSON-encoded object, as OpenAI sends it (a string, not an object)."""


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(StrictModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when the message calls tools, as OpenAI sends it."""
    tool_calls: list[ToolCall] | None = _OMIT_NONE


class TopLogprob(StrictModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(StrictModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(StrictModel):
    content: list[TokenLogprob]


class Choice(StrictModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = _OMIT_NONE
    """With ``return_token_ids``: the sampled ids (vLLM's and SGLang's shape)."""
    prompt_token_ids: list[int] | None = _OMIT_NONE
    """With ``return_token_ids`` in SGLang's shape: the prompt's ids, on the choice."""


class Usage(StrictModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(StrictModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    """Unix time in seconds."""
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = _OMIT_NONE
    """With ``return_token_ids`` (vLLM's shape): the prompt's ids."""


class FunctionDelta(StrictModel):
    name: str | None = _OMIT_NONE
    arguments: str | None = _OMIT_NONE


class ToolCallDelta(StrictModel):
    index: int
    id: str | None = _OMIT_NONE
    type: Literal["function"] | None = _OMIT_NONE
    function: FunctionDelta


class Delta(StrictModel):
    role: Literal["assistant"] | None = _OMIT_NONE
    content: str | None = _OMIT_NONE
    tool_calls: list[ToolCallDelta] | None = _OMIT_NONE


class ChunkChoice(StrictModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = _OMIT_NONE


class ChatCompletionChunk(StrictModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    """Empty on the trailing usage chunk (``stream_options.include_usage``)."""
    usage: Usage | None = _OMIT_NONE
    prompt_token_ids: list[int] | None = _OMIT_NONE
    """On the first chunk, with ``return_token_ids``."""


class ModelCard(StrictModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollpoint"


class ModelList(StrictModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
