"""Model-server overhead per call: the same chat call straight to the engine and through the proxy.

Both servers run as real processes (the embedded runtime's launcher), the client is one
aiohttp session with ``concurrency`` calls in flight, and the engine is the scripted policy
at zero latency, so the difference is the proxy hop: admission gate, call ledger, forwarding.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson

from bench.latency import percentile
from bench.report import BenchResult
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.server_spec import ServerSpec

BODY = orjson.dumps(
    {
        "model": "scripted",
        "messages": [{"role": "user", "content": "What is 17 * 23? Answer with the number only."}],
    }
)


async def _drive(
    url: str, calls: int, concurrency: int, *, episode_headers: bool
) -> tuple[list[float], float]:
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker(w: int, counter: Iterator[int]) -> None:
            for i in counter:
                headers = {"content-type": "application/json"}
                if episode_headers:
                    headers |= {
                        HEADER_ROLLOUT_ID: f"bench{w}",
                        HEADER_ATTEMPT: "0",
                        HEADER_TURN: str(i),
                    }
                t0 = time.perf_counter()
                async with session.post(
                    f"{url}/v1/chat/completions", data=BODY, headers=headers
                ) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                latencies.append(time.perf_counter() - t0)

        # Warm up connections and code paths before timing; workers share one counter.
        warm = iter(range(min(200, calls)))
        await asyncio.gather(*(worker(w, warm) for w in range(concurrency)))
        latencies.clear()
        timed = iter(range(calls))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w, timed) for w in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return latencies, elapsed


async def run(calls: int = 3000, concurrency: int = 32) -> BenchResult:
    figures: dict[str, float | int | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        group = ProcessGroup(Path(tmp))
        try:
            (policy,) = await group.start(
                [
                    ServerSpec(
                        kind="policy", name="policy", settings={"latency_ms": 0, "error_rate": 0}
                    )
                ]
            )
            (model,) = await group.start(
                [
                    ServerSpec(
                        kind="model", name="model", settings={"upstream_url": f"{policy.url}/v1"}
                    )
                ]
            )
            # One call at a time shows the hop's own cost; many at once show throughput.
            for label, n, conc in (
                ("serial", max(300, calls // 5), 1),
                ("concurrent", calls, concurrency),
            ):
                direct, direct_s = await _drive(policy.url, n, conc, episode_headers=False)
                proxied, proxied_s = await _drive(model.url, n, conc, episode_headers=True)
                d50, p50 = percentile(direct, 50) * 1e3, percentile(proxied, 50) * 1e3
                d99, p99 = percentile(direct, 99) * 1e3, percentile(proxied, 99) * 1e3
                figures |= {
                    f"{label}_direct_calls_per_s": n / direct_s,
                    f"{label}_proxied_calls_per_s": n / proxied_s,
                    f"{label}_throughput_ratio": direct_s / proxied_s,
                    f"{label}_direct_p50_ms": d50,
                    f"{label}_proxied_p50_ms": p50,
                    f"{label}_added_p50_ms": p50 - d50,
                    f"{label}_added_p99_ms": p99 - d99,
                }
        finally:
            await group.stop()
    return BenchResult(
        key="model_overhead",
        title="model-server overhead per call vs calling the engine directly",
        figures=figures,
        params={
            "calls": calls,
            "concurrency": f"1 and {concurrency}",
            "engine": "scripted policy, 0 ms",
        },
    )
