"""A policy engine that lists its model and never answers a chat call: the stuck peer.

Owns a real OpenAI-shaped HTTP server on loopback (``GET /v1/models`` answers, so a run's
start checks pass) whose ``POST /v1/chat/completions`` holds every call until the context
ends, and then answers 503. It counts the chat calls it holds.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.support.live_server import serve_app

MODEL = "m"


class HangingEngine:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._released: asyncio.Event | None = None
        self._done = False
        self.chat_calls = 0
        self.app = FastAPI()
        self.app.get("/v1/models")(self._models)
        self.app.get("/v1/models/{model}")(self._model)
        self.app.post("/v1/chat/completions")(self._chat)

    async def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    async def _model(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "owned_by": "test"}

    async def _chat(self, request: Request) -> JSONResponse:
        await request.body()
        self.chat_calls += 1
        with self._lock:
            if self._released is None:
                self._loop, self._released = asyncio.get_running_loop(), asyncio.Event()
            if self._done:
                self._released.set()
        await self._released.wait()  # held until the test ends
        return JSONResponse({"error": {"message": "shutting down"}}, status_code=503)

    def release(self) -> None:
        """Let every held call (and every later one) go, from the test's thread."""
        with self._lock:
            self._done = True
            if self._loop is not None and self._released is not None:
                self._loop.call_soon_threadsafe(self._released.set)


@contextmanager
def hanging_engine() -> Iterator[tuple[str, HangingEngine]]:
    """Its base URL (no ``/v1``) and the engine, while it holds every chat call."""
    engine = HangingEngine()
    with serve_app(engine.app) as url:  # type: ignore[arg-type]
        try:
            yield url, engine
        finally:
            engine.release()
