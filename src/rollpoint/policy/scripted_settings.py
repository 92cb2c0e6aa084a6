"""The scripted policy's settings: :class:`PolicySettings`, what the runtime starts it with.

Owns the keys the scripted policy server (:mod:`rollpoint.policy.scripted_policy`) reads
at start: its seed, latency and error rate, the model id it serves, the token shape it
speaks (vLLM's or SGLang's), the engine logs it writes, its pacing and reasoning, and the
bad engine data it makes on purpose. The ``policy.*`` keys of docs/guide.md say what each
does for a run.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rollpoint.protocol.engine_faults import EngineFault
from rollpoint.protocol.model_base import StrictModel


class PolicySettings(StrictModel):
    seed: int = 0
    latency_ms: Annotated[float, Field(ge=0)] = 0.0
    """Time each call takes, in milliseconds; 0 answers without sleeping at all."""
    error_rate: Annotated[float, Field(ge=0, le=1)] = 0.05
    """Probability that a tool-calling turn emits a wrong call (a wrong number for math)."""
    tokens_per_call: Annotated[int, Field(ge=1)] = 48
    """Completion tokens reported in ``usage`` for every call."""
    model: str = "scripted"
    """The id listed by ``GET /v1/models``, and echoed when a request names no model."""
    call_log: str | None = None
    """A JSONL file to append every reply's token data to (the engine's own log)."""
    shape: Literal["vllm", "sglang"] = "vllm"
    """Where token ids go: vLLM's (top-level ``prompt_token_ids``, ids on every stream
    chunk) or SGLang's OpenAI-compatible server (both on the choice; none when streamed)."""
    tool_turns: Annotated[int, Field(ge=0, le=1024)] = 3
    """Environments without a built-in playbook: tool-calling turns before the final answer."""
    token_latency_ms: Annotated[float, Field(ge=0)] = 0.0
    """Decode time per completion token (on top of ``latency_ms``): a stream then sends
    each token in its own chunk as it is "sampled", so a generation can be cut mid-way."""
    reasoning_tokens: Annotated[int, Field(ge=0)] = 0
    """Stand-in tokens of reasoning text before every tool call (the assistant message's
    content), as reasoning models think before they act: a long generation to cut."""
    decode_log: str | None = None
    """A JSONL file with one line per paced generation (``token_latency_ms``) as it ends or
    is cut off: ``{"id", "decoded", "max_tokens"}``, the tokens it actually decoded."""
    accept_prefix: bool = True
    """Whether ``continue_final_message`` is honoured; False answers it with a 400, as an
    engine that cannot continue a prefix does."""
    weights_log: str | None = None
    """A JSONL file with one line per generation as it ends: which weights version sampled
    each run of its tokens (:mod:`rollpoint.policy.scripted_weights`)."""
    pause_routes: bool = True
    """Serve the engines' pause, resume and weight-version routes; False: an engine
    without them (they answer 404, and a weight update drains its calls instead)."""
    faults: list[EngineFault] = Field(default_factory=list)
    """Bad engine data on purpose, on the calls each fault names
    (:mod:`rollpoint.policy.scripted_faults`); none by default."""
    fault_log: str | None = None
    """A JSONL file with one line per corruption ``faults`` made, before its reply leaves."""
