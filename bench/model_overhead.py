"""Model-server overhead per call: the same chat call straight to the engine and through the proxy.

Both servers run as real processes (the embedded runtime's launcher), the client is one
aiohttp session, and the engine is the scripted policy at zero latency, so the difference is
the proxy hop: admission gate, call ledger, forwarding.

With token capture the model server streams every tagged call from the engine for the
generation cut (and assembles the plain reply): the ``cut_`` figures time that against the
plain proxy, both asked for token ids and logprobs, alternating call by call as below.

One call at a time shows the hop's own cost. There the direct and the proxied calls
alternate, call by call (which of the pair goes first alternates too), so the two latency
distributions see the same host: measured in two blocks one after the other, the direct
p50 alone moved between 0.45 and 0.95 ms from run to run on this shared 2-core VM, more
than the difference being measured. ``concurrency`` calls in flight show throughput; those
run as two blocks, direct then proxied.
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
TOKEN_BODY = orjson.dumps({**orjson.loads(BODY), "return_token_ids": True, "logprobs": True})
"""What an agent with ``policy.capture_tokens`` sends (vLLM's fields)."""


def _headers(episode: str | None, turn: int) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if episode is not None:
        headers |= {HEADER_ROLLOUT_ID: episode, HEADER_ATTEMPT: "0", HEADER_TURN: str(turn)}
    return headers


async def _drive(
    url: str, calls: int, concurrency: int, *, episode_headers: bool
) -> tuple[list[float], float]:
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker(w: int, counter: Iterator[int]) -> None:
            for i in counter:
                headers = _headers(f"bench{w}" if episode_headers else None, i)
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


async def _alternate(
    direct_url: str,
    proxied_url: str,
    calls: int,
    *,
    body: bytes = BODY,
    direct_episode: str | None = None,
) -> tuple[list[float], list[float]]:
    """``calls`` pairs of one direct and one proxied call, one call in flight at a time."""
    direct: list[float] = []
    proxied: list[float] = []
    async with aiohttp.ClientSession() as session:

        async def call(url: str, episode: str | None, turn: int) -> float:
            t0 = time.perf_counter()
            async with session.post(
                f"{url}/v1/chat/completions", data=body, headers=_headers(episode, turn)
            ) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            return time.perf_counter() - t0

        for timed in (False, True):  # warm up connections and code paths, then measure
            for i in range(calls if timed else min(200, calls)):
                if i % 2:
                    d = await call(direct_url, direct_episode, i)
                    p = await call(proxied_url, "bench-serial", i)
                else:
                    p = await call(proxied_url, "bench-serial", i)
                    d = await call(direct_url, direct_episode, i)
                if timed:
                    direct.append(d)
                    proxied.append(p)
    return direct, proxied


def _figures(
    label: str, direct: list[float], proxied: list[float], direct_s: float, proxied_s: float
) -> dict[str, float | int | str]:
    d50, p50 = percentile(direct, 50) * 1e3, percentile(proxied, 50) * 1e3
    d99, p99 = percentile(direct, 99) * 1e3, percentile(proxied, 99) * 1e3
    return {
        f"{label}_direct_calls_per_s": len(direct) / direct_s,
        f"{label}_proxied_calls_per_s": len(proxied) / proxied_s,
        f"{label}_throughput_ratio": direct_s / proxied_s,
        f"{label}_direct_p50_ms": d50,
        f"{label}_proxied_p50_ms": p50,
        f"{label}_added_p50_ms": p50 - d50,
        f"{label}_added_p99_ms": p99 - d99,
    }


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
            serial = max(300, calls // 5)
            direct, proxied = await _alternate(policy.url, model.url, serial)
            figures |= _figures("serial", direct, proxied, sum(direct), sum(proxied))
            (cut,) = await group.start(
                [
                    ServerSpec(
                        kind="model",
                        name="model-cut",
                        settings={"upstream_url": f"{policy.url}/v1", "cut_generations": True},
                    )
                ]
            )
            # "direct" here is the plain proxy: the figures are what the cut adds to it.
            plain, streamed = await _alternate(
                model.url, cut.url, serial, body=TOKEN_BODY, direct_episode="bench-plain"
            )
            figures |= _figures("cut", plain, streamed, sum(plain), sum(streamed))
            direct, direct_s = await _drive(policy.url, calls, concurrency, episode_headers=False)
            proxied, proxied_s = await _drive(model.url, calls, concurrency, episode_headers=True)
            figures |= _figures("concurrent", direct, proxied, direct_s, proxied_s)
        finally:
            await group.stop()
    return BenchResult(
        key="model_overhead",
        title="model-server overhead per call vs calling the engine directly",
        figures=figures,
        params={
            "calls": calls,
            "concurrency": f"1 (direct and proxied alternating) and {concurrency}",
            "engine": "scripted policy, 0 ms",
        },
    )
