"""One ``rollpoint serve --json`` as a child process: its deployment line, then a clean stop.

Owns the workplace config such tests serve (:func:`workplace_serve_config`), starting the
command in its own session, reading the one JSON line it prints (the
replicas' URLs and the token files) and stopping the whole process group on the way out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import yaml


def workplace_serve_config(
    folder: Path, *, tasks: int, group_size: int, latency_ms: int
) -> tuple[Path, Path]:
    """(the config ``rollpoint serve`` is given, the servers' workdir): two replicas of the
    workplace environment, a scripted policy of ``latency_ms`` a call that never errs."""
    servers = folder / "servers"
    servers.mkdir()
    config = folder / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workdir": str(servers),
                "environment": "workplace",
                "tasks": tasks,
                "group_size": group_size,
                "replicas": 2,
                "policy": {"latency_ms": latency_ms, "error_rate": 0},
            }
        )
    )
    return config, servers


@contextmanager
def served(config: Path, *args: str) -> Iterator[dict[str, Any]]:
    """The deployment ``rollpoint serve CONFIG --json`` printed, while it serves."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollpoint", "serve", str(config), "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"rollpoint serve printed nothing: {proc.communicate(timeout=20)[1]}"
        doc: dict[str, Any] = orjson.loads(line)
        yield doc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
