"""Entry point of one server process: ``python -m rollpoint.runtime.server_process SPEC_JSON``.

Builds the app the spec names, binds its socket itself (port 0 → a free port, no race
with other launches), prints one :class:`ReadyLine` on stdout, and serves until told to
stop. With ``watch_parent`` its standard input is the launcher's leash: the launcher stops
it by closing that pipe, and EOF also comes when the launcher dies for any reason, SIGKILL
included, so a killed ``rollpoint run`` never leaves servers behind. While the launcher
lives, such a server ignores SIGINT and SIGTERM: Ctrl-C in a terminal signals the whole
foreground process group, and schedulers (Slurm's ``scancel``, a container runtime) signal
every process of a job, but the launcher still needs its servers for one last snapshot.

As a process's entry point it installs the performance tricks on the checkpoint seam
(:func:`rollpoint.tuning.install`) before it builds the app: the server's fence emits, the
tricks listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

import orjson
import uvicorn
from fastapi import FastAPI

from rollpoint.protocol.errors import LaunchError, RollpointError
from rollpoint.runtime.server_spec import ReadyLine, ServerSpec
from rollpoint.tuning import install as install_tuning
from rollpoint.tuning.thread_switch import shorten_thread_switch

log = logging.getLogger("rollpoint.server")

# How long a graceful shutdown may take before the process exits hard.
_SHUTDOWN_GRACE_S = 3.0


def build_app(spec: ServerSpec) -> FastAPI:
    """The app for ``spec.kind``; imports stay local so each process loads only its server."""
    if spec.kind == "policy":
        from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app

        return create_policy_app(PolicySettings.model_validate(spec.settings))
    if spec.kind == "model":
        from rollpoint.http.auth import POLICY_API_KEY_ENV
        from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app

        model = ModelServerSettings.model_validate(spec.settings)
        api_key = os.environ.get(POLICY_API_KEY_ENV)
        if api_key:  # by environment: a command line is readable by every user
            model = model.model_copy(update={"api_key": api_key})
        return create_model_app(model)
    if spec.kind == "agent":
        from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app

        return create_agent_app(AgentSettings.model_validate(spec.settings))
    from rollpoint.servers.resources.resources_server import create_resources_app

    settings = dict(spec.settings)
    root = settings.get("snapshot_root")
    final_states = settings.get("final_states_dir")
    return create_resources_app(
        str(settings["environment"]),
        name=str(settings.get("name", "resources")),
        replica=str(settings.get("replica", "replica-0")),
        snapshot_root=None if root is None else str(root),
        final_states_dir=None if final_states is None else Path(str(final_states)),
        clock_skew_s=float(str(settings.get("clock_skew_s", 0.0))),
        journal=settings.get("journal") is True,
        journal_window_s=float(str(settings.get("journal_window_s", 0.002))),
    )


def bind_socket(host: str, port: int, *, owner: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # says TCP, and without it every keep-alive request on loopback waits ~40 ms (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno in (98, 48):  # EADDRINUSE on Linux / macOS
            raise LaunchError(f"{owner}: port {port} on {host} is already in use") from None
        raise LaunchError(f"{owner}: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _LeashedServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT and SIGTERM to its launcher while it lives.

    uvicorn installs its own handlers for both signals while it serves (replacing an
    ignored SIGINT), so ignoring them is done here, in its handler."""

    def __init__(self, config: uvicorn.Config, *, leashed: bool) -> None:
        super().__init__(config)
        self.leashed = leashed
        """True while the launcher holds the other end of stdin (``watch_parent``)."""
        self._parent = os.getppid()

    def launcher_alive(self) -> bool:
        # A launcher that died makes this process an orphan (re-parented) before the EOF
        # may have been read: either sign means nobody will stop us.
        return self.leashed and os.getppid() == self._parent

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.launcher_alive():
            log.info("ignoring signal %d: the launcher stops this server", sig)
            return
        super().handle_exit(sig, frame)


def _watch_stdin(server: _LeashedServer) -> None:
    """Block on stdin; EOF means the launcher stops us or is gone: shut down (hard, if need be)."""
    with contextlib.suppress(Exception):
        while sys.stdin.buffer.read(4096):
            pass
    server.leashed = False
    log.info("standard input closed (the launcher stops this server, or is gone); shutting down")
    server.should_exit = True
    timer = threading.Timer(_SHUTDOWN_GRACE_S, lambda: os._exit(0))
    timer.daemon = True
    timer.start()


def serve(spec: ServerSpec) -> None:
    install_tuning()  # this process's entry point: the fence's checkpoint events are heard
    shorten_thread_switch()  # its control listener's thread gets the GIL within 0.5 ms
    from rollpoint.participant.control_mount import control_listener

    app = build_app(spec)
    listener = control_listener(app)
    if listener is not None:
        listener.host = spec.host  # a client reaches it at the host of the server's URL
    sock = bind_socket(spec.host, spec.port, owner=spec.name)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    server = _LeashedServer(config, leashed=spec.watch_parent)

    async def _main() -> None:
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serve_task.done():
                await serve_task
                raise LaunchError(f"{spec.name}: server stopped during start-up")
            await asyncio.sleep(0.01)
        line = ReadyLine(name=spec.name, url=f"http://{url_host}:{port}", pid=os.getpid())
        sys.stdout.write(line.model_dump_json() + "\n")
        sys.stdout.flush()
        await serve_task

    if spec.watch_parent:
        threading.Thread(target=_watch_stdin, args=(server,), daemon=True).start()
    asyncio.run(_main())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        spec = ServerSpec.model_validate(orjson.loads(args[0]))
        if spec.watch_parent:
            # The launcher owns Ctrl-C and SIGTERM and stops us by closing stdin; a signal
            # to the group before uvicorn's handlers are in place must not end start-up.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve(spec)
    except RollpointError as exc:
        sys.stderr.write(f"error: {exc.message}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
