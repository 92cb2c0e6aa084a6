"""Control never waits behind data (issue 37, item 1): the control listener, on real servers.

Every server here runs for real on loopback (uvicorn in a thread, its data loop there), and
the data loop is blocked deterministically: a data route that blocks its loop on a
:class:`threading.Event` the test holds, so nothing on that loop can run until the test
lets go. A control call answered meanwhile was served off the data loop; the same call at
the server's own URL (the data loop, where every control route was served before) cannot
be, and is shown not to be.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI

from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.http.client import HttpClient
from rollpoint.participant import mount_participant
from rollpoint.participant.control_mount import close_control_plane, control_listener
from rollpoint.protocol.control import (
    CONTROL_PREFIX,
    Phase,
    PrepareRequest,
    RenewRequest,
    ResumeRequest,
    StatusReply,
)
from rollpoint.protocol.control_verbs import PREPARE, RENEW, RESUME, STATUS
from rollpoint.protocol.errors import RollpointError, TransportError
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind
from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from rollpoint.servers.resources.resources_server import create_resources_app
from rollpoint.testing.fault import Fault
from rollpoint.testing.fault_proxy import FaultProxy
from rollpoint.trainer.control.control_transport import HttpControlTransport, control_url
from tests.support.live_server import serve_app
from tests.unit.participant.fake_participant import FakeParticipant

TOKEN = "control-listener-token-0123456789"


class LoopBlock:
    """A data route that blocks the event loop serving it until :meth:`release`."""

    def __init__(self, app: FastAPI) -> None:
        self.entered = threading.Event()
        self._release = threading.Event()

        async def block_the_loop() -> dict[str, bool]:
            self.entered.set()
            # Blocking on purpose: nothing else on this loop runs until the test lets go.
            self._release.wait(60)
            return {"released": True}

        app.add_api_route("/test/block-the-loop", block_the_loop, methods=["POST"])

    @property
    def holding(self) -> bool:
        return self.entered.is_set() and not self._release.is_set()

    def release(self) -> None:
        self._release.set()


def _model_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    return create_model_app(
        # No engine is called: the test sends no policy call.
        ModelServerSettings(upstream_url="http://127.0.0.1:9/v1", snapshot_root=str(tmp_path))
    )


def _agent_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    return create_agent_app(
        # No row is run: its peers are never called.
        AgentSettings(
            model_url="http://127.0.0.1:9",
            resources_url="http://127.0.0.1:9",
            environment="workplace",
            snapshot_root=str(tmp_path),
        )
    )


def _resources_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    return create_resources_app("workplace", snapshot_root=str(tmp_path))


@pytest.mark.parametrize(
    ("make_app", "in_flight"),
    [(_model_app, "in_flight"), (_agent_app, "live"), (_resources_app, "in_flight")],
    ids=["model", "agent", "resources"],
)
async def test_a_built_in_servers_status_is_answered_while_its_data_loop_is_blocked(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_app: Callable[[Path, pytest.MonkeyPatch], FastAPI],
    in_flight: str,
) -> None:
    app = make_app(tmp_path, monkeypatch)
    block = LoopBlock(app)
    with serve_app(app) as url:
        async with HttpClient(token=TOKEN, timeout_s=30) as http:
            own_loop = HttpControlTransport(http, url)
            data_loop = HttpControlTransport(http, url, follow_control_port=False)
            first = await own_loop.call(STATUS, None, 10)  # read at the server's URL
            assert first.control_port is not None
            assert own_loop.target == f"http://127.0.0.1:{first.control_port}"
            assert first.data_loop_quiet_ms is None  # served on the data loop: it runs
            blocked = asyncio.create_task(http.post_json(f"{url}/test/block-the-loop", {}))
            try:
                assert await asyncio.to_thread(block.entered.wait, 10)
                status = await own_loop.call(STATUS, None, 5)
                assert block.holding  # answered while the data loop could run nothing
                assert status.phase is Phase.IDLE
                assert status.counts[in_flight] == 0  # read off the loop, still right
                assert (status.kind, status.name) == (first.kind, first.name)
                # The same call on the data loop cannot be answered while it is blocked.
                with pytest.raises(TransportError, match="no answer within 1s"):
                    await data_loop.call(STATUS, None, 1.0)
                assert block.holding
                # Answering says nothing of the data loop: the status says it is quiet
                # (blocked over 1 s now), which the stuck watchdog reads.
                later = await own_loop.call(STATUS, None, 5)
                assert later.data_loop_quiet_ms is not None and later.data_loop_quiet_ms >= 500
            finally:
                block.release()
            assert await blocked == {"released": True}


async def test_the_verbs_on_the_control_port_run_on_the_data_loops_fence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prepare, renew and resume through the listener change the one fence the data loop's
    # routes serve: its gate closes and reopens, and the server's own URL sees the phases.
    app = _model_app(tmp_path, monkeypatch)
    block = LoopBlock(app)
    with serve_app(app) as url:
        async with HttpClient(token=TOKEN, timeout_s=30) as http:
            own_loop = HttpControlTransport(http, url)
            data_loop = HttpControlTransport(http, url, follow_control_port=False)
            await own_loop.call(STATUS, None, 10)
            deadline = time.time() + 30
            prepared = await own_loop.call(
                PREPARE, PrepareRequest(checkpoint_id="c1", deadline_ts=deadline), 10
            )
            assert prepared.phase is Phase.PREPARED
            server = app.state.model_server
            assert not server.gate.is_open
            assert (await data_loop.call(STATUS, None, 10)).phase is Phase.PREPARED
            # A prepare's phase, read off the data loop while that loop is blocked.
            blocked = asyncio.create_task(http.post_json(f"{url}/test/block-the-loop", {}))
            try:
                assert await asyncio.to_thread(block.entered.wait, 10)
                status = await own_loop.call(STATUS, None, 5)
                assert block.holding
                assert (status.phase, status.checkpoint_id) == (Phase.PREPARED, "c1")
            finally:
                block.release()
            await blocked
            renewed = await own_loop.call(
                RENEW, RenewRequest(checkpoint_id="c1", deadline_ts=deadline + 5), 10
            )
            assert renewed.lease_expires_at > prepared.lease_expires_at
            resumed = await own_loop.call(RESUME, ResumeRequest(checkpoint_id="c1"), 10)
            assert resumed.phase is Phase.IDLE
            assert server.gate.is_open
            assert (await data_loop.call(STATUS, None, 10)).phase is Phase.IDLE


class OffLoopUnsafeParticipant(FakeParticipant):
    """An SDK participant whose stats iterate what its loop changes: called off that loop,
    it fails as such code can (a dict changed size while it iterated)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop_thread: int | None = None
        self.stats_threads: list[int] = []

    async def close_admission(self) -> None:
        self.loop_thread = threading.get_ident()
        await super().close_admission()

    def stats(self) -> dict[str, int]:
        self.stats_threads.append(threading.get_ident())
        if self.loop_thread is not None and threading.get_ident() != self.loop_thread:
            raise RuntimeError("dictionary changed size during iteration")
        return {"sessions": len(self.state)}


