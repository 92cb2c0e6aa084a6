"""The start check decides the generation cut per engine, once, by name: on only where a
cut call can be continued token-exactly (the engine's stream carries ids and it continues
a partial assistant message); off, said in one warning line, where not; and
``policy.generation_cut: required`` stops the run instead of that line."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from rollpoint import parse_config
from rollpoint.policy.engine_check import check_engine
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.errors import ConfigError, LaunchError
from tests.support.live_server import serve_app
from tests.support.llama_cpp_peer import llama_cpp_peer

pytestmark = pytest.mark.integration


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture
def scripted(request: pytest.FixtureRequest) -> Iterator[str]:
    """The scripted policy in the shape ``request.param`` (vLLM's stream has ids)."""
    with serve_app(create_policy_app(PolicySettings(seed=1, shape=request.param))) as url:
        yield url + "/v1"


def kw(engine: str, **more: Any) -> dict[str, Any]:
    return {"engine": engine, "model": "scripted", "api_key": None, "capture": True, **more}


@pytest.mark.parametrize("scripted", ["vllm"], indirect=True)
async def test_an_engine_that_streams_ids_and_continues_is_cut(
    scripted: str, caplog: pytest.LogCaptureFixture
) -> None:
    found = await check_engine(scripted, **kw("vllm", cut="required"))
    assert (found.ids, found.cut) == (True, True)
    assert warnings_of(caplog) == []
    # The cut switched off by the config is not the engine's doing: nothing said.
    found = await check_engine(scripted, **kw("vllm", cut=False))
    assert (found.ids, found.cut) == (True, False)
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("scripted", ["sglang"], indirect=True)
async def test_an_engine_whose_stream_has_no_ids_runs_uncut_said_once(
    scripted: str, caplog: pytest.LogCaptureFixture
) -> None:
    found = await check_engine(scripted, **kw("sglang", cut=True))
    assert (found.ids, found.cut) == (True, False)
    (line,) = warnings_of(caplog)
    assert line == (
        f"policy engine 'sglang' at {scripted} cannot continue a cut generation "
        "token-exactly (its stream carries no token ids); the generation cut is off: a call "
        "in flight at a snapshot runs to its end, and is decoded again after a restore"
    )
    with pytest.raises(LaunchError, match=r"its stream carries no token ids\); policy\."):
        await check_engine(scripted, **kw("sglang", cut="required"))


@pytest.mark.parametrize("scripted", ["sglang"], indirect=True)
async def test_the_stream_is_read_not_the_engines_name(
    scripted: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Configured as vLLM; plain replies carry ids on the choice (read as vLLM's), but the
    # stream carries none: no prefix could be saved, so no cut.
    found = await check_engine(scripted, **kw("vllm", cut=True))
    assert (found.ids, found.cut) == (True, False)
    (line,) = warnings_of(caplog)
    assert "'vllm'" in line and "(its stream carries no token ids)" in line


async def test_an_engine_without_ids_is_said_once_and_runs_uncut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with llama_cpp_peer() as peer:
        url = peer.url + "/v1"
        found = await check_engine(url, **kw("vllm", cut=True))
        assert (found.ids, found.cut) == (False, False)
        (line,) = warnings_of(caplog)
        assert line == (
            f"policy engine 'vllm' at {url} returns no token ids; the run goes on without "
            "token data, and without the generation cut (a call in flight at a snapshot runs "
            "to its end, and is decoded again after a restore)"
        )
        with pytest.raises(
            LaunchError,
            match=r"^policy engine 'vllm' at \S+ returns no token ids; "
            r"policy\.generation_cut is 'required'$",
        ):
            await check_engine(url, **kw("vllm", cut="required"))


def test_generation_cut_required_needs_token_capture() -> None:
    base = {"workdir": "/tmp/x", "environment": "math", "tasks": 1}
    with pytest.raises(ConfigError, match="generation_cut: required needs capture_tokens"):
        parse_config({**base, "policy": {"generation_cut": "required"}})
    config = parse_config(
        {**base, "policy": {"generation_cut": "required", "capture_tokens": True}}
    )
    assert config.policy.generation_cut == "required"
