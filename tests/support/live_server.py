"""One real uvicorn server in a background thread, for integration tests on loopback: the
test kit's :class:`~rollpoint.testing.local_cluster.ThreadServer`, as a context manager
yielding its URL (the servers of a whole replica set: :class:`~rollpoint.testing.LocalCluster`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI

from rollpoint.testing.local_cluster import ThreadServer


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on a free port of 127.0.0.1; yield its base URL; shut it down on exit."""
    server = ThreadServer(app)
    try:
        yield server.url
    finally:
        server.stop()
