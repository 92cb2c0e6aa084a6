"""Token traces: packed arrays round-trip exactly, prompts chain as suffixes, bad packs are refused."""

from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from rollpoint.protocol.token_data import (
    TokenTrace,
    as_float32,
    context_after,
    pack_ids,
    unpack_floats,
    unpack_ids,
)


def test_packed_arrays_round_trip_little_endian() -> None:
    ids = [0, 1, 151645, 2**31 - 1]
    assert unpack_ids(pack_ids(ids)) == ids
    assert base64.b64decode(pack_ids([1])) == b"\x01\x00\x00\x00"
    trace = TokenTrace.build(
        engine="vllm",
        completion_ids=ids,
        completion_logprobs=[-0.1, -2.0, 0.0, -1e-3],
        prompt_ids=None,
        context=None,
    )
    assert trace.logprobs() == as_float32([-0.1, -2.0, 0.0, -1e-3])
    assert unpack_floats(trace.completion_logprobs or "") == trace.logprobs()


def test_a_prompt_that_extends_the_episode_is_stored_as_its_suffix() -> None:
    first = TokenTrace.build(
        engine="vllm",
        completion_ids=[7, 8],
        completion_logprobs=None,
        prompt_ids=[1, 2, 3],
        context=None,
    )
    second = TokenTrace.build(
        engine="vllm",
        completion_ids=[9],
        completion_logprobs=None,
        prompt_ids=[1, 2, 3, 7, 8, 4, 5],
        context=context_after([first]),
    )
    assert (second.prompt_is_suffix, unpack_ids(second.prompt_ids or "")) == (True, [4, 5])
    assert context_after([first, second]) == [1, 2, 3, 7, 8, 4, 5, 9]
    # A prompt that rewrites the history (a template that drops old reasoning) is kept whole.
    third = TokenTrace.build(
        engine="vllm",
        completion_ids=[6],
        completion_logprobs=None,
        prompt_ids=[1, 2, 3, 4],
        context=context_after([first, second]),
    )
    assert (third.prompt_is_suffix, third.prompt_count) == (False, 4)


def test_a_stored_trace_is_checked_when_read_back() -> None:
    good = TokenTrace.build(
        engine="vllm",
        completion_ids=[1, 2],
        completion_logprobs=[-1.0, -2.0],
        prompt_ids=[3],
        context=None,
    ).model_dump()
    TokenTrace.model_validate(good)
    with pytest.raises(ValidationError, match="2 completion ids but 1 logprobs"):
        TokenTrace.model_validate(
            {**good, "completion_logprobs": base64.b64encode(b"\0\0\0\0").decode()}
        )
    with pytest.raises(ValidationError, match="not base64"):
        TokenTrace.model_validate({**good, "completion_ids": "%%%"})
    with pytest.raises(ValidationError, match="completion_count 3"):
        TokenTrace.model_validate({**good, "completion_count": 3})
