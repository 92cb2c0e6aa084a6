"""The dispatcher with long episodes: ~48k generated tokens an episode, token data captured.

Real server processes (embedded runtime), the real trainer loop, the scripted policy at
zero latency with 16,000 stand-in reasoning tokens before each of three tool calls, and
``capture_tokens: required`` (ids and logprobs per token): each episode's reply is over
1 MiB on one NDJSON line, twice aiohttp's 512 KiB line limit that once crashed the run
(issue 33). Reports the rows trained, their reply size, the throughput in episodes and
reply MiB per second, and the trainer process's peak RSS.
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

import orjson

from bench.report import BenchResult
from rollpoint.app.config import parse_config
from rollpoint.envs import get_environment
from rollpoint.loop import SimulatedTrainer
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.trainer.trainer import Trainer
from rollpoint.tuning import install as install_tuning

REASONING_TOKENS = 16_000
TOOL_TURNS = 3


async def run(tasks: int = 8, group_size: int = 4, concurrency: int = 16) -> BenchResult:
    install_tuning()  # the trainer runs here: as run_job, its entry point, would
    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config(
            {
                "workdir": str(Path(tmp) / "run"),
                "environment": "workplace",
                "tasks": tasks,
                "group_size": group_size,
                "replicas": 2,
                "concurrency": concurrency,
                "policy": {
                    "latency_ms": 0,
                    "error_rate": 0.0,
                    "capture_tokens": "required",
                    "tool_turns": TOOL_TURNS,
                    "reasoning_tokens": REASONING_TOKENS,
                    "sampling": {"logprobs": True},
                },
                "train": {"batch_size": group_size * 2},
            }
        )
        config.workdir.mkdir(parents=True)
        rows = get_environment("workplace").make_tasks(tasks, config.seed)
        async with EmbeddedRuntime(config.runtime_settings()) as runtime:
            assert runtime.deployment is not None
            trainer = Trainer(
                config.trainer_settings(),
                runtime.deployment,
                rows,
                hooks=SimulatedTrainer(config.train.step_seconds),
            )
            t0 = time.perf_counter()
            summary = await trainer.run()
            elapsed = time.perf_counter() - t0
        # The train line of a row carries its reply's transcript and token data.
        lines = (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    sizes = sorted(len(line) for line in lines)
    generated = sum(
        len(turn.get("completion_token_ids") or ())
        for line in lines
        for turn in orjson.loads(line)["turns"]
    )
    mib = sum(sizes) / (1 << 20)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return BenchResult(
        key="long_episodes",
        title="the dispatcher with ~48k-token, tokens-captured episodes (1 NDJSON line > 1 MiB)",
        figures={
            "episodes": summary.episodes,
            "failed_groups": len(summary.failed_groups),
            "generated_tokens_per_episode": generated // max(len(lines), 1),
            "train_line_mib_median": sizes[len(sizes) // 2] / (1 << 20) if sizes else 0.0,
            "train_line_mib_max": sizes[-1] / (1 << 20) if sizes else 0.0,
            "seconds": elapsed,
            "episodes_per_s": summary.episodes / elapsed,
            "reply_mib_per_s": mib / elapsed,
            "trainer_peak_rss_mib": peak_rss_mib,
        },
        params={
            "tasks": tasks,
            "group_size": group_size,
            "replicas": 2,
            "concurrency": concurrency,
            "reasoning_tokens": REASONING_TOKENS,
            "tool_turns": TOOL_TURNS,
        },
    )
