"""A run through an engine that returns text and logprobs but no token ids (llama.cpp's
server's wire, from a local peer), with token capture on: with the generation cut on (the
default) every trained reply holds exactly the text, finish reason and usage the engine
sent, as with the cut off, and each turn keeps the engine's token strings and logprobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rollpoint import parse_config
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.token_data import as_float32
from rollpoint.trainer.train_hooks import TrainSample
from tests.integration.test_token_capture import ledger, rows, run, stack
from tests.support.embedded_job import embedded_job
from tests.support.llama_cpp_peer import LlamaCppPeer, llama_cpp_peer
from tests.support.run_process import RunProcess

pytestmark = pytest.mark.integration


class Recording(SimulatedTrainer):
    """The simulated trainer, keeping every sample it trained on."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.samples: list[TrainSample] = []

    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        self.samples.extend(batch)
        return await super().train_step(step, batch)


async def trained(tmp_path: Path, peer: LlamaCppPeer, cut: bool) -> tuple[Recording, list[Any]]:
    config = parse_config(
        {
            "workdir": str(tmp_path / f"run-{cut}"),
            "environment": "workplace",
            "tasks": 4,
            "group_size": 2,
            "max_turns": 2,
            "replicas": 1,
            "concurrency": 4,
            "policy": {
                "base_url": peer.url + "/v1",
                "model": "smollm2",
                "capture_tokens": True,
                "generation_cut": cut,
                # No logprobs asked: token capture asks for them (and for top_logprobs,
                # without which llama.cpp sends none).
                "sampling": {"max_tokens": 6},
            },
            "train": {"batch_size": 4},
        }
    )
    config.workdir.mkdir(parents=True)
    hooks = Recording()
    async with embedded_job(config, hooks=hooks) as job:
        await job.trainer.run()
        return hooks, job.train_rows()


@pytest.mark.parametrize("cut", [True, False])
async def test_every_trained_reply_is_the_engines_own(tmp_path: Path, cut: bool) -> None:
    with llama_cpp_peer() as peer:
        hooks, lines = await trained(tmp_path, peer, cut)
    assert len(hooks.samples) == len(lines) == 8
    by_rollout = {line["rollout_id"]: line for line in lines}
    calls = 0
    for sample in hooks.samples:
        line = by_rollout[sample.rollout_id]
        said = [m for m in line["messages"] if m["role"] == "assistant"]
        assert len(said) == len(sample.model_calls) == len(line["turns"])
        for call, message, turn in zip(sample.model_calls, said, line["turns"], strict=True):
            assert call.completion_id is not None
            sent = peer.replies[call.completion_id]
            assert message["content"] == call.response["content"] == sent["text"]
            assert call.finish_reason == turn["finish_reason"] == sent["finish_reason"]
            usage = sent["usage"]
            assert (call.prompt_tokens, call.completion_tokens) == (
                usage["prompt_tokens"],
                usage["completion_tokens"],
            )
            # Asked plain, answered plain: the cut did not stream it (the engine has no ids).
            assert sent["streamed"] is False
            # No ids, but the engine's token strings and logprobs, one per token.
            assert turn["completion_token_ids"] is None and call.tokens is None
            tokens = [token for token, _ in sent["tokens"]]
            assert turn["completion_token_strings"] == tokens
            assert turn["completion_logprobs"] == as_float32(lp for _, lp in sent["tokens"])
            calls += 1
    assert calls >= 8


async def test_a_stream_the_engine_cut_short_is_a_failed_call_never_a_turn() -> None:
    """The model server forced to stream (the cut on, as before the start check decided it)
    in front of an engine that ends a stream early when another request waits: what was
    cut short fails its call as a transport error (the row is re-sent); nothing truncated
    or empty is filed or handed to the agent."""
    async with httpx.AsyncClient(timeout=60) as http:
        with llama_cpp_peer(token_delay_s=0.02) as peer, stack(peer.url, cut=True) as (m, agent):
            results = await run(http, agent, rows(8, "short"))
            filed = [
                call for r in results for call in await ledger(http, m, r["episode"]["rollout_id"])
            ]
    assert peer.interrupted > 0  # the engine did cut streams short
    failed = [r for r in results if r["kind"] == "failed"]
    assert failed and all(r["transport"] for r in failed), failed
    assert all("stream ended before choice 0 finished" in r["message"] for r in failed)
    for result in results:
        for call in result.get("model_calls", ()):
            sent = peer.replies[call["completion_id"]]
            assert call["response"]["content"] == sent["text"]
            assert call["finish_reason"] == sent["finish_reason"]
    for call in filed:
        sent = peer.replies[call["completion_id"]]
        assert (call["response"]["content"], call["finish_reason"]) == (
            sent["text"],
            sent["finish_reason"],
        )


def test_the_run_says_once_that_the_engine_gives_no_ids(tmp_path: Path) -> None:
    with llama_cpp_peer() as peer:
        config = tmp_path / "job.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "workdir": str(tmp_path / "run"),
                    "environment": "workplace",
                    "tasks": 2,
                    "group_size": 2,
                    "max_turns": 2,
                    "replicas": 1,
                    "policy": {
                        "base_url": peer.url + "/v1",
                        "model": "smollm2",
                        "capture_tokens": True,
                    },
                    "train": {"batch_size": 4},
                }
            )
        )
        done = RunProcess(config).finish()
    assert done.returncode == 0, done.stderr[-3000:]
    # The library logs it; the CLI shows the library's warnings: one line, not two.
    assert done.stderr.count("returns no token ids") == 1, done.stderr[-3000:]
    assert "without the generation cut" in done.stderr
