"""The OpenEnv server an ``openenv:`` reference names, started by this process or reached at a URL.

Owns :func:`server_url` (the base URL of a reference's server, waiting for its ``/health``),
the child process that serves an app reference (``openenv:<module>:<attr>``: started once
per process on a free loopback port, ended with that process even by SIGKILL, as it watches
a pipe from its parent), and :func:`import_app`, which imports the app without gradio
unless something needs it. The environments themselves are
:mod:`rollpoint.envs.openenv_env`'s.
"""

from __future__ import annotations

import importlib
import os
import select
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from rollpoint.protocol.errors import ConfigError

_START_TIMEOUT_S = 60.0


# ---- the server a reference names ------------------------------------------------------
class _LocalServer:
    """An OpenEnv app served by a child process of this one on a free loopback port."""

    def __init__(self, app: str, ref: str) -> None:
        # The child reads the pipe's other end: end of file (this process gone, however it
        # ended) makes it exit, so no environment server outlives the process that played it.
        read_end, self._lifeline = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, app, str(read_end)],
            stdout=subprocess.PIPE,
            stderr=None,
            pass_fds=(read_end,),
            env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])},
        )
        os.close(read_end)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], _START_TIMEOUT_S)
        line = self.proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("port "):
            self.proc.kill()
            self.proc.wait(10)
            why = f"exit {self.proc.returncode}" if ready else f"not up in {_START_TIMEOUT_S:.0f}s"
            raise ConfigError(
                f"environment {ref!r}: the OpenEnv server {app} did not start"
                f" ({why}; its error is in the log above)"
            )
        self.url = f"http://127.0.0.1:{int(line.removeprefix('port '))}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        os.close(self._lifeline)


_SERVERS: dict[str, _LocalServer] = {}
_SERVERS_LOCK = threading.Lock()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def server_url(target: str, ref: str) -> str:
    """The base URL of the server ``target`` names, started here first if it is an app."""
    if target.startswith(("http://", "https://")):
        return target.rstrip("/")
    with _SERVERS_LOCK:
        server = _SERVERS.get(target)
        if server is None:
            server = _SERVERS[target] = _LocalServer(target, ref)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _healthy(server.url):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise ConfigError(f"environment {ref!r}: the OpenEnv server {target} is not healthy")
        time.sleep(0.05)
    return server.url


_CHILD = (
    "import sys; from rollpoint.envs.openenv_server import serve;"
    " serve(sys.argv[1], int(sys.argv[2]))"
)


def import_app(app_path: str) -> Any:
    """The app ``module:attr`` names, imported without gradio unless something needs it.

    ``openenv.core.env_server`` imports its web interface, and gradio with it, whenever it is
    imported (8 of the 15 s the echo server took to import on a loaded machine; over a minute
    at load 40), and does without it when gradio is not installed. The server only uses it
    with ``ENABLE_WEB_INTERFACE`` set. So, unless that is set, gradio reads as not installed
    while the app is imported; an app that imports gradio itself is imported again with it."""
    module_name, _, attr = app_path.partition(":")
    web = os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes")
    if web or "gradio" in sys.modules:
        return getattr(importlib.import_module(module_name), attr)
    sys.modules["gradio"] = None  # type: ignore[assignment]  # "import gradio" fails: not installed
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != "gradio":
            raise
        module = None
    finally:
        del sys.modules["gradio"]
    if module is None:
        module = importlib.import_module(module_name)
    return getattr(module, attr)


def serve(app_path: str, lifeline: int) -> None:
    """The child: import the app, bind a free loopback port, say it, serve until the parent
    is gone."""
    import socket

    import uvicorn

    app = import_app(app_path)

    def watch() -> None:
        os.read(lifeline, 1)  # returns at end of file: the parent is gone
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"port {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