async def test_an_sdk_participant_gets_the_listener_and_a_stats_unsafe_off_its_loop_still_answers(
    tmp_path: Path,
) -> None:
    app = FastAPI()
    participant = OffLoopUnsafeParticipant()
    participant.state = {"r1:0": 2}
    mount_participant(app, participant, token=TOKEN, snapshot_root=str(tmp_path))
    with serve_app(app) as url:
        async with HttpClient(token=TOKEN, timeout_s=30) as http:
            transport = HttpControlTransport(http, url)
            first = await transport.call(STATUS, None, 10)
            assert first.control_port is not None
            deadline = time.time() + 30
            await transport.call(
                PREPARE, PrepareRequest(checkpoint_id="c1", deadline_ts=deadline), 10
            )
            try:
                assert participant.loop_thread is not None  # the hook ran on the data loop
                status: StatusReply = await transport.call(STATUS, None, 10)
                # Read off the loop first (it raised), then on it: right, not failed.
                assert status.counts == {"sessions": 1, "admission_closes": 1}
                assert status.phase is Phase.PREPARED
                assert participant.stats_threads[-2] != participant.loop_thread
                assert participant.stats_threads[-1] == participant.loop_thread
            finally:
                # A prepared participant holds the process's collector paused: a failed
                # check above must not leave it so for the tests after it in this worker.
                await transport.call(RESUME, ResumeRequest(checkpoint_id="c1"), 10)


