"""A real two-node Ray cluster on this machine for the ``ray`` tests, started once a session.

The head and a second node are each a ``ray start --block`` (the ``ray`` next to
``sys.executable``) in a session of its own, with one CPU each, no dashboard, a small object
store and a private temp dir, and a token of their own (Ray's token auth). Stopping sends
SIGTERM to each node's process group (``ray start`` takes its node's processes down with
it); whatever is left a few seconds later is SIGKILLed. Tests see the token through the
environment (set when this module is imported), so a ``ray.init`` in the test process
joins this cluster and no other.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import group_members, kill_all, wait_gone

RAY = Path(sys.executable).with_name("ray")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0
OBJECT_STORE_BYTES = 80 * 1024 * 1024
_STARTED = "Ray runtime started"

# Ray reads its auth settings once, when first imported in a process: they must be in this
# process's environment before any test module imports ray, so they are set on import here.
AUTH_ENV = {
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
    "RAY_USAGE_STATS_ENABLED": "0",
}
os.environ.update(AUTH_ENV)


@dataclass(frozen=True)
class RayCluster:
    address: str
    """``host:port`` of the head, for ``ray.init(address=...)`` / ``ray.address`` in a config."""
    nodes: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayNode:
    """One ``ray start --block`` in its own session; its output goes to ``log``."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(RAY), "start", "--block", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def wait_started(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _STARTED not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"ray start did not come up:\n{tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        # A worker node is gone in about a second; the head can take 20 s, so it gets a
        # short grace and then SIGKILL (a test cluster has nothing to save).
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_GRACE_S)
        left = group_members(pgid)
        kill_all(left + ([self.proc.pid] if self.proc.poll() is None else []))
        self.proc.wait()
        wait_gone(left, 5)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    if not RAY.exists():
        pytest.fail(f"{RAY} not found: install the project's dependencies (make test does)")
    # A short path: Ray's unix socket paths live under it and must stay under ~107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rp-ray-"))
    env = dict(os.environ, **AUTH_ENV)
    port = _free_port()
    common = [
        "--num-cpus=1",
        "--disable-usage-stats",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        f"--temp-dir={temp_dir}",
    ]
    nodes: list[RayNode] = []
    try:
        head_args = [
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--include-dashboard=false",
            f"--dashboard-port={_free_port()}",
            *common,
        ]
        nodes.append(RayNode(head_args, env, temp_dir / "head.out"))
        nodes[0].wait_started()
        address = f"127.0.0.1:{port}"
        nodes.append(RayNode([f"--address={address}", *common], env, temp_dir / "node.out"))
        nodes[1].wait_started()
        yield RayCluster(address=address, nodes=len(nodes))
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
