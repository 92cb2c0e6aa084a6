"""Child server processes of one launcher: start them, learn their URLs, stop them all.

Owns process lifetimes only. Each child gets a pipe on stdin that it watches (see
:mod:`rollpoint.runtime.server_process`), so if this process dies — even by SIGKILL — the
children notice EOF and exit within seconds. The same pipe is how they are stopped:
:meth:`ProcessGroup.stop` closes it (a child that watches it ignores SIGINT and SIGTERM while
this process lives, so a signal to the whole process group leaves the servers serving until
the launcher is done with them), waits, then SIGKILLs stragglers: no orphans on a normal
exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from rollpoint.protocol.errors import LaunchError
from rollpoint.runtime import warm_start
from rollpoint.runtime.server_spec import ReadyLine, ServerSpec
from rollpoint.runtime.warm_start import ForkedProcess, WarmStarter

log = logging.getLogger(__name__)


@dataclass
class ChildServer:
    spec: ServerSpec
    process: asyncio.subprocess.Process | ForkedProcess
    """Exec'd, or forked from the group's zygote (:mod:`rollpoint.runtime.warm_start`)."""
    log_path: Path
    url: str = ""
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


class ProcessGroup:
    """The server processes one launcher started, in start order."""

    def __init__(
        self, log_dir: Path, *, start_timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> None:
        self._log_dir = log_dir
        self._env = env or {}
        self._start_timeout_s = start_timeout_s
        self.children: list[ChildServer] = []
        self._pumps: list[asyncio.Task[None]] = []
        self._warm = (
            WarmStarter(log_dir / "server-zygote.log", self._env) if warm_start.enabled() else None
        )

    @property
    def env(self) -> dict[str, str]:
        """What every child gets on top of this process's environment (tokens)."""
        return dict(self._env)

    async def start(self, specs: list[ServerSpec]) -> list[ChildServer]:
        """Start every spec at once and wait until all report ready (or fail with the reason)."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        started = [await self._spawn(spec) for spec in specs]
        await asyncio.gather(*(self._await_ready(child) for child in started))
        return started

    async def _spawn(self, spec: ServerSpec) -> ChildServer:
        log_path = self._log_dir / f"{spec.name}.log"
        # Secrets (the control token) travel by environment, never on the command line.
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self._env)
        process: asyncio.subprocess.Process | ForkedProcess
        if self._warm is not None:
            process = await self._warm.spawn(spec.model_dump_json(), env)
        else:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "rollpoint.runtime.server_process",
                spec.model_dump_json(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
        child = ChildServer(spec=spec, process=process, log_path=log_path)
        self.children.append(child)
        self._pumps.append(asyncio.create_task(self._pump_stderr(child)))
        return child

    async def _pump_stderr(self, child: ChildServer) -> None:
        """Copy the child's stderr to its log file, keeping a tail for error messages."""
        assert child.process.stderr is not None
        with child.log_path.open("ab") as out:
            while line := await child.process.stderr.readline():
                out.write(line)
                out.flush()
                child.stderr_tail.append(line.decode(errors="replace").rstrip())

    async def _await_ready(self, child: ChildServer) -> None:
        assert child.process.stdout is not None
        try:
            raw = await asyncio.wait_for(child.process.stdout.readline(), self._start_timeout_s)
        except TimeoutError:
            raise LaunchError(
                f"{child.spec.name} did not start within {self._start_timeout_s:.0f}s (log: {child.log_path})"
            ) from None
        if not raw:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.process.wait(), 5)
            await asyncio.sleep(0.05)  # let the stderr pump catch the last lines
            reason = _last_error_line(child.stderr_tail) or f"exit code {child.process.returncode}"
            raise LaunchError(
                f"{child.spec.name} failed to start: {reason} (log: {child.log_path})"
            )
        child.url = ReadyLine.model_validate_json(raw).url

    async def kill_unlisted(self, child: ChildServer) -> ServerSpec:
        """SIGKILL one child without the group ever listing it dead (a supervisor sees no
        replica go down), and return the spec that starts it again, empty, on the address it
        had: with :meth:`start`, what a container restarted behind a stable service address
        looks like. For fault injection."""
        port = urlsplit(child.url).port
        self.children.remove(child)
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGKILL)
        await child.process.wait()
        return child.spec.model_copy(update={"port": port})

    def dead(self) -> list[ChildServer]:
        return [c for c in self.children if not c.alive]

    async def stop_children(self, children: list[ChildServer], timeout_s: float = 5.0) -> None:
        """Stop some children (SIGKILL: they are being replaced) and forget them."""
        for child in children:
            if child.alive:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
        for child in children:
            await child.process.wait()
            if child.process.stdin is not None:
                child.process.stdin.close()
            self.children.remove(child)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Close every child's stdin (SIGTERM to one that does not watch it), wait, SIGKILL
        what is left; safe to call twice."""
        for child in self.children:
            if not child.alive:
                continue
            if child.spec.watch_parent and child.process.stdin is not None:
                child.process.stdin.close()
            else:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        # One deadline for all (they stop side by side): a preempted run's grace counts it.
        waits = [asyncio.ensure_future(c.process.wait()) for c in self.children]
        if waits:
            await asyncio.wait(waits, timeout=timeout_s)
        for child, wait in zip(self.children, waits, strict=True):
            if not wait.done():
                log.warning("%s did not stop within %.0fs; killing it", child.spec.name, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
            await wait
            if child.process.stdin is not None:
                child.process.stdin.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._pumps.clear()
        if self._warm is not None:
            await self._warm.aclose()


def _last_error_line(tail: deque[str]) -> str:
    for line in reversed(tail):
        if line.startswith("error: "):
            return line.removeprefix("error: ")
    for line in reversed(tail):
        if line.strip():
            return line.strip()
    return ""
