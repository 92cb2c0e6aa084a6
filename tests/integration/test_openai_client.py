"""The official ``openai`` client against our real servers on loopback.

The scripted policy and a model server in front of it, both guarded by a data token as the
runtime starts them (``$ROLLPOINT_DATA_TOKEN``; the model server sends it upstream): plain,
async, streamed and tool-calling completions, the model list and one model, and every
refusal raised as the client's own typed error, from a body in OpenAI's shape.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from rollpoint.http.auth import DATA_TOKEN_ENV
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from tests.support.live_server import serve_app
from tests.unit.policy.fake_environments import MAIL, SYNC, WORKPLACE_TOOLS, workplace_prompt

pytestmark = pytest.mark.integration

MODEL = "org/scripted-7b"
"""With a slash, as real model ids often have: ``/v1/models/{id}`` must take it whole."""
TOKEN = secrets.token_urlsafe(16)
WORKPLACE = [{"role": "user", "content": workplace_prompt([SYNC], [MAIL])}]
MATH = [{"role": "user", "content": "What is 17 * 23?"}]


@pytest.fixture(scope="module")
def policy_url() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DATA_TOKEN_ENV, TOKEN)
        app = create_policy_app(PolicySettings(seed=3, error_rate=0.0, model=MODEL))
    with serve_app(app) as url:
        yield url


@pytest.fixture(scope="module")
def model_url(policy_url: str) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DATA_TOKEN_ENV, TOKEN)
        settings = ModelServerSettings(upstream_url=f"{policy_url}/v1", upstream_data_token=True)
        app = create_model_app(settings)
    with serve_app(app) as url:
        yield url


@pytest.fixture(params=["policy", "model server"])
def base_url(request: pytest.FixtureRequest, policy_url: str, model_url: str) -> str:
    return f"{policy_url if request.param == 'policy' else model_url}/v1"


def client(base_url: str, api_key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=10)


def test_sync_completion_with_tools_calls_a_listed_tool(base_url: str) -> None:
    with client(base_url) as c:
        reply = c.chat.completions.create(
            model=MODEL,
            messages=WORKPLACE,
            tools=WORKPLACE_TOOLS,
        )
    choice = reply.choices[0]
    assert reply.model == MODEL and choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert call.function.name in {t["function"]["name"] for t in WORKPLACE_TOOLS}
    assert isinstance(json.loads(call.function.arguments), dict)
    assert reply.usage is not None and reply.usage.completion_tokens > 0


async def test_async_completion(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=10) as c:
        reply = await c.chat.completions.create(model=MODEL, messages=MATH)
    assert reply.choices[0].finish_reason == "stop"
    assert "391" in (reply.choices[0].message.content or "")


def test_streamed_tool_call_and_usage_rebuild_the_plain_answer(base_url: str) -> None:
    with client(base_url) as c:
        plain = c.chat.completions.create(
            model=MODEL,
            messages=WORKPLACE,
            tools=WORKPLACE_TOOLS,
        )
        chunks = list(
            c.chat.completions.create(
                model=MODEL,
                messages=WORKPLACE,
                tools=WORKPLACE_TOOLS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    name, arguments, finish = "", "", None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                name += (delta.function.name or "") if delta.function else ""
                arguments += (delta.function.arguments or "") if delta.function else ""
    (expected,) = plain.choices[0].message.tool_calls or []
    assert (name, arguments, finish) == (
        expected.function.name,
        expected.function.arguments,
        "tool_calls",
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_models_list_and_retrieve(base_url: str) -> None:
    with client(base_url) as c:
        assert [m.id for m in c.models.list()] == [MODEL]
        card = c.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")


def _error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict)
    # openai puts the "error" object itself in .body.
    error = body.get("error", body)
    assert isinstance(error, dict)
    return error


def test_an_unknown_model_is_404_model_not_found(base_url: str) -> None:
    with client(base_url) as c:
        with pytest.raises(openai.NotFoundError) as retrieved:
            c.models.retrieve("gpt-nope")
        with pytest.raises(openai.NotFoundError) as completed:
            c.chat.completions.create(model="gpt-nope", messages=MATH)
    for exc in (retrieved.value, completed.value):
        assert exc.code == "model_not_found"
        error = _error_body(exc)
        assert error["type"] == "invalid_request_error"
        assert "gpt-nope" in error["message"]
        assert {"message", "type", "param", "code"} <= set(error)


def test_a_bad_request_names_the_field_in_param(base_url: str) -> None:
    with client(base_url) as c, pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=MODEL, messages=[])
    error = _error_body(refused.value)
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "messages",
        "bad_request",
    )


def test_a_wrong_token_is_an_authentication_error(base_url: str) -> None:
    with client(base_url, api_key="not-the-token") as c:
        with pytest.raises(openai.AuthenticationError) as refused:
            c.chat.completions.create(model=MODEL, messages=MATH)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    error = _error_body(refused.value)
    assert (error["type"], error["code"]) == ("authentication_error", "unauthorized")


def test_the_scripted_policy_needs_the_data_token(policy_url: str) -> None:
    body = {"model": MODEL, "messages": MATH}
    with httpx.Client(base_url=policy_url, timeout=10) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 401
        assert http.get("/v1/models").status_code == 401
        assert http.get("/healthz").status_code == 200
        bearer = {"authorization": f"Bearer {TOKEN}"}
        assert http.post("/v1/chat/completions", json=body, headers=bearer).status_code == 200


def test_an_unknown_v1_route_is_404_in_openai_shape(model_url: str) -> None:
    with httpx.Client(base_url=model_url, timeout=10) as http:
        reply = http.get("/v1/nothing-here", headers={"authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "invalid_request_error"
