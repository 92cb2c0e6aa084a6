"""The control listener: a participant's control routes served on their own thread, loop and port.

Owns :class:`ControlListener`: a second HTTP listener (uvicorn, on a socket of its own next
to the server's) whose event loop runs in a thread of its own, serving only the control
routes of one :class:`~rollpoint.participant.fence.Fence`, and what each of its routes does
to reach the fence (:func:`listener_handlers`). The server's own port keeps serving the
same routes on the data loop, as before, so every URL that named a control route still
works; the listener's port is reported by ``status`` (``control_port``), and the
coordinator's transport (:class:`~rollpoint.trainer.control.control_transport.HttpControlTransport`)
moves its calls there once it has read it.

Why a second loop: a control round trip on the data loop waits, at every step (the socket
read, the request's task, each await), behind everything the loop has ready, and a model
server releasing 1k-token replies with logprobs has thousands of callbacks ready at once
(issue 37: prepare p99 3.0 s in such bursts). Here the accept, the HTTP parsing, the token
check, the strict body validation and the reply's serialisation (a commit's reply maps
every exported episode) run on the control loop, which has nothing else to do.

What crosses threads, and why (the participant's state is the data loop's and is not
thread-safe: the agent's session book, the gates' :class:`asyncio.Event` objects, the
journals):

- **the verbs that change or read the participant** (prepare, renew, commit, confirm,
  resume, restore, retire, forget, ack) run on the data loop, as one task each
  (:func:`hand_over`: :func:`asyncio.run_coroutine_threadsafe`, ordered). The fence itself
  stays a data-loop object: its lock serialises every transition with the data work its
  hooks touch, its waits (readiness, the capture) are on the data loop's own signals, and
  its hooks run where the participant's state lives (a fence the control thread owned
  would need every participant's hooks thread-safe: the SDK's contract would change).
  The hand-over is the short critical section, and it does not queue: it is put at the
  front of the data loop's ready queue, and so is the task's first step, so a verb whose
  fence work does not suspend (the model server's prepare and resume) runs right after
  the callback the data loop is in, not after the thousands it has ready; the task's
  last step hands the reply back itself (a done callback would queue behind them again).
  A commit's capture runs the same way (:class:`~rollpoint.participant.ready_queue.FrontTask`):
  its first step and the commit's wake-up once it is done run next. The queue is
  asyncio's private one, read defensively (:mod:`rollpoint.participant.ready_queue`); on
  any other loop (uvloop) the hand-over is the public ``call_soon_threadsafe``, behind
  what is ready. A wait inside a verb (a prepare waiting for in-flight work to quiesce,
  as it must; a capture that yields between slices) is an ordinary data-loop wait.
- **status** does not touch the data loop at all (after the first one, below): the fence's
  phase, checkpoint id, lease and retire count are attributes read as they stand, and the
  participant's ``stats()`` is called on this thread (the Participant contract says so:
  counters and sizes, no iteration of what the data loop changes). A ``stats()`` that
  raises here (a dict changed size while it iterated) is called again on the data loop, so
  a participant that is not thread-safe gets a slower status, never a wrong or failed one.
  A status is a momentary read: a transition on the data loop may be half-way (the verbs,
  serialised on the data loop, decide; nothing decides on a status's phase alone). Since
  answering says nothing of the data loop, status carries ``data_loop_quiet_ms``: how long
  the data loop has not run its :class:`Heartbeat` (a hung tool holding it stops the beat;
  the stuck watchdog reads that where it used to read a status that timed out).
- **the first status** (until checkpoints are in use here) runs on the data loop: it tells
  the tuning seam and a capturing participant that checkpoints are in use, which must
  happen on that loop (the fence's first use starts the participant's background sweep
  there). The coordinator's transport reads that first status at the server's URL anyway.

A control call whose client hangs up keeps running on the data loop to its end (shielded),
as it did when the data loop served it. The listener is started by the app's lifespan,
after the server's own start, on the data loop's thread (:func:`control_mount.mount_participant`
wraps the lifespan), and stopped first on shutdown, before the fence closes.

Does not own the fence, the routes' shapes (:mod:`rollpoint.participant.control_routes`), the
token, nor the server's own listener.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

import uvicorn
from pydantic import BaseModel

from rollpoint.http.app import create_app
from rollpoint.participant.control_routes import mount_control_routes
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence import Fence
from rollpoint.participant.fence_verbs import VerbHandler, fence_handlers
from rollpoint.participant.ready_queue import ready_queue, step_next
from rollpoint.protocol.control import StatusReply, Verb
from rollpoint.protocol.errors import ConfigError

__all__ = ["ControlListener", "listener_handlers"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_START_TIMEOUT_S = 10.0
"""Longest a listener may take to start serving (a thread and a bound socket)."""
_STOP_TIMEOUT_S = 5.0
"""Longest a stop waits for the listener's thread (its graceful shutdown is 1 s)."""
BEAT_S = 0.1
"""How often the data loop stamps its :class:`Heartbeat` (one timer wake-up per beat)."""


