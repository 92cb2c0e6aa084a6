"""Token data of one policy call as rollpoint saves it: exact ids and logprobs, packed.

Owns: :class:`TokenSegment` (the policy version of each run of a continued call's tokens),
:class:`TokenTexts` (token strings and logprobs of an engine that returns no ids),
:class:`TokenTrace` (the wire and on-disk form, shared by the agent's model calls,
the model server's call ledger and the trained rows), the packed array codec (little-endian
int32 ids and float32 logprobs, base64 text: a 1k-token turn is ~5.4 KiB of ids and
logprobs instead of ~15 KiB of JSON numbers), and the prompt chaining rule that keeps an
episode at O(its tokens): a call's prompt ids are stored as the suffix added since the
previous call of the episode (its prompt then its completion) when that is a prefix of
them, the full prompt otherwise, with ``prompt_is_suffix`` saying which.

Does not own: reading token data out of an engine's reply (the engine adapters in
:mod:`rollpoint.policy.engine_adapters`), nor deciding which calls to keep.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from pydantic import Field, model_validator

from rollpoint.protocol.model_base import StrictModel

_INT32_MAX = 2**31 - 1
_BIG_ENDIAN = sys.byteorder == "big"


def pack_ids(ids: Sequence[int]) -> str:
    """Token ids as base64 of little-endian int32 (ids are checked by the adapters)."""
    packed = array("i", ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def pack_floats(values: Sequence[float]) -> str:
    """Logprobs as base64 of little-endian float32 (engines sample in float32 or less)."""
    packed = array("f", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _unpack(code: str, text: str) -> array[Any]:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes is not a whole number of 4-byte values")
    out: array[Any] = array(code)
    out.frombytes(raw)
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def unpack_ids(text: str) -> list[int]:
    return list(_unpack("i", text))


def unpack_floats(text: str) -> list[float]:
    return list(_unpack("f", text))


def as_float32(values: Iterable[float]) -> list[float]:
    """``values`` rounded to float32, as a trace stores them (for comparisons)."""
    return list(array("f", values))


class TokenTrace(StrictModel):
    """What the engine sampled in one call, packed (see the module docstring).

    ``format`` versions the packed layout; records written before token capture have no
    trace at all (None), and stay readable.
    """

    format: Annotated[int, Field(ge=1, le=1)] = 1
    engine: str
    """The adapter that read the reply (``vllm``, ``sglang``, ``sglang_native``)."""
    completion_ids: str
    """Sampled token ids, packed int32."""
    completion_logprobs: str | None = None
    """The logprob of each sampled token, packed float32; None when the engine gave none."""
    prompt_ids: str | None = None
    """Prompt token ids, packed int32: the suffix since the previous call when
    ``prompt_is_suffix``, else the whole prompt. None when the engine gave none."""
    prompt_is_suffix: bool = False
    completion_count: Annotated[int, Field(ge=0)] = 0
    prompt_count: Annotated[int, Field(ge=0)] = 0
    """Ids stored in ``prompt_ids`` (the suffix's length when ``prompt_is_suffix``)."""

    @model_validator(mode="after")
    def _lengths(self) -> TokenTrace:
        try:
            ids = _unpack("i", self.completion_ids)
            logprobs = (
                None if self.completion_logprobs is None else _unpack("f", self.completion_logprobs)
            )
            prompt = None if self.prompt_ids is None else _unpack("i", self.prompt_ids)
        except ValueError as exc:
            raise ValueError(f"token trace: {exc}") from None
        if len(ids) != self.completion_count:
            raise ValueError(f"completion_count {self.completion_count} but {len(ids)} ids")
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} completion ids but {len(logprobs)} logprobs")
        if (len(prompt) if prompt is not None else 0) != self.prompt_count:
            raise ValueError(f"prompt_count {self.prompt_count} disagrees with prompt_ids")
        if self.prompt_is_suffix and prompt is None:
            raise ValueError("prompt_is_suffix without prompt_ids")
        return self

    @classmethod
    def build(
        cls,
        *,
        engine: str,
        completion_ids: Sequence[int],
        completion_logprobs: Sequence[float] | None,
        prompt_ids: Sequence[int] | None,
        context: list[int] | None,
    ) -> TokenTrace:
        """Pack one call's ids; ``context`` is the episode's tokens before it (the previous
        call's prompt then completion), so a prompt that extends it keeps only the suffix."""
        suffix = False
        if prompt_ids is not None and context:
            n = len(context)
            if len(prompt_ids) >= n and list(prompt_ids[:n]) == context:
                prompt_ids, suffix = prompt_ids[n:], True
        # model_construct: the ids were checked by the adapter; validation is for disk.
        return cls.model_construct(
            format=1,
            engine=engine,
            completion_ids=pack_ids(completion_ids),
            completion_logprobs=(
                None if completion_logprobs is None else pack_floats(completion_logprobs)
            ),
            prompt_ids=None if prompt_ids is None else pack_ids(prompt_ids),
            prompt_is_suffix=suffix,
            completion_count=len(completion_ids),
            prompt_count=0 if prompt_ids is None else len(prompt_ids),
        )

    def completion(self) -> list[int]:
        return unpack_ids(self.completion_ids)

    def logprobs(self) -> list[float] | None:
        return None if self.completion_logprobs is None else unpack_floats(self.completion_logprobs)

    def stored_prompt(self) -> list[int] | None:
        """The prompt ids as stored: the suffix when ``prompt_is_suffix``."""
        return None if self.prompt_ids is None else unpack_ids(self.prompt_ids)

    def prompt(self, context: Sequence[int] | None) -> list[int] | None:
        """The whole prompt of this call, given the episode's tokens before it."""
        if self.prompt_ids is None:
            return None
        stored = unpack_ids(self.prompt_ids)
        if self.prompt_is_suffix:
            return [*(context or ()), *stored]
        return stored


