"""The app factory every server shares: what it leaves out of a request's path."""

from __future__ import annotations

from typing import Any

import httpx
import opentelemetry.trace
import pytest

from rollpoint.http.app import create_app


async def test_a_request_does_not_consult_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    # FastAPI's native telemetry asks for the global tracer provider on every request
    # while it is on; rollpoint turns it off (it cost ~4 % of a proxied call's CPU).
    asked: list[int] = []
    real = opentelemetry.trace.get_tracer_provider

    def counted(*args: Any, **kwargs: Any) -> Any:
        asked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(opentelemetry.trace, "get_tracer_provider", counted)
    app = create_app("probe")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://probe") as client:
        for _ in range(3):
            assert (await client.get("/healthz")).status_code == 200

    assert asked == []