async def test_closing_the_control_plane_stops_the_listener_first(tmp_path: Path) -> None:
    app = FastAPI()
    mount_participant(app, FakeParticipant(), token=TOKEN, snapshot_root=str(tmp_path))
    listener = control_listener(app)
    assert listener is not None and listener.port is None  # started by the lifespan
    with serve_app(app) as url:
        async with HttpClient(token=TOKEN, timeout_s=10, connect_timeout_s=2) as http:
            status = await HttpControlTransport(http, url).call(STATUS, None, 10)
            port = status.control_port
            assert port == listener.port
            await close_control_plane(app)
            assert listener.port is None
            with pytest.raises(TransportError):
                await http.get_json(f"http://127.0.0.1:{port}/rollpoint/v1/checkpoint/status")


def _status(control_port: int | None, server_port: int | None) -> StatusReply:
    return StatusReply(
        kind=ParticipantKind.MODEL,
        name="model",
        replica="replica-0",
        mode=CheckpointMode.TURN,
        protocol_version=1,
        features=[],
        phase=Phase.IDLE,
        checkpoint_id=None,
        lease_expires_at=None,
        counts={},
        retired_rollouts=0,
        control_port=control_port,
        server_port=server_port,
    )


def test_the_control_url_keeps_the_servers_host_and_takes_the_listeners_port() -> None:
    assert control_url("http://10.0.0.5:8001", _status(9001, 8001)) == "http://10.0.0.5:9001"
    assert control_url("http://[::1]:8001/", _status(9001, 8001)) == "http://[::1]:9001"
    assert control_url("http://10.0.0.5:8001", _status(None, 8001)) == "http://10.0.0.5:8001"
    # Reached through a proxy (the server served on another port): the proxy stays.
    assert control_url("http://127.0.0.1:7000", _status(9001, 8001)) == "http://127.0.0.1:7000"
    # Behind a path a proxy serves the routes; a bare port would go around it.
    assert control_url("https://gw.example/m0", _status(9001, 443)) == "https://gw.example/m0"


async def test_a_participant_behind_a_fault_proxy_is_controlled_through_the_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chaos trials put a FaultProxy in front of a participant to fault its control
    # calls: the transport must not go around it to the control listener.
    app = _model_app(tmp_path, monkeypatch)
    with serve_app(app) as url:
        async with FaultProxy(url) as proxy, HttpClient(token=TOKEN, timeout_s=30) as http:
            transport = HttpControlTransport(http, proxy.url)
            status = await transport.call(STATUS, None, 10)
            assert status.control_port is not None  # it has a listener...
            assert transport.target == proxy.url  # ...and the proxy stays in the path
            rule = proxy.add(Fault.refuse(path=f"{CONTROL_PREFIX}/status"))
            with pytest.raises(RollpointError):
                await transport.call(STATUS, None, 10)
            assert rule.hits == 1  # the call went through the proxy, which faulted it


async def test_a_call_whose_listener_is_gone_is_sent_where_the_server_now_serves_control(
    tmp_path: Path,
) -> None:
    # A server restarted in place listens for control on a new port (here: none left): the
    # call that finds the old port closed reads the status at the URL and goes there.
    app = FastAPI()
    mount_participant(app, FakeParticipant(), token=TOKEN, snapshot_root=str(tmp_path))
    with serve_app(app) as url:
        async with HttpClient(token=TOKEN, timeout_s=10, connect_timeout_s=2) as http:
            transport = HttpControlTransport(http, url)
            await transport.call(STATUS, None, 10)
            assert transport.target not in (None, url)
            listener = control_listener(app)
            assert listener is not None
            await listener.aclose()
            try:
                prepared = await transport.call(
                    PREPARE, PrepareRequest(checkpoint_id="c1", deadline_ts=time.time() + 30), 10
                )
                assert prepared.phase is Phase.PREPARED
                assert transport.target == url
            finally:
                # As an SDK user's shutdown does: the prepared fence holds the collector.
                await close_control_plane(app)