class TokenTexts(StrictModel):
    """What an engine that returns no token ids still gives: the text of each sampled token
    (as its ``logprobs.content[].token``) and its logprob, packed float32. Kept per call
    when token capture is on and the reply has logprobs but no ids (llama.cpp's server,
    OpenAI's API), so behaviour logprobs are there for a loss that needs only them; the
    strings are the engine's spelling, not ids (nothing here can be retokenized exactly)."""

    format: Annotated[int, Field(ge=1, le=1)] = 1
    engine: str
    """The adapter that read the reply."""
    tokens: list[str]
    logprobs: str
    """Packed float32, one per token."""

    @model_validator(mode="after")
    def _lengths(self) -> TokenTexts:
        try:
            values = _unpack("f", self.logprobs)
        except ValueError as exc:
            raise ValueError(f"token texts: {exc}") from None
        if len(values) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(values)} logprobs")
        return self

    @classmethod
    def build(cls, *, engine: str, tokens: list[str], logprobs: Sequence[float]) -> TokenTexts:
        # model_construct: read and checked by the adapter; validation is for disk.
        return cls.model_construct(
            format=1, engine=engine, tokens=tokens, logprobs=pack_floats(logprobs)
        )

    def values(self) -> list[float]:
        return unpack_floats(self.logprobs)


class TokenSegment(StrictModel):
    """A run of a call's completion tokens sampled under one policy version: a call continued
    after a restore from its saved prefix has two or more (the prefix's, then the
    continuation's), in order; their counts add up to the completion's length."""

    policy_version: Annotated[int, Field(ge=0)]
    tokens: Annotated[int, Field(ge=0)]


def context_after(traces: Iterable[TokenTrace | None]) -> list[int] | None:
    """The episode's token sequence after these calls (last prompt + last completion),
    or None when a call in it had no prompt ids (nothing to chain on)."""
    context: list[int] | None = []
    for trace in traces:
        if trace is None:
            context = None
            continue
        if trace.prompt_is_suffix and context is None:
            context = None
            continue
        prompt = trace.prompt(context)
        context = None if prompt is None else [*prompt, *trace.completion()]
    return context


def is_int32_id(value: object) -> bool:
    """A token id as rollpoint stores it: an int (not a bool) in [0, 2**31)."""
    return type(value) is int and 0 <= value <= _INT32_MAX