class Heartbeat:
    """When the data loop last ran: a task on it stamps the time every :data:`BEAT_S`, and
    the control thread reads how long ago that was. Status served off the data loop would
    otherwise answer for a server whose data loop a hung tool holds (the stuck watchdog,
    :mod:`rollpoint.trainer.control.stuck_watch`, reads it from ``data_loop_quiet_ms``)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """On the data loop."""
        self.last = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            self.last = time.monotonic()

    def quiet_ms(self) -> int:
        """Milliseconds since the data loop last stamped (0 within a beat of it)."""
        late = time.monotonic() - self.last - BEAT_S
        return max(0, int(late * 1000))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def listener_handlers(
    fence: Fence, data_loop: asyncio.AbstractEventLoop, heartbeat: Heartbeat | None = None
) -> dict[Verb, VerbHandler]:
    """The handler of every verb as the listener serves it: status read on the calling
    (control) thread, every other verb run on ``data_loop`` (see the module docstring);
    with ``heartbeat``, status says how long the data loop has been quiet."""
    on_data_loop = fence_handlers(fence)

    def hop(handler: VerbHandler) -> VerbHandler:
        async def call(body: Any) -> BaseModel:
            done = hand_over(data_loop, _coroutine(handler, body))
            # Shielded: a client that hangs up does not cancel the fence's work, as a
            # request on the data loop ran to its end after its client left.
            return await asyncio.shield(asyncio.wrap_future(done))

        return call

    async def status(_: None) -> BaseModel:
        if not fence.in_use:  # its first use happens on the data loop (module docstring)
            return await hop(on_data_loop[Verb.STATUS])(None)
        try:
            counts = fence.participant_stats()
        except Exception as exc:  # not thread-safe: read it where its state lives
            log.info("status: stats() failed off the data loop (%s); read on it", exc)
            reply = await hop(on_data_loop[Verb.STATUS])(None)
            assert isinstance(reply, StatusReply)
            return reply
        reply = fence.status(counts=counts)
        if heartbeat is None:
            return reply
        return reply.model_copy(update={"data_loop_quiet_ms": heartbeat.quiet_ms()})

    handlers = {verb: hop(handler) for verb, handler in on_data_loop.items()}
    handlers[Verb.STATUS] = status
    return handlers


def hand_over(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]
) -> concurrent.futures.Future[T]:
    """Run ``coro`` on ``loop`` (another thread's) as a task, its result in the future
    returned: :func:`asyncio.run_coroutine_threadsafe`, with the hand-over and the task's
    first step put at the front of the loop's ready queue, not behind everything the loop
    has ready (see the module docstring), and the future settled by the task's last step
    (a done callback would wait behind the ready queue once more). On a loop without that
    queue (uvloop), the same through the public API: behind what is ready."""
    out: concurrent.futures.Future[T] = concurrent.futures.Future()

    def start() -> None:
        if not out.set_running_or_notify_cancel():
            coro.close()
            return
        task = loop.create_task(_settling(coro, out))
        step_next(loop)
        # Only for a task cancelled before its first step (the loop shutting down): its
        # coroutine never ran to settle ``out``. Otherwise ``out`` is settled already.
        task.add_done_callback(partial(_cancelled_unsettled, out))

    if loop.is_closed():
        coro.close()
        raise RuntimeError("the data loop is closed")
    ready, wake = ready_queue(loop)
    if ready is None or wake is None:
        loop.call_soon_threadsafe(start)
    else:
        ready.appendleft(asyncio.Handle(start, (), loop))  # deque ops are atomic
        wake()  # the loop may be waiting in select(): wake it, as call_soon_threadsafe does
    return out


def _cancelled_unsettled(out: concurrent.futures.Future[T], task: asyncio.Task[None]) -> None:
    if not out.done():
        out.set_exception(asyncio.CancelledError())


async def _settling(coro: Coroutine[Any, Any, T], out: concurrent.futures.Future[T]) -> None:
    """``coro``, its outcome handed to ``out`` (a thread-safe future) as its last step."""
    try:
        result = await coro
    except asyncio.CancelledError:
        out.set_exception(asyncio.CancelledError())  # a running future cannot be cancelled
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # delivered through ``out``: the task ends quietly
        out.set_exception(exc)
    else:
        out.set_result(result)


def _coroutine(handler: VerbHandler, body: Any) -> Coroutine[Any, Any, BaseModel]:
    async def run() -> BaseModel:
        return await handler(body)

    return run()


class ControlListener:
    """The control routes of ``fence`` on ``host`` (port 0: a free one), on their own
    thread and loop. :meth:`start` on the data loop; :meth:`aclose` when the app stops."""

    def __init__(self, fence: Fence, settings: ControlSettings, *, host: str = "127.0.0.1") -> None:
        self.fence = fence
        self.host = host
        """Where to listen; set it before :meth:`start` (the process entry point binds it
        on the server's own host, so a wildcard bind is reachable where the server is)."""
        self._settings = settings
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._failure: BaseException | None = None
        self._heartbeat = Heartbeat()

    @property
    def port(self) -> int | None:
        """The port it listens on; None before :meth:`start` and after :meth:`aclose`."""
        return None if self._sock is None else int(self._sock.getsockname()[1])

    def start(self) -> None:
        """Bind, start the thread, return once it serves. Call on the data loop (the loop
        the verbs are handed to)."""
        if self._thread is not None:
            return
        data_loop = asyncio.get_running_loop()
        self._heartbeat.start()
        app = create_app(f"{self.fence.instance} control")
        handlers = listener_handlers(self.fence, data_loop, self._heartbeat)
        mount_control_routes(app, self.fence, self._settings, handlers=handlers)
        sock = _bind(self.host)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop="asyncio",
            timeout_graceful_shutdown=1,
        )
        started = threading.Event()
        server = _Server(config, started)
        self._sock, self._server = sock, server

        def serve() -> None:
            try:
                asyncio.run(server.serve(sockets=[sock]))
            except BaseException as exc:
                self._failure = exc
                log.exception("the control listener of %s stopped", self.fence.instance)
            finally:
                started.set()

        thread = threading.Thread(
            target=serve, name=f"rollpoint-control-{self.fence.instance}", daemon=True
        )
        self._thread = thread
        thread.start()
        # A blocking wait, once, at start-up (the data loop serves nothing yet).
        if not started.wait(_START_TIMEOUT_S) or not server.started:
            server.should_exit = True
            raise ConfigError(
                f"{self.fence.instance}: the control listener on {self.host} did not start"
                + (f": {self._failure}" if self._failure is not None else "")
            )
        self.fence.control_port = self.port
        log.info("%s: control routes also on port %s", self.fence.instance, self.port)

    async def aclose(self) -> None:
        """Stop listening and wait for the thread (calls in flight get their answer)."""
        server, thread, sock = self._server, self._thread, self._sock
        self._server = self._thread = self._sock = None
        self.fence.control_port = None
        self._heartbeat.stop()
        if server is None or thread is None:
            return
        server.should_exit = True
        await asyncio.to_thread(thread.join, _STOP_TIMEOUT_S)
        if sock is not None:
            sock.close()


class _Server(uvicorn.Server):
    """A uvicorn server that says when it serves (``started`` is set by its start-up)."""

    def __init__(self, config: uvicorn.Config, started: threading.Event) -> None:
        super().__init__(config)
        self._serving = started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self._serving.set()


def _bind(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # says TCP (without it a keep-alive request on loopback waits ~40 ms for Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.bind((host.strip("[]"), 0))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"control listener: cannot listen on {host}: {exc.strerror}") from None
    sock.listen(128)
    return sock
