"""A loopback server that accepts every connection and never answers: the peer that hangs.

Owns a listening socket and a thread that accepts, reads and discards whatever arrives,
holding every connection open until the context ends. Anything that calls it must give up
on its own timeout.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def blackhole() -> Iterator[str]:
    """Its base URL (``http://127.0.0.1:PORT``) while it swallows requests."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    stop = threading.Event()
    held: list[socket.socket] = []

    def swallow() -> None:
        while not stop.is_set():
            readable, _, _ = select.select([listener, *held], [], [], 0.05)
            for sock in readable:
                if sock is listener:
                    held.append(listener.accept()[0])
                    continue
                with contextlib.suppress(OSError):
                    if not sock.recv(65536):
                        held.remove(sock)
                        sock.close()

    thread = threading.Thread(target=swallow, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for sock in [*held, listener]:
            sock.close()
