"""Entry point of one server process: ``python -m rollpoint.runtime.server_process SPEC_JSON``.

Builds the app the spec names, binds its socket itself (port 0 → a free port, no race
with other launches), prints one :class:`ReadyLine` on stdout, and serves until told to
stop. With ``watch_parent`` it also exits when its standard input reaches EOF — which
happens when the launcher dies for any reason, SIGKILL included — so a killed
``rollpoint run`` never leaves servers behind.
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

import orjson
import uvicorn
from fastapi import FastAPI

from rollpoint.protocol.errors import LaunchError, RollpointError
from rollpoint.runtime.server_spec import ReadyLine, ServerSpec

log = logging.getLogger("rollpoint.server")

# How long a graceful shutdown may take before the process exits hard.
_SHUTDOWN_GRACE_S = 3.0


def build_app(spec: ServerSpec) -> FastAPI:
    """The app for ``spec.kind``; imports stay local so each process loads only its server."""
    if spec.kind == "policy":
        from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app

        return create_policy_app(PolicySettings.model_validate(spec.settings))
    if spec.kind == "model":
        from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app

        return create_model_app(ModelServerSettings.model_validate(spec.settings))
    if spec.kind == "agent":
        from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app

        return create_agent_app(AgentSettings.model_validate(spec.settings))
    from rollpoint.servers.resources.resources_server import create_resources_app

    settings = dict(spec.settings)
    root = settings.get("snapshot_root")
    return create_resources_app(
        str(settings["environment"]),
        name=str(settings.get("name", "resources")),
        replica=str(settings.get("replica", "replica-0")),
        snapshot_root=None if root is None else str(root),
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


def _watch_stdin(server: uvicorn.Server) -> None:
    """Block on stdin; EOF means the launcher is gone, so shut down (hard, if need be)."""
    with contextlib.suppress(Exception):
        while sys.stdin.buffer.read(4096):
            pass
    log.warning("launcher went away; shutting down")
    server.should_exit = True
    timer = threading.Timer(_SHUTDOWN_GRACE_S, lambda: os._exit(0))
    timer.daemon = True
    timer.start()


def serve(spec: ServerSpec) -> None:
    app = build_app(spec)
    sock = bind_socket(spec.host, spec.port, owner=spec.name)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)

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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C; it stops us by SIGTERM
    try:
        spec = ServerSpec.model_validate(orjson.loads(args[0]))
        serve(spec)
    except RollpointError as exc:
        sys.stderr.write(f"error: {exc.message}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
