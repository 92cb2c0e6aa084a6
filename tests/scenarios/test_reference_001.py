"""Reference 001: one lost ``/run`` reply stopped every later checkpoint (NeMo-RL #4265).

There a finished run whose reply never reached the trainer was never acked; the
environment kept it forever and every later prepare refused to commit, while the trainer
reran the work under a new try. Here the agent finishes a group, its reply is lost on the
wire, and a snapshot is taken before the trainer has even given up on it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollpoint.protocol.participant import ParticipantKind
from rollpoint.testing import Fault, ProxiedRequest
from rollpoint.trainer.state.ledger_record import RolloutState
from tests.scenarios.scenario_kit import (
    RETIRE,
    RecordingHooks,
    ScenarioCluster,
    fronted,
    job,
    job_config,
    label,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.integration

A0 = label(ParticipantKind.AGENT, "replica-0")


async def test_one_lost_run_reply_never_blocks_a_later_snapshot_and_the_work_is_adopted(
    tmp_path: Path,
) -> None:
    lost_ids: list[str] = []

    def first_run(request: ProxiedRequest) -> bool:
        lost_ids.extend(row["episode"]["rollout_id"] for row in request.json()["rows"])
        return True

    hooks = RecordingHooks()
    async with (
        ScenarioCluster(tmp_path / "snapshots") as cluster,
        fronted(cluster, A0) as fronts,
        job(cluster, job_config(tmp_path / "run"), fronts=fronts, hooks=hooks) as j,
    ):
        proxy = fronts[A0]
        # The first /run to replica-0 plays to the end on the agent; its whole reply is lost.
        lost = proxy.add(Fault.drop_reply(path="/run", when=first_run))
        # The trainer's give-up waits on the agent's answer to its retire meanwhile.
        retire = proxy.add(Fault.hold(path=RETIRE))
        run = asyncio.create_task(j.trainer.run())
        await lost.wait()
        await retire.wait()
        cut = await j.coordinator.save()
        proxy.release(retire)
        assert j.trainer.dispatcher is not None
        dispatcher = j.trainer.dispatcher
        await eventually(lambda: dispatcher.adopted == len(lost_ids), "the lost replies adopted")
        after = await j.coordinator.save()
        await run
        held = await j.counts(ParticipantKind.AGENT, "finished_unacked")
        calls_served = sum((await j.counts(ParticipantKind.MODEL, "calls_total")).values())

    assert len(lost_ids) == j.config.group_size
    # The snapshot taken with the replies lost (the trainer not yet told) still committed:
    # the replies are in the cut as finished, to be adopted by a restore.
    assert cut.published, cut.blocked_by
    assert cut.manifest is not None
    assert set(lost_ids) <= {e.rollout_id for e in cut.manifest.finished}
    # Breaks if Dispatcher._give_up reran a finished try instead of adopting it: same
    # rollout id, same attempt, first try, sealed; nothing re-sent fresh.
    for rollout_id in lost_ids:
        record = j.trainer.ledger.get(rollout_id)
        assert (record.state, record.attempt, record.tries) == (RolloutState.SEALED, 0, 1)
    assert (dispatcher.adopted, dispatcher.resent_fresh) == (len(lost_ids), 0)
    trained = {(s.rollout_id, s.attempt) for s in hooks.samples}
    assert {(rid, 0) for rid in lost_ids} <= trained
    assert len(hooks.samples) == len(trained) == len(j.every_row())
    # Nothing ran twice: every policy call the model servers served is one a trained
    # rollout made.
    assert calls_served == sum(len(s.model_calls) for s in hooks.samples)
    # Every later snapshot commits, and no reply is left held anywhere at the end (breaks
    # if the adopted replies were never acked: ReleaseBatcher.sealed / _flush_acks).
    assert after.published, after.blocked_by
    assert after.manifest is not None
    assert not set(lost_ids) & {e.rollout_id for e in after.manifest.finished}
    assert held == {label(ParticipantKind.AGENT, r.name): 0 for r in cluster.replicas}
