"""Server processes forked from one pre-imported parent: a launcher's warm start.

Owns the *zygote* — one process per launcher's group of servers that imports what every
server process needs (FastAPI, uvicorn, pydantic, aiohttp, the built-in servers) once, then
forks a server for each request — and, on the launcher's side, :class:`WarmStarter`, which
starts the zygote and asks it for servers, and :class:`ForkedProcess`, one such server's
handle: the part of :class:`asyncio.subprocess.Process` a group uses.

Why: each server process used to import all of that itself, most of the 0.59-0.70
CPU-seconds its start and stop cost; forked, they cost 0.10-0.12 (the scripted policy,
which spends its start building its app, 0.32), plus the zygote's imports once a group
(docs/log/suite-2026-12.md). A ``rollpoint run`` of two replicas starts
seven, a chaos trial fourteen, the test suite thousands. Forked, a server starts with the
modules imported, their pages shared copy-on-write and kept out of its collector's way
(:func:`gc.freeze`, as the :mod:`gc` documentation advises for a fork without exec).

What a forked server keeps of an exec'd one:

- **Its standard streams are pipes the launcher made**, sent with the request
  (``SCM_RIGHTS``). Standard input is still the leash (:mod:`.server_process`): the zygote
  never holds its write end, so the launcher's death, SIGKILL included, still closes it.
- **Its environment** is the one the launcher asked for: the zygote's child replaces
  ``os.environ`` before any server code runs. (What a module read from the environment
  as the zygote imported it is the launcher's environment as the group started: the
  same, but for a variable changed in the launcher meanwhile.)
- **Its command line**, as ``ps`` and ``/proc/PID/cmdline`` show it, reads as an exec'd
  server's (``python -m rollpoint.runtime.server_process SPEC``), set with
  :mod:`setproctitle`: operators and tools find a server by its spec, as before.
- **Its exit status**: the zygote is its parent, reaps it and reports it, and
  :attr:`ForkedProcess.returncode` gives it as asyncio would (negative: the signal). If
  the zygote itself is gone, a server's exit is still seen (a pidfd) but its status is
  not: 255, as asyncio reports a child it could not wait for.
- **Its process group**: the zygote is the launcher's child, in its group, so a signal to
  the group reaches the zygote and every server as before. The zygote ignores SIGINT and
  SIGTERM; it exits when its own standard input closes (the launcher stopping the group,
  or dying). It never starts a thread or an event loop, so forking it is safe; a server's
  parent is the zygote, so a server whose zygote is gone takes itself for an orphan
  (:meth:`.server_process._LeashedServer.launcher_alive`), as it is.

``ROLLPOINT_WARM_START=0`` turns it off; without ``fork`` or fd passing (not Linux) it is
off. Off, a group execs each server, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from rollpoint.protocol.errors import LaunchError

log = logging.getLogger(__name__)

WARM_START_ENV = "ROLLPOINT_WARM_START"
"""``0``: every server process is exec'd and imports what it needs itself."""

PRELOAD = (
    "rollpoint.runtime.server_process",
    "rollpoint.participant.control_mount",
    "rollpoint.policy.scripted_policy",
    "rollpoint.servers.model.model_server",
    "rollpoint.servers.agent.agent_server",
    "rollpoint.servers.resources.resources_server",
)
"""What the zygote imports before its first fork: every built-in server's module (and so
FastAPI, uvicorn, pydantic, aiohttp and the SDK). An environment's own package is imported
by the server that runs it, after the fork."""

_MAX_MESSAGE = 1 << 20
"""A request (the spec and the environment, JSON) or a report; datagrams, never split."""
_UNKNOWN_STATUS = 255
"""The status of a server whose zygote was gone before it exited (asyncio's convention)."""


def enabled() -> bool:
    """Whether a launcher forks its servers from a zygote (see the module docstring)."""
    if os.environ.get(WARM_START_ENV, "1").strip() in ("0", "false", "no", "off"):
        return False
    return hasattr(os, "fork") and hasattr(socket, "send_fds") and sys.platform == "linux"


class _Leash:
    """A forked server's standard input as the launcher holds it: only ever closed."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class ForkedProcess:
    """A server the zygote forked, as a launcher sees it: the members of
    :class:`asyncio.subprocess.Process` a group uses."""

    def __init__(
        self,
        pid: int,
        stdin: _Leash,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
    ) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfd: int | None = None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)  # as asyncio does: the pid may be reused
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        """The zygote reaped it (or, without a zygote, it is gone: ``code`` 255)."""
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)
        self._unwatch()

    def watch_without_parent(self) -> None:
        """The zygote is gone: learn of this server's exit from a pidfd, status unknown."""
        if self.returncode is not None or self._pidfd is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:  # gone already
            self.exited(_UNKNOWN_STATUS)
            return
        loop.add_reader(self._pidfd, self.exited, _UNKNOWN_STATUS)

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            pidfd, self._pidfd = self._pidfd, None
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)


