"""Weight updates on one model server: the engine paused around them, and the policy
version that is live from the moment they end.

Owns the update's state machine (:data:`TRANSITIONS`), the routes' bodies
(:class:`PauseRequest`, :class:`LiveRequest`) and what each step does:

- ``pause`` (``POST /rollpoint/v1/weights/pause``): calls that have not started yet wait
  here (they start under the new weights, stamped with the new version); then the engine
  is paused in the mode asked, by its own route (:mod:`rollpoint.policy.engine_adapters`).
  An engine that has no such mode or answers its route with 404/405 (vLLM without
  ``VLLM_SERVER_DEV_MODE``) is *drained* instead: the pause returns once no call runs.
  ``keep`` needs the model server to count each call's tokens as they arrive (the
  generation cut's streams); without it the calls are drained too, so no call spans an
  update it cannot split. The answer says which was done (``how``).
- ``live`` (``POST /rollpoint/v1/weights/live``): version ``V`` is live from now on. Every
  call still streaming closes a segment of its old version at the tokens received so far
  (:meth:`~rollpoint.servers.model.generation_cut.PartialCall.switch`), the server's
  version becomes ``V``, the engine is resumed if this server paused it, and the waiting
  calls start. Without a pause before it (the trainer swapped weights on its own), the
  switch is taken the same way.

The split of a ``keep`` call is taken at ``live``, after the weights were pushed, not at
the pause: the tokens the engine sampled before its pause have reached this server by
then (a push takes far longer than a hop between the engine and its proxy). A call the
engine aborted (``abort`` mode, finish reason ``abort``) is sent again by the model server
once the update is over (:meth:`WeightSwitch.wait_live`).

Does not own: pushing the weights (the trainer's), nor keeping a snapshot out of an update
(the trainer holds its saves for the whole update).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import aiohttp
from pydantic import Field

from rollpoint.policy.engine_adapters import EngineCall, PauseMode, control_for
from rollpoint.protocol.errors import BadRequestError, InvalidPhaseError, TransportError
from rollpoint.protocol.model_base import StrictModel

if TYPE_CHECKING:
    from rollpoint.servers.model.model_server import ModelServer

log = logging.getLogger(__name__)

_ABSENT = (404, 405)
"""How an engine answers a pause route it does not serve."""


class PauseRequest(StrictModel):
    mode: PauseMode = "keep"


class LiveRequest(StrictModel):
    version: Annotated[int, Field(ge=0)]


class UpdatePhase(StrEnum):
    LIVE = "live"
    PAUSED = "paused"


TRANSITIONS: dict[tuple[UpdatePhase, str], UpdatePhase] = {
    (UpdatePhase.LIVE, "pause"): UpdatePhase.PAUSED,
    (UpdatePhase.LIVE, "live"): UpdatePhase.LIVE,
    (UpdatePhase.PAUSED, "live"): UpdatePhase.LIVE,
}
"""(phase, step) → next phase; a step not listed is refused (409 ``invalid_phase``)."""


class WeightSwitch:
    """One model server's weight updates (see the module docstring)."""

    def __init__(self, server: ModelServer, *, can_split: Callable[[], bool]) -> None:
        self._server = server
        self._control = control_for(server.settings.engine)
        self._can_split = can_split
        self.phase = UpdatePhase.LIVE
        self.mode: PauseMode | None = None
        self._engine_paused = False
        self._live = asyncio.Event()
        self._live.set()
        self.updates = 0
        """Versions made live here (``live`` calls that changed the version)."""
        self.pauses = 0

    @property
    def touched(self) -> bool:
        """Whether an update was ever asked for here (calls look for aborts only then)."""
        return self.updates > 0 or self.pauses > 0

    @property
    def is_live(self) -> bool:
        return self._live.is_set()

    async def wait_live(self) -> None:
        """Return once no update is in progress (at once when none is)."""
        if not self._live.is_set():
            await self._live.wait()

    def _step(self, step: str) -> UpdatePhase:
        nxt = TRANSITIONS.get((self.phase, step))
        if nxt is None:
            raise InvalidPhaseError(f"weights: cannot {step} while {self.phase}")
        return nxt

    async def pause(self, mode: PauseMode) -> dict[str, Any]:
        self.phase = self._step("pause")
        self.mode = mode
        self.pauses += 1
        self._live.clear()
        how = "drained"
        call = self._control.pause(mode)
        try:
            if mode == "keep" and not self._can_split():
                call = None  # it could not split a call across the update: none may span it
            if call is not None and mode == "wait":
                await self._drain()  # the engine's own wait would be the same; be sure first
            if call is not None and await self._post(call):
                self._engine_paused = True
                how = "engine"
            else:
                await self._drain()
        except BaseException:
            await self._resume_engine()
            self._reopen()
            raise
        log.info("weights: paused (%s, %s)", mode, how)
        return {"phase": str(self.phase), "mode": mode, "how": how}

    async def live(self, version: int) -> dict[str, Any]:
        self.phase = self._step("live")
        server = self._server
        if version < server.policy_version:
            self._reopen_if_paused()
            raise BadRequestError(
                f"weights: version {version} is older than the live one "
                f"({server.policy_version}); versions only go up"
            )
        if version != server.policy_version:
            for partial in server.partials.values():
                partial.switch(version)
            server.policy_version = version
            self.updates += 1
        try:
            await self._resume_engine()
        finally:
            self._reopen()
        return {"phase": str(self.phase), "policy_version": version}

    def _reopen_if_paused(self) -> None:
        # A refused live during a pause leaves the update paused: the trainer retries it.
        if not self._live.is_set():
            self.phase = UpdatePhase.PAUSED

    def _reopen(self) -> None:
        self.phase = UpdatePhase.LIVE
        self.mode = None
        self._live.set()

    async def _resume_engine(self) -> None:
        if self._engine_paused:
            await self._post(self._control.resume(), required=True)
            self._engine_paused = False

    async def _drain(self) -> None:
        gate = self._server.gate
        while gate.in_flight:
            await gate.wait_changed(timeout=1.0)

    async def _post(self, call: EngineCall, *, required: bool = False) -> bool:
        """POST ``call`` to the engine; False when it does not serve the route (404/405)
        and ``required`` is not set. Any other refusal is a :class:`TransportError`."""
        server = self._server
        root = server.settings.upstream_url.rstrip("/").removesuffix("/v1")
        url = root + call.path
        try:
            async with server.upstream.session.post(
                url,
                params=call.params or None,
                json=call.body,
                headers=server.upstream.control_headers,
            ) as resp:
                status = resp.status
                text = (await resp.read())[:200].decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"weights: engine {url} unreachable: {exc}") from None
        if status in _ABSENT and not required:
            log.info("weights: the engine has no %s (HTTP %d): draining instead", call.path, status)
            return False
        if status >= 300:
            raise TransportError(f"weights: engine {url} answered HTTP {status}: {text}")
        return True
