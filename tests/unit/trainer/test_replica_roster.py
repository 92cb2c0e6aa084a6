"""The replica roster: which replicas are up, their endpoints, and their control clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rollpoint.http.client import HttpClient
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.errors import BadRequestError, ConfigError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.control.control_plane import participant_clients
from rollpoint.trainer.control.replica_roster import ReplicaRoster


def endpoints(name: str, port: int) -> ReplicaEndpoints:
    return ReplicaEndpoints(
        name=name,
        model_url=f"http://127.0.0.1:{port}",
        agent_url=f"http://127.0.0.1:{port + 1}",
        resources_url=f"http://127.0.0.1:{port + 2}",
    )


DEPLOYMENT = Deployment(
    replicas=[endpoints("replica-0", 9000), endpoints("replica-1", 9100)],
    policy_url="http://127.0.0.1:8999/v1",
)


@pytest.fixture
async def http() -> AsyncIterator[HttpClient]:
    async with HttpClient() as client:
        yield client


async def test_a_replica_down_has_no_participants_and_is_not_up(http: HttpClient) -> None:
    roster = ReplicaRoster.of_deployment(DEPLOYMENT, participant_clients(DEPLOYMENT, http))
    assert roster.up == ["replica-0", "replica-1"] and len(roster.participants()) == 6

    assert roster.mark_down("replica-1") is True
    assert roster.mark_down("replica-1") is False  # already down
    assert (roster.up, roster.down) == (["replica-0"], ["replica-1"])
    assert not roster.is_up("replica-1") and roster.any_up
    assert roster.participants("replica-1") == [] and roster.agent("replica-1") is None
    assert {c.address.replica for c in roster.participants()} == {"replica-0"}
    assert roster.names == ["replica-0", "replica-1"]  # still known, only down


async def test_mark_up_points_the_replicas_clients_at_its_new_urls(http: HttpClient) -> None:
    roster = ReplicaRoster.of_deployment(DEPLOYMENT, participant_clients(DEPLOYMENT, http))
    old = roster.participants("replica-1")
    roster.mark_down("replica-1")
    moved = endpoints("replica-1", 9500)
    roster.mark_up(moved)

    new = roster.participants("replica-1")
    assert [c.address.kind for c in new] == [c.address.kind for c in old]
    assert {c.address.kind: c.address.url for c in new} == {
        ParticipantKind.MODEL: moved.model_url,
        ParticipantKind.AGENT: moved.agent_url,
        ParticipantKind.RESOURCES: moved.resources_url,
    }
    assert not set(new) & set(old)  # new clients: nothing cached about the old servers
    assert roster.endpoints("replica-1") == moved
    assert roster.deployment().replicas[1] == moved
    agent = roster.agent("replica-1")
    assert agent is not None and agent.address.url == moved.agent_url


async def test_waiting_for_an_up_replica_blocks_only_while_none_is_up() -> None:
    roster = ReplicaRoster.of_deployment(DEPLOYMENT)
    await asyncio.wait_for(roster.wait_any_up(), 0.1)
    roster.mark_down("replica-0")
    await asyncio.wait_for(roster.wait_any_up(), 0.1)  # replica-1 is still up
    roster.mark_down("replica-1")
    waiter = asyncio.create_task(roster.wait_any_up())
    await asyncio.sleep(0.05)
    assert not waiter.done() and not roster.any_up
    roster.mark_up(endpoints("replica-0", 9700))
    await asyncio.wait_for(waiter, 0.1)
    assert roster.up == ["replica-0"]


async def test_a_roster_built_from_participants_alone_knows_their_replicas(
    http: HttpClient,
) -> None:
    roster = ReplicaRoster.of_participants(participant_clients(DEPLOYMENT, http))
    assert roster.names == ["replica-0", "replica-1"]
    assert roster.endpoints("replica-1") == DEPLOYMENT.replicas[1]


async def test_unknown_replicas_are_refused_with_a_clear_error(http: HttpClient) -> None:
    roster = ReplicaRoster.of_deployment(DEPLOYMENT)
    with pytest.raises(BadRequestError, match="no replica replica-7"):
        roster.mark_down("replica-7")
    with pytest.raises(BadRequestError, match="no replica replica-7"):
        roster.mark_up(endpoints("replica-7", 9900))
    other = Deployment(replicas=[endpoints("replica-9", 9800)], policy_url="http://x/v1")
    with pytest.raises(ConfigError, match=r"model@replica-9 names a replica"):
        ReplicaRoster.of_deployment(DEPLOYMENT, participant_clients(other, http))
