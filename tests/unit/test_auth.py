"""Bearer tokens: loading (file wins, no default) and the constant-time check."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import Depends

from rollpoint.http.app import create_app
from rollpoint.http.auth import CONTROL_TOKEN_ENV, BearerAuth, load_token
from rollpoint.protocol.control import CONTROL_PREFIX
from rollpoint.protocol.errors import ConfigError, UnauthorizedError


def test_token_comes_from_the_environment_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "  abc \n")
    assert load_token() == "abc"


def test_a_token_file_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "from-env")
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert load_token(file=token_file) == "from-file"


def test_another_variable_serves_data_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_DATA_TOKEN", "data")
    assert load_token("MY_DATA_TOKEN") == "data"


@pytest.mark.parametrize("value", [None, "", "   "])
def test_no_token_configured_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(CONTROL_TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(CONTROL_TOKEN_ENV, value)
    with pytest.raises(ConfigError) as info:
        load_token()
    assert info.value.message == (
        "no control token configured: set ROLLPOINT_CONTROL_TOKEN or pass a token file"
    )


def test_a_missing_or_empty_token_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read token file .*missing"):
        load_token(file=tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ConfigError, match=r"token file .*empty is empty"):
        load_token(file=empty)


def test_an_empty_token_guards_nothing_and_is_refused() -> None:
    with pytest.raises(ConfigError):
        BearerAuth(" ")


@pytest.mark.parametrize("header", ["Bearer s3cr-é", "bearer s3cr-é", "BEARER  s3cr-é "])
def test_the_right_bearer_token_passes(header: str) -> None:
    BearerAuth("s3cr-é").check(header)


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Bearer wrong", "Basic s3cr-é", "s3cr-é", "Bearer s3cr-e"],
)
def test_anything_else_is_unauthorized(header: str | None) -> None:
    with pytest.raises(UnauthorizedError) as info:
        BearerAuth("s3cr-é").check(header)
    assert info.value.status == 401 and "s3cr" not in info.value.message


def test_the_token_is_not_in_the_repr() -> None:
    assert "hidden" not in repr(BearerAuth("hidden"))


@pytest.fixture
async def guarded() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app("guarded")

    @app.get("/data", dependencies=[Depends(BearerAuth("data-token"))])
    async def data() -> dict[str, bool]:
        return {"ok": True}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://guarded") as client:
        yield client


async def test_the_dependency_guards_a_route_with_a_401_envelope(
    guarded: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        refused = await guarded.get("/data", headers={"authorization": "Bearer guess"})
        allowed = await guarded.get("/data", headers={"authorization": "Bearer data-token"})
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthorized"
    assert allowed.status_code == 200 and allowed.json() == {"ok": True}
    assert "data-token" not in caplog.text and "guess" not in caplog.text


@pytest.fixture
async def data_guarded() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app("data-guarded", data_token="data-token")

    @app.post("/run")
    async def run(body: dict[str, int]) -> dict[str, bool]:
        return {"ran": bool(body)}

    @app.get(f"{CONTROL_PREFIX}/status")
    async def status() -> dict[str, bool]:
        return {"control": True}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://guarded") as client:
        yield client


async def test_the_data_token_guards_data_routes_before_the_body_is_read(
    data_guarded: httpx.AsyncClient,
) -> None:
    for headers in ({}, {"authorization": "Bearer control-token"}):
        refused = await data_guarded.post("/run", content=b"not json", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthorized"
    bad_body = await data_guarded.post(
        "/run", content=b"not json", headers={"authorization": "Bearer data-token"}
    )
    assert bad_body.status_code == 400  # past the guard, the body is checked as usual
    ran = await data_guarded.post(
        "/run", json={"rows": 1}, headers={"authorization": "Bearer data-token"}
    )
    assert ran.status_code == 200 and ran.json() == {"ran": True}


async def test_health_schema_and_control_routes_are_not_behind_the_data_token(
    data_guarded: httpx.AsyncClient,
) -> None:
    assert (await data_guarded.get("/healthz")).status_code == 200
    assert (await data_guarded.get("/openapi.json")).status_code == 200
    # The control routes answer to their own token (checked by their route class), not this one.
    assert (await data_guarded.get(f"{CONTROL_PREFIX}/status")).json() == {"control": True}


async def test_without_a_data_token_data_routes_stay_open() -> None:
    app = create_app("open")

    @app.post("/run")
    async def run() -> dict[str, bool]:
        return {"ran": True}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://open") as client:
        assert (await client.post("/run")).status_code == 200
