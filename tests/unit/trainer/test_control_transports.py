"""The control transports without sockets: in-process keeps the wire's rules, faults apply."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollpoint.protocol.control import Phase, PrepareRequest
from rollpoint.protocol.control_verbs import PREPARE
from rollpoint.protocol.errors import (
    BadRequestError,
    CheckpointConflictError,
    InvalidPhaseError,
    TransportError,
)
from rollpoint.testing import Fault
from tests.unit.trainer.in_process_rig import Rig, build_rig

AGENT = "agent@replica-0"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = build_rig(tmp_path / "snapshots")
    yield r
    await r.aclose()


async def test_in_process_calls_reach_the_fence_and_refusals_come_back_typed(rig: Rig) -> None:
    agent = rig.client(AGENT)
    status = await agent.status()
    assert (status.kind, status.replica, status.phase) == ("agent", "replica-0", Phase.IDLE)
    reply = await agent.prepare("c1", time.time() + 5)
    assert reply.phase is Phase.PREPARED and rig.fences[AGENT].phase is Phase.PREPARED
    with pytest.raises(CheckpointConflictError, match="in-process agent@replica-0: checkpoint c1"):
        await agent.restore("r1", time.time() + 5, "snap", [], "c1")
    assert rig.fences[AGENT].phase is Phase.PREPARED  # a refused call changed nothing


async def test_in_process_requests_are_read_strictly_and_a_bad_one_reaches_no_fence(
    rig: Rig,
) -> None:
    # Built without validation, as a buggy caller might: the wire would refuse it (422).
    bad = PrepareRequest.model_construct(checkpoint_id="a b", deadline_ts=time.time() + 5)
    transport = rig.faults(AGENT).inner
    with pytest.raises(BadRequestError, match="checkpoint_id"):
        await transport.call(PREPARE, bad, 5.0)
    assert rig.calls(AGENT) == [] and rig.fences[AGENT].phase is Phase.IDLE


async def test_a_dropped_reply_was_applied_and_the_caller_gets_a_transport_error(
    rig: Rig,
) -> None:
    rule = rig.faults(AGENT).add(Fault.drop_reply(path="/rollpoint/v1/checkpoint/prepare"))
    with pytest.raises(TransportError, match=r"agent@replica-0 prepare: .*reply was lost"):
        await rig.client(AGENT).prepare("c1", time.time() + 5)
    assert rule.hits == 1
    assert rig.fences[AGENT].phase is Phase.PREPARED


async def test_reset_garbage_and_error_replies_read_as_over_http(rig: Rig) -> None:
    faults, agent = rig.faults(AGENT), rig.client(AGENT)
    faults.add(Fault.reset(path="/rollpoint/v1/checkpoint/status"))
    with pytest.raises(TransportError, match="connection reset"):
        await agent.status()
    faults.add(Fault.garbage(path="/rollpoint/v1/checkpoint/status"))
    with pytest.raises(TransportError, match="reply is not JSON"):
        await agent.status()
    faults.add(Fault.garbage(body=b'{"phase": "idle"}', path="/rollpoint/v1/checkpoint/status"))
    with pytest.raises(TransportError, match="reply is not the protocol"):
        await agent.status()
    envelope = {"error": {"code": "invalid_phase", "message": "busy", "retryable": False}}
    faults.add(Fault.error(409, envelope, path="/rollpoint/v1/checkpoint/status"))
    with pytest.raises(InvalidPhaseError, match="busy"):
        await agent.status()
    assert rig.calls(AGENT) == []  # none of them reached the fence
    assert (await agent.status()).phase is Phase.IDLE  # and the next call goes through


async def test_a_partition_refuses_every_call_until_healed(rig: Rig) -> None:
    faults, agent = rig.faults(AGENT), rig.client(AGENT)
    faults.add(Fault.refuse(forward=True, path="/rollpoint/v1/checkpoint/prepare"))
    with pytest.raises(TransportError, match="partitioned"):
        await agent.prepare("c1", time.time() + 5)
    with pytest.raises(TransportError, match="partitioned"):
        await agent.status()
    faults.heal()
    assert (await agent.status()).phase is Phase.PREPARED  # the forwarded prepare applied
