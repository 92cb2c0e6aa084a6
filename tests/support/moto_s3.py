"""An S3-compatible store on loopback for tests: moto's threaded S3 server and one bucket.

Owns starting the server on a free port of 127.0.0.1, pointing the standard AWS settings
at it (what an operator sets for any S3-compatible store; child processes inherit them),
emptying the bucket (moto keeps buckets in the test process, across servers) and stopping
the server. A test that uses it skips when ``moto[server]`` or ``s3fs`` is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def moto_s3(monkeypatch: pytest.MonkeyPatch, bucket: str) -> Iterator[Any]:
    """The server running with ``bucket`` empty; yields an s3fs client of it."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is a dev dependency")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is the s3 extra")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "rollpoint",
        "AWS_SECRET_ACCESS_KEY": "rollpoint",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if fs.exists(bucket):
        fs.rm(bucket, recursive=True)
    fs.mkdir(bucket)
    # fsspec caches filesystem instances: what opens the store must see this server's settings.
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield fs
    finally:
        server.stop()
