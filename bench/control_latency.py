"""Control round trips against a model server whose data plane runs at saturation.

Issue 37, item 1 ("control never waits behind data"). A model server (a real process, with
a snapshot root, so a checkpoint participant) proxies a flood of policy calls to the
scripted engine, each answered with ~1k completion tokens with their ids and logprobs and
filed in the call ledger: the load every RL run puts on it. The flood comes from another
process (``--drive``), so this process's loop times only the round trips.

Meanwhile this process times the control verbs, the same ones over both paths, in pairs
whose order alternates cycle by cycle so both see the same load:

- **data loop**: the routes at the server's URL, served on its data loop, where every
  control route was served before (:class:`HttpControlTransport` with
  ``follow_control_port=False``);
- **own loop**: the same routes on the server's control listener, its own thread and event
  loop (:mod:`rollpoint.participant.control_listener`), where the coordinator sends them now.

Each cycle: ``status``, then a whole checkpoint, ``prepare`` / ``commit`` (an empty scope,
``wait_for_write: false``: the round trip, not the write) / ``resume``. The figures are
each verb's p50 and p99 per path and their ratio (data loop / own loop), with the policy
calls per second the server kept up meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from bench.latency import percentile
from bench.report import BenchResult
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import CommitRequest, PrepareRequest, ResumeRequest
from rollpoint.protocol.control_verbs import COMMIT, PREPARE, RESUME, STATUS
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.server_spec import ServerSpec
from rollpoint.trainer.control.control_transport import HttpControlTransport

TOKEN = "bench-control-latency-token-0123"
BODY = orjson.dumps(
    {
        "model": "scripted",
        "messages": [{"role": "user", "content": "Think it through, then answer."}],
        "return_token_ids": True,
        "logprobs": True,
    }
)
VERBS = ("status", "prepare", "commit", "resume")
PATHS = ("data_loop", "own_loop")
TURNS_PER_ROLLOUT = 8


async def _drive(url: str, concurrency: int, seconds: float) -> int:
    """The flood: ``concurrency`` callers, each a rollout of a few turns after another."""
    calls = 0
    stop_at = time.monotonic() + seconds
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def caller(w: int) -> None:
            nonlocal calls
            i = 0
            while time.monotonic() < stop_at:
                headers = {
                    "content-type": "application/json",
                    HEADER_ROLLOUT_ID: f"load{w}-{i // TURNS_PER_ROLLOUT}",
                    HEADER_ATTEMPT: "0",
                    HEADER_TURN: str(i % TURNS_PER_ROLLOUT),
                }
                async with session.post(
                    f"{url}/v1/chat/completions", data=BODY, headers=headers
                ) as resp:
                    await resp.read()
                if resp.status == 200:
                    calls += 1
                i += 1

        await asyncio.gather(*(caller(w) for w in range(concurrency)))
    return calls


async def _cycle(transport: HttpControlTransport, cid: str, times: dict[str, list[float]]) -> None:
    async def timed(verb: str, call: asyncio.Future[object] | object) -> None:
        t0 = time.perf_counter()
        await call  # type: ignore[misc]
        times[verb].append(time.perf_counter() - t0)

    deadline = time.time() + 60
    await timed("status", transport.call(STATUS, None, 60))
    await timed(
        "prepare",
        transport.call(PREPARE, PrepareRequest(checkpoint_id=cid, deadline_ts=deadline), 60),
    )
    commit = CommitRequest(
        checkpoint_id=cid, deadline_ts=deadline, checkpoint_dir=f"bench/{cid}", wait_for_write=False
    )
    await timed("commit", transport.call(COMMIT, commit, 60))
    await timed("resume", transport.call(RESUME, ResumeRequest(checkpoint_id=cid), 60))


async def run(seconds: float = 60.0, concurrency: int = 64, tokens: int = 1000) -> BenchResult:
    times: dict[str, dict[str, list[float]]] = {p: {v: [] for v in VERBS} for p in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        group = ProcessGroup(Path(tmp), env={CONTROL_TOKEN_ENV: TOKEN})
        try:
            (policy,) = await group.start(
                [
                    ServerSpec(
                        kind="policy",
                        name="policy",
                        settings={"latency_ms": 0, "error_rate": 0, "tokens_per_call": tokens},
                    )
                ]
            )
            (model,) = await group.start(
                [
                    ServerSpec(
                        kind="model",
                        name="model",
                        settings={
                            "upstream_url": f"{policy.url}/v1",
                            "snapshot_root": str(Path(tmp) / "snapshots"),
                        },
                    )
                ]
            )
            async with HttpClient(token=TOKEN, timeout_s=120) as http:
                paths = {
                    "data_loop": HttpControlTransport(http, model.url, follow_control_port=False),
                    "own_loop": HttpControlTransport(http, model.url),
                }
                for transport in paths.values():
                    await transport.call(STATUS, None, 30)  # the own loop's finds its port
                assert paths["own_loop"].target != model.url, "no control listener"
                load = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "bench.control_latency",
                    "--drive",
                    model.url,
                    str(concurrency),
                    str(seconds + 3),
                    stdout=asyncio.subprocess.PIPE,
                )
                await asyncio.sleep(3)  # the flood reaches its pace
                t0 = time.monotonic()
                cycle = 0
                while time.monotonic() - t0 < seconds and load.returncode is None:
                    order = PATHS if cycle % 2 == 0 else PATHS[::-1]
                    for path in order:
                        await _cycle(paths[path], f"bench-{cycle}-{path}", times[path])
                        await asyncio.sleep(0.05)
                    cycle += 1
                out, _ = await load.communicate()
                calls = int(out.decode().strip() or 0)
        finally:
            await group.stop()
    figures: dict[str, float | int | str] = {
        "cycles": cycle,
        "policy_calls_per_s": round(calls / (seconds + 3), 1),
    }
    for verb in VERBS:
        for q in (50, 99):
            slow = percentile(times["data_loop"][verb], q) * 1e3
            fast = percentile(times["own_loop"][verb], q) * 1e3
            figures[f"{verb}_p{q}_ms_data_loop"] = round(slow, 2)
            figures[f"{verb}_p{q}_ms_own_loop"] = round(fast, 2)
            figures[f"{verb}_p{q}_ratio"] = round(slow / fast, 1) if fast > 0 else "n/a"
    return BenchResult(
        key="control_latency",
        title="control round trips against a saturated data plane: data loop vs own loop",
        figures=figures,
        params={
            "seconds": seconds,
            "concurrency": concurrency,
            "completion_tokens": f"{tokens}, with ids and logprobs",
            "engine": "scripted policy, 0 ms",
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_latency")
    parser.add_argument("--drive", nargs=3, metavar=("URL", "CONCURRENCY", "SECONDS"))
    args = parser.parse_args(argv)
    if args.drive:
        url, concurrency, seconds = args.drive
        print(asyncio.run(_drive(url, int(concurrency), float(seconds))))
        return 0
    result = asyncio.run(run())
    print(orjson.dumps(result.figures, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
