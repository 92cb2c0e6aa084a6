"""Engine adapters read the exact ids and logprobs out of vLLM- and SGLang-shaped replies
(fixtures under tests/fixtures/engines), streamed and not, and refuse malformed token data
naming the field and the engine."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.policy.engine_adapters import adapter_for, read_token_texts
from rollpoint.protocol.errors import ConfigError, TransportError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "engines"
PROMPT = [151644, 872, 198, 675, 264, 6722, 3283, 13, 151645, 198, 151644, 77091]
COMPLETION = [59604, 13, 151645]
LOGPROBS = [-0.015625, -0.125, -0.0009765625]


def fixture(name: str) -> Any:
    return orjson.loads((FIXTURES / name).read_bytes())


@pytest.mark.parametrize(
    ("engine", "name"),
    [
        ("vllm", "vllm_chat.json"),
        ("vllm", "vllm_chat_token_id_strings.json"),
        ("sglang", "sglang_chat.json"),
        ("sglang_native", "sglang_generate.json"),
    ],
)
def test_whole_replies_give_ids_and_logprobs(engine: str, name: str) -> None:
    tokens = adapter_for(engine).read(fixture(name))
    assert tokens is not None
    assert tokens.completion_ids == COMPLETION
    assert tokens.logprobs == LOGPROBS
    if name != "vllm_chat_token_id_strings.json":
        assert tokens.prompt_ids == PROMPT
    else:
        assert tokens.prompt_ids is None  # that reply carries no prompt ids


def test_vllm_stream_accumulates_ids_logprobs_and_prompt() -> None:
    stream = adapter_for("vllm").stream()
    for event in fixture("vllm_chat_stream.json")["events"]:
        stream.feed(event)
    tokens = stream.result()
    assert tokens is not None
    assert (tokens.completion_ids, tokens.logprobs, tokens.prompt_ids) == (
        COMPLETION,
        LOGPROBS,
        PROMPT,
    )


def test_sglang_stream_has_no_ids() -> None:
    stream = adapter_for("sglang").stream()
    stream.feed({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    assert stream.result() is None


def test_a_reply_without_token_data_reads_as_none() -> None:
    reply = fixture("vllm_chat.json")
    choice = reply["choices"][0]
    del choice["token_ids"], reply["prompt_token_ids"]
    choice["logprobs"] = None
    assert adapter_for("vllm").read(reply) is None
    plain = fixture("sglang_chat.json")
    del plain["choices"][0]["token_ids"]
    assert adapter_for("sglang").read(plain) is None


def _vllm_with(change: Any) -> Any:
    reply = copy.deepcopy(fixture("vllm_chat.json"))
    change(reply)
    return reply


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r["choices"][0]["token_ids"].append(7), "choices[0].logprobs.content"),
        (lambda r: r["choices"][0]["token_ids"].__setitem__(1, "13"), "choices[0].token_ids[1]"),
        (lambda r: r["choices"][0]["token_ids"].__setitem__(2, 1.5), "choices[0].token_ids[2]"),
        (lambda r: r["choices"][0]["token_ids"].__setitem__(0, -1), "choices[0].token_ids[0]"),
        (lambda r: r["prompt_token_ids"].__setitem__(3, True), "prompt_token_ids[3]"),
        (
            lambda r: r["choices"][0]["logprobs"]["content"][1].__setitem__("logprob", "x"),
            "choices[0].logprobs.content[1].logprob",
        ),
    ],
)
def test_malformed_vllm_token_data_names_field_and_engine(change: Any, field: str) -> None:
    with pytest.raises(TransportError) as err:
        adapter_for("vllm").read(_vllm_with(change))
    assert err.value.message.startswith(f"vllm reply: {field} ")


def test_malformed_token_id_string_is_refused() -> None:
    reply = fixture("vllm_chat_token_id_strings.json")
    reply["choices"][0]["logprobs"]["content"][2]["token"] = "token_id:abc"
    with pytest.raises(TransportError, match=r"vllm reply: choices\[0\]\.logprobs\.content\[2\]"):
        adapter_for("vllm").read(reply)


def test_malformed_sglang_native_lengths() -> None:
    reply = fixture("sglang_generate.json")
    reply["output_ids"].append(5)
    with pytest.raises(
        TransportError, match=r"sglang_native reply: meta_info\.output_token_logprobs"
    ):
        adapter_for("sglang_native").read(reply)


def test_malformed_stream_is_refused_at_the_end() -> None:
    stream = adapter_for("vllm").stream()
    events = fixture("vllm_chat_stream.json")["events"]
    events[2]["choices"][0]["token_ids"] = [13, 14]
    for event in events:
        stream.feed(event)
    with pytest.raises(TransportError, match="has 3 entries for 4 token ids"):
        stream.result()


def test_unknown_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown engine 'tgi'"):
        adapter_for("tgi")


# ---- an engine without ids: llama.cpp's server -------------------------------------------


def test_a_llama_cpp_reply_has_no_ids_but_its_token_strings_and_logprobs() -> None:
    reply = fixture("llamacpp_chat.json")
    assert adapter_for("vllm").read(reply) is None
    read = read_token_texts("vllm", reply)
    assert read is not None
    tokens, logprobs = read
    assert tokens == ["A", " colour", " is", " a", " fundamental", " concept", " in", " art"]
    assert "".join(tokens) == reply["choices"][0]["message"]["content"]
    assert logprobs[:2] == [-1.238384485244751, -0.8139224052429199]
    assert len(logprobs) == len(tokens) and all(lp < 0 for lp in logprobs)
    del reply["choices"][0]["logprobs"]
    assert read_token_texts("vllm", reply) is None


def test_malformed_token_strings_are_refused_naming_the_field() -> None:
    reply = fixture("llamacpp_chat.json")
    reply["choices"][0]["logprobs"]["content"][1]["token"] = 13
    with pytest.raises(TransportError, match=r"choices\[0\]\.logprobs\.content\[1\]\.token"):
        read_token_texts("vllm", reply)


def test_a_llama_cpp_stream_assembles_to_its_plain_reply() -> None:
    from rollpoint.servers.model.stream_assembler import StreamAssembler

    stream = adapter_for("vllm").stream()
    assembler = StreamAssembler(stream)
    for event in fixture("llamacpp_chat_stream.json")["events"]:
        assembler.feed(b"data: " + orjson.dumps(event) + b"\r\n\r\n")
    assembler.feed(b"data: [DONE]\r\n\r\n")
    plain = fixture("llamacpp_chat.json")["choices"][0]
    assert assembler.message() == plain["message"]
    assert assembler.finish_reason == plain["finish_reason"]
    assert stream.result() is None  # no ids


def test_an_empty_string_streamed_is_content_and_nothing_is_no_reply() -> None:
    from rollpoint.policy.engine_adapters import check_said
    from rollpoint.servers.model.stream_assembler import StreamAssembler

    said_empty, said_nothing = StreamAssembler(), StreamAssembler()
    head = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    for assembler in (said_empty, said_nothing):
        assembler.feed(b"data: " + orjson.dumps(head) + b"\n")
    empty = {"id": "c", "choices": [{"index": 0, "delta": {"content": ""}}]}
    said_empty.feed(b"data: " + orjson.dumps(empty) + b"\n")
    assert said_empty.message() == {"role": "assistant", "content": ""}
    check_said(said_empty.message(), "engine")
    assert said_nothing.message() == {"role": "assistant", "content": None}
    with pytest.raises(TransportError, match=r"^engine: the policy's reply has neither content"):
        check_said(said_nothing.message(), "engine")
