"""The scripted policy's weights: which version samples, the pause around an update, and
the engine's own log of which version sampled each token span.

Owns :class:`ScriptedWeights`, mounted by :func:`mount_weight_routes` on the scripted
policy with the routes real engines serve for a weight update (the shapes of the fixtures
under ``tests/fixtures/engines/pause/``):

- vLLM's ``POST /pause?mode=keep|wait|abort`` and ``POST /resume``;
- SGLang's ``POST /pause_generation`` (``{"mode": "in_place" | "abort" | "retract"}``) and
  ``POST /continue_generation``;
- ``POST /update_weight_version`` (``{"new_version": "3"}``, both engines' route): the
  stand-in for a weight push — the version that samples from then on;
- ``GET /weights_state`` (ours, for tests): the live version, whether paused, and the
  tokens each generation in flight has sampled.

Semantics, as the engines document them: ``keep`` / ``in_place`` / ``retract`` freeze the
generations in flight at a token boundary (the pause returns once each is parked, its
last chunk handed to the connection) and they go on under whatever weights are live at
the resume; ``wait`` returns once every generation in flight has ended; ``abort`` ends
each with finish reason ``abort``. New requests wait while paused.

The log (``weights_log``): one JSONL line per generation as it ends, ``{"id", "spans":
[[version, tokens], ...], "aborted"}``: the completion's tokens in order, each run with the
weights version that sampled it. Tests count versions from it.

Does not own: what is sampled (:mod:`rollpoint.policy.scripted_policy`).
"""

from __future__ import annotations

import asyncio
from typing import Any, BinaryIO, Literal

import orjson
from fastapi import FastAPI, Query
from fastapi.responses import Response

from rollpoint.protocol.errors import BadRequestError
from rollpoint.protocol.model_base import StrictModel

_SGLANG_MODES = {"in_place": "keep", "retract": "keep", "abort": "abort"}


class SglangPause(StrictModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class SglangContinue(StrictModel):
    torch_empty_cache: bool = True


class WeightVersion(StrictModel):
    new_version: str
    abort_all_requests: bool = False


class Aborted(Exception):
    """The generation was aborted by a pause in ``abort`` mode."""


class Generation:
    """One generation's weight spans as it samples."""

    __slots__ = ("aborted", "id", "parked", "spans")

    def __init__(self, reply_id: str) -> None:
        self.id = reply_id
        self.spans: list[list[int]] = []
        self.aborted = False
        self.parked = False

    def sampled(self, version: int, tokens: int) -> None:
        if tokens <= 0:
            return
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][1] += tokens
        else:
            self.spans.append([version, tokens])


class ScriptedWeights:
    """The scripted engine's weights version and pause state (see the module docstring)."""

    def __init__(self) -> None:
        self.version = 0
        self.mode: str | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._changed = asyncio.Event()
        self.active: dict[str, Generation] = {}
        self.log: BinaryIO | None = None

    # --- the generations' side ---------------------------------------------------------

    async def admit(self) -> None:
        """A new request waits while the engine is paused."""
        if not self._running.is_set():
            await self._running.wait()

    def start(self, reply_id: str) -> Generation:
        generation = Generation(reply_id)
        self.track(generation)
        return generation

    def track(self, generation: Generation) -> None:
        """In flight from now on (a pause waits for it, parks it or aborts it)."""
        self.active[generation.id] = generation

    async def turn(self, generation: Generation) -> int:
        """Before sampling the next tokens: park while paused, raise :class:`Aborted` when
        aborted; the version that samples them."""
        while not self._running.is_set():
            if generation.aborted:
                raise Aborted
            generation.parked = True
            self._notify()
            await self._running.wait()
        generation.parked = False
        if generation.aborted:
            raise Aborted
        return self.version

    def end(self, generation: Generation) -> None:
        self.active.pop(generation.id, None)
        if self.log is not None:
            line = {"id": generation.id, "spans": generation.spans, "aborted": generation.aborted}
            self.log.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
        self._notify()

    # --- the control side --------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        self.mode = mode
        if mode == "wait":
            self._running.clear()
            await self._until(lambda: not self.active)
            return
        self._running.clear()
        if mode == "abort":
            for generation in self.active.values():
                generation.aborted = True
            self._notify()
            await self._until(lambda: not self.active)
            return
        await self._until(lambda: all(g.parked for g in self.active.values()))

    def resume(self) -> None:
        self.mode = None
        self._running.set()

    def set_version(self, version: str) -> int:
        if not version.isdigit():
            raise BadRequestError(f"new_version must be a whole number, got {version[:40]!r}")
        self.version = int(version)
        return self.version

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, done: Any) -> None:
        while True:
            changed = self._changed  # taken before the check: no notification is missed
            if done():
                return
            await changed.wait()


def mount_weight_routes(app: FastAPI, weights: ScriptedWeights) -> None:
    """The engines' pause, resume and weight-version routes on the scripted policy."""

    @app.post("/pause")
    async def vllm_pause(mode: Literal["keep", "wait", "abort"] = Query("abort")) -> Response:
        await weights.pause(mode)
        return _json({"status": "paused"})

    @app.post("/resume")
    async def vllm_resume() -> Response:
        weights.resume()
        return _json({"status": "resumed"})

    @app.post("/pause_generation")
    async def sglang_pause(req: SglangPause) -> Response:
        await weights.pause(_SGLANG_MODES[req.mode])
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def sglang_continue(req: SglangContinue) -> Response:
        weights.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    @app.get("/weights_state")
    async def weights_state() -> Response:
        """This engine's own view (tests wait on it): the live version, whether paused, and
        how many tokens each generation in flight has sampled."""
        generations = [
            {"id": g.id, "sampled": sum(n for _, n in g.spans), "parked": g.parked}
            for g in weights.active.values()
        ]
        paused = weights.mode is not None
        return _json({"version": weights.version, "paused": paused, "generations": generations})

    @app.post("/update_weight_version")
    async def update_weight_version(req: WeightVersion) -> Response:
        version = weights.set_version(req.new_version)
        return _json({"success": True, "new_version": str(version)})


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")
