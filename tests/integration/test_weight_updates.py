"""Weight updates on loopback: scripted policy (vLLM's shape, one token a chunk) → model server
(in this test's loop), paused and made live through the model server's weight routes.

Every version a call is stamped with is checked against the engine's own log of which
weights sampled each token span (``weights_log``): a call that spans an update in ``keep``
mode carries two segments split where the engine switched; an ``abort`` ends the call at
the engine and the model server sends it again under the new weights; an engine without
pause routes is drained. The control requests are the recorded engine fixtures'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollpoint.policy.engine_adapters import control_for
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.ids import HEADER_POLICY_VERSION
from rollpoint.servers.model.generation_cut import HEADER_TOKEN_SEGMENTS
from rollpoint.servers.model.model_server import ModelServer, ModelServerSettings, create_model_app
from tests.integration.test_generation_cut import Model, model, request, tags
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engines" / "pause"


@contextmanager
def engine(tmp_path: Path, **settings: Any) -> Iterator[tuple[str, Path]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "weights.jsonl"
    policy = PolicySettings(
        seed=5,
        error_rate=0.0,
        weights_log=str(log),
        reasoning_tokens=60,
        token_latency_ms=settings.pop("token_latency_ms", 10.0),
        **settings,
    )
    with serve_app(create_policy_app(policy)) as url:
        yield url, log


def weights_log(log: Path) -> dict[str, dict[str, Any]]:
    return {line["id"]: line for line in map(orjson.loads, log.read_bytes().splitlines())}


async def started(m: Model, body: dict[str, Any], *, tokens: int = 12) -> asyncio.Future[Any]:
    """A tagged call of r1 once ``tokens`` of it have arrived at the model server."""
    call = asyncio.ensure_future(
        m.http.post("/v1/chat/completions", json=body, headers=tags("r1", 0), timeout=30)
    )
    for _ in range(3000):
        partials = list(m.server.partials.values())
        if partials and len(partials[0].ids) >= tokens:
            return call
        await asyncio.sleep(0.002)
    raise AssertionError("the call never decoded enough tokens")


def test_the_control_requests_and_the_scripted_engines_answers_are_the_recorded_ones(
    tmp_path: Path,
) -> None:
    for name in ("vllm", "sglang"):
        recorded = orjson.loads((FIXTURES / f"{name}.json").read_bytes())
        control = control_for(recorded["engine"])
        with engine(tmp_path / name) as (url, _), httpx.Client(base_url=url) as http:
            for exchange in recorded["exchanges"]:
                asked = exchange["request"]
                if exchange["step"] == "pause":
                    call = control.pause(exchange["mode"])
                    if asked is None:
                        assert call is None
                        continue
                    assert call is not None
                    assert (call.path, call.params, call.body) == (
                        asked["path"],
                        asked["params"],
                        asked["body"],
                    )
                elif exchange["step"] == "resume":
                    call = control.resume()
                    assert (call.path, call.params, call.body) == (
                        asked["path"],
                        asked["params"],
                        asked["body"],
                    )
                reply = http.post(asked["path"], params=asked["params"], json=asked["body"])
                assert reply.status_code == exchange["reply"]["status"]
                assert reply.json() == exchange["reply"]["body"]
                if exchange["step"] == "pause":
                    http.post(control.resume().path, json=control.resume().body)


async def test_keep_splits_a_call_in_flight_where_the_engine_switched_weights(
    tmp_path: Path,
) -> None:
    with engine(tmp_path) as (url, log):
        async with model(url) as m, httpx.AsyncClient(base_url=url) as direct:
            call = await started(m, request())
            paused = await m.http.post("/rollpoint/v1/weights/pause", json={"mode": "keep"})
            assert paused.json()["how"] == "engine"
            # Paused at the engine: no token is sampled while the weights are pushed.
            held = len(next(iter(m.server.partials.values())).ids)
            await direct.post("/update_weight_version", json={"new_version": "1"})
            await asyncio.sleep(0.1)
            assert len(next(iter(m.server.partials.values())).ids) == held
            live = await m.http.post("/rollpoint/v1/weights/live", json={"version": 1})
            assert live.json() == {"phase": "live", "policy_version": 1}
            reply = await call
            assert reply.status_code == 200, reply.text
            record = m.server.ledger.calls("r1")[0]
    spans = weights_log(log)[reply.json()["id"]]["spans"]
    assert len(spans) == 2 and spans[0][0] == 0 and spans[1][0] == 1
    assert [[s.policy_version, s.tokens] for s in record.segments or ()] == spans
    assert reply.headers[HEADER_TOKEN_SEGMENTS] == ",".join(f"{v}:{n}" for v, n in spans)
    assert reply.headers[HEADER_POLICY_VERSION] == "0" and record.policy_version == 0
    assert sum(n for _, n in spans) == len(reply.json()["choices"][0]["token_ids"])


async def test_a_call_that_starts_during_an_update_is_stamped_with_the_new_version(
    tmp_path: Path,
) -> None:
    with engine(tmp_path, token_latency_ms=1.0) as (url, log):
        async with model(url) as m, httpx.AsyncClient(base_url=url) as direct:
            await m.http.post("/rollpoint/v1/weights/pause", json={"mode": "keep"})
            call = asyncio.ensure_future(
                m.http.post(
                    "/v1/chat/completions", json=request(), headers=tags("r2", 0), timeout=30
                )
            )
            await asyncio.sleep(0.05)
            assert not call.done() and not m.server.partials  # held before the engine
            await direct.post("/update_weight_version", json={"new_version": "3"})
            await m.http.post("/rollpoint/v1/weights/live", json={"version": 3})
            reply = await call
    assert weights_log(log)[reply.json()["id"]]["spans"][0][0] == 3
    assert reply.headers[HEADER_POLICY_VERSION] == "3"
    assert HEADER_TOKEN_SEGMENTS not in reply.headers


async def test_abort_ends_the_call_at_the_engine_and_it_is_sent_again_under_the_new_weights(
    tmp_path: Path,
) -> None:
    with engine(tmp_path) as (url, log):
        async with model(url) as m, httpx.AsyncClient(base_url=url) as direct:
            call = await started(m, request())
            paused = await m.http.post("/rollpoint/v1/weights/pause", json={"mode": "abort"})
            assert paused.json()["how"] == "engine"
            await direct.post("/update_weight_version", json={"new_version": "2"})
            await m.http.post("/rollpoint/v1/weights/live", json={"version": 2})
            reply = await call
            assert reply.status_code == 200, reply.text
            assert m.server.aborted_calls == 1
            (record,) = m.server.ledger.calls("r1")
    lines = list(weights_log(log).values())
    assert [line["aborted"] for line in lines] == [True, False]
    assert lines[0]["spans"][0][0] == 0
    assert lines[1]["id"] == reply.json()["id"] and [v for v, _ in lines[1]["spans"]] == [2]
    assert record.policy_version == 2 and record.segments is None
    assert reply.json()["choices"][0]["finish_reason"] != "abort"


async def test_an_engine_without_pause_routes_is_drained_first(tmp_path: Path) -> None:
    with engine(tmp_path, pause_routes=False) as (url, log):
        async with model(url) as m:
            call = await started(m, request())
            paused = await m.http.post("/rollpoint/v1/weights/pause", json={"mode": "keep"})
            assert paused.json()["how"] == "drained"
            assert call.done()  # the pause returned once the call had finished
            reply = call.result()
            await m.http.post("/rollpoint/v1/weights/live", json={"version": 1})
    assert weights_log(log)[reply.json()["id"]]["spans"] == [
        [0, len(reply.json()["choices"][0]["token_ids"])]
    ]
    assert reply.headers[HEADER_POLICY_VERSION] == "0"


async def test_without_the_cut_keep_drains_and_an_aborted_plain_call_is_sent_again(
    tmp_path: Path,
) -> None:
    """A model server that does not stream from the engine (no generation cut) cannot split
    a call: ``keep`` drains instead; an engine's plain reply aborted by ``abort`` is not
    the call's answer, and the call is sent again once the new weights are live."""
    with engine(tmp_path, token_latency_ms=5.0) as (url, log):
        app = create_model_app(ModelServerSettings(upstream_url=url + "/v1"))
        server: ModelServer = app.state.model_server
        await server.start()
        transport = httpx.ASGITransport(app=app)
        try:
            async with (
                httpx.AsyncClient(transport=transport, base_url="http://model") as http,
                httpx.AsyncClient(base_url=url) as direct,
            ):

                def call(rollout: str) -> asyncio.Future[Any]:
                    return asyncio.ensure_future(
                        http.post(
                            "/v1/chat/completions",
                            json=request(),
                            headers=tags(rollout, 0),
                            timeout=30,
                        )
                    )

                async def decoding() -> None:
                    for _ in range(3000):
                        state = (await direct.get("/weights_state")).json()
                        if any(g["sampled"] >= 3 for g in state["generations"]):
                            return
                        await asyncio.sleep(0.002)
                    raise AssertionError("the call never decoded")

                first = call("r1")
                await decoding()
                paused = await http.post("/rollpoint/v1/weights/pause", json={"mode": "keep"})
                assert paused.json()["how"] == "drained" and first.done()
                await http.post("/rollpoint/v1/weights/live", json={"version": 1})

                second = call("r2")
                await decoding()
                await http.post("/rollpoint/v1/weights/pause", json={"mode": "abort"})
                await direct.post("/update_weight_version", json={"new_version": "2"})
                await http.post("/rollpoint/v1/weights/live", json={"version": 2})
                reply = await second
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["finish_reason"] != "abort"
                assert reply.headers[HEADER_POLICY_VERSION] == "2"
                assert server.aborted_calls == 1
                (record,) = server.ledger.calls("r2")
        finally:
            await server.stop()
    lines = list(weights_log(log).values())
    assert [line["aborted"] for line in lines] == [False, True, False]
    assert lines[2]["id"] == reply.json()["id"] and [v for v, _ in lines[2]["spans"]] == [2]
    assert record.policy_version == 2