class WarmStarter:
    """One launcher's zygote: started at the first :meth:`spawn`, stopped by
    :meth:`aclose` (or by the launcher's death). ``env``: the zygote's environment (each
    server's comes with its request)."""

    def __init__(self, log_path: Path, env: dict[str, str]) -> None:
        self._log_path = log_path
        self._env = env
        self._zygote: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._lock = asyncio.Lock()
        self._gone = False

    async def spawn(self, spec_json: str, env: dict[str, str]) -> ForkedProcess:
        """A server forked for ``spec_json`` (the argument of
        ``python -m rollpoint.runtime.server_process``) with ``env`` as its environment."""
        async with self._lock:
            if self._sock is None:
                await self._start()
            assert self._sock is not None
            if self._gone:
                raise LaunchError(f"the server zygote has exited (log: {self._log_path})")
            request = json.dumps({"spec": spec_json, "env": env}).encode()
            stdin_r, stdin_w = os.pipe()
            stdout_r, stdout_w = os.pipe()
            stderr_r, stderr_w = os.pipe()
            try:
                await _send_with_fds(self._sock, request, [stdin_r, stdout_w, stderr_w])
            except OSError as exc:
                for fd in (stdin_w, stdout_r, stderr_r):
                    os.close(fd)
                raise LaunchError(f"cannot reach the server zygote: {exc}") from None
            finally:
                for fd in (stdin_r, stdout_w, stderr_w):
                    os.close(fd)
            reply = await self._replies.get()
            if "started" not in reply:
                for fd in (stdin_w, stdout_r, stderr_r):
                    os.close(fd)
                why = reply.get("failed", f"it exited (log: {self._log_path})")
                raise LaunchError(f"the server zygote could not start a server: {why}")
            process = ForkedProcess(
                int(reply["started"]),
                _Leash(stdin_w),
                await _reader_of(stdout_r),
                await _reader_of(stderr_r),
            )
            self._children[process.pid] = process
            if process.pid in self._early_exits:
                process.exited(self._early_exits.pop(process.pid))
            return process

    async def aclose(self) -> None:
        """Stop the zygote (its servers are stopped by their own leashes, not by this); a
        later :meth:`spawn` starts another."""
        zygote, reader, sock = self._zygote, self._reader, self._sock
        self._zygote = self._reader = self._sock = None
        if zygote is not None:
            if zygote.stdin is not None:
                zygote.stdin.close()
            try:
                await asyncio.wait_for(zygote.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    zygote.kill()
                await zygote.wait()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if sock is not None:
            sock.close()
        self._replies = asyncio.Queue()
        self._gone = False

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._log_path.open("ab") as log_file:
            try:
                self._zygote = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    __name__,
                    str(theirs.fileno()),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=log_file,
                    pass_fds=(theirs.fileno(),),
                    env=dict(os.environ, **self._env),
                )
            finally:
                theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._reader = asyncio.create_task(self._read_reports(), name="server zygote reports")

    async def _read_reports(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(self._sock, _MAX_MESSAGE):
                report = json.loads(data)
                if "exited" in report:
                    pid, code = int(report["exited"]), int(report["code"])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early_exits[pid] = code  # before its "started" was read
                    else:
                        child.exited(code)
                else:
                    self._replies.put_nowait(report)
        except OSError:
            pass
        finally:
            # The zygote is gone: a spawn waiting for its reply fails, and each server
            # still running is watched without it.
            self._gone = True
            self._replies.put_nowait({"failed": f"it exited (log: {self._log_path})"})
            for child in self._children.values():
                child.watch_without_parent()


async def _send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            socket.send_fds(sock, [data], fds)
            return
        except BlockingIOError:
            writable = loop.create_future()
            loop.add_writer(sock, writable.set_result, None)
            try:
                await writable
            finally:
                loop.remove_writer(sock)


async def _reader_of(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    pipe = os.fdopen(fd, "rb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    return reader


# -- the zygote's side ------------------------------------------------------------------


def _zygote(fd: int) -> int:
    """The zygote's loop: preload, then fork a server per request and report every exit.
    In a forked child it does not return: the server runs, and its exit status leaves the
    interpreter as a ``SystemExit`` (so atexit and thread joins run as in any process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.disable()  # no collection holes in the pages the servers will share
    sock = socket.socket(fileno=fd)
    for module in PRELOAD:
        try:
            __import__(module)
        except Exception as exc:  # the server that needs it fails, in its own words
            print(f"server zygote: not preloaded: {module}: {exc!r}", file=sys.stderr)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)  # its wake-up byte is the point
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "leash")
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    while True:
        for key, _ in selector.select():
            if key.data == "leash":
                if not os.read(sys.stdin.fileno(), 4096):
                    return 0  # the launcher stops us, or is gone
            elif key.data == "child":
                os.read(wake_r, 4096)
                _reap(sock)
            else:
                message, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
                if not message:
                    return 0
                inherited = (wake_r, wake_w, selector.fileno())
                _fork(sock, json.loads(message), fds, inherited=inherited)
                _reap(sock)  # one that died at once: its SIGCHLD may be in already


def _fork(
    sock: socket.socket, request: dict[str, Any], fds: list[int], inherited: tuple[int, ...]
) -> None:
    gc.freeze()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"failed": f"fork: {exc.strerror}"}).encode())
        return
    if pid == 0:
        _become_server(request, fds, closing=(sock.fileno(), *inherited))
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps({"started": pid}).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
            sock.send(
                json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode()
            )


def _become_server(request: dict[str, Any], fds: list[int], closing: tuple[int, ...]) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd in closing:
        os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    # Unbuffered, as PYTHONUNBUFFERED makes an exec'd server's: its log lines and its
    # ready line reach the launcher as they are written.
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    spec = str(request["spec"])
    import setproctitle

    # Before the environment changes: it finds the room for the title from the original
    # environment's place in memory (after the command line).
    setproctitle.setproctitle(f"{sys.executable} -m rollpoint.runtime.server_process {spec}")
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", spec]
    gc.enable()
    from rollpoint.runtime import server_process

    raise SystemExit(server_process.main([spec]))


if __name__ == "__main__":
    raise SystemExit(_zygote(int(sys.argv[1])))
