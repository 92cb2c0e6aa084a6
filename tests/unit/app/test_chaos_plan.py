"""The chaos plan's draw: every fault kind comes up, and each lands where it can strike."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rollpoint.app.chaos.plan import (
    KILLS,
    LOST_REPLY_VERBS,
    OWN_SERVERS,
    SIGNALLED,
    STOP_S,
    ChaosFault,
    TrialPlan,
    draw_plans,
)
from rollpoint.protocol.control import Verb
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.testing.snapshot_damage import Damage


def drawn(trials: int = 400, seed: int = 7) -> list[TrialPlan]:
    return draw_plans(
        trials, seed, config=Path("job.yaml"), root=Path("/runs"), replicas=2, within_s=3.0
    )


def test_a_seed_names_the_plans() -> None:
    assert drawn(seed=3) == drawn(seed=3)
    assert drawn(seed=3) != drawn(seed=4)


def test_every_kind_and_every_lost_reply_verb_is_drawn() -> None:
    faults = [f for plan in drawn() for f in plan.faults]

    assert {f.kind for f in faults} == set(ChaosFault)
    verbs = Counter(f.verb for f in faults if f.kind is ChaosFault.LOST_CONTROL_REPLY)
    assert set(verbs) == {*LOST_REPLY_VERBS, Verb.RESTORE}


def test_a_restore_reply_is_lost_only_in_a_rerun_after_a_kill() -> None:
    plans = [
        p
        for p in drawn()
        if any(f.kind is ChaosFault.LOST_CONTROL_REPLY and f.verb is Verb.RESTORE for f in p.faults)
    ]

    assert plans
    for plan in plans:
        lost = [f for f in plan.faults if f.verb is Verb.RESTORE]
        assert {f.run for f in lost} == {1}
        assert any(f.run == 0 and f.kind in KILLS for f in plan.faults)


def test_an_ack_reply_is_lost_only_on_an_agent_which_alone_is_sent_acks() -> None:
    lost = [
        f
        for plan in drawn()
        for f in plan.faults
        if f.kind is ChaosFault.LOST_CONTROL_REPLY and f.verb is Verb.ACK
    ]

    assert lost
    assert {f.participant for f in lost} == {ParticipantKind.AGENT}


def test_a_stop_lasts_a_drawn_moment_and_names_the_servers_it_stops() -> None:
    stops = [f for plan in drawn() for f in plan.faults if f.kind is ChaosFault.REPLICA_STOP]

    assert stops
    assert all(STOP_S[0] <= f.seconds <= STOP_S[1] and f.servers for f in stops)
    assert "s)" in stops[0].describe()  # the duration is in the fault's line


def test_no_server_is_signalled_nor_cut_from_its_peers_in_a_trial_whose_servers_run_apart() -> None:
    # A trainer kill puts the servers under rollpoint serve: not the trial's processes, and
    # their agents were given their peers' URLs by serve.
    apart = [plan for plan in drawn() if plan.servers_apart]

    assert apart
    assert SIGNALLED < OWN_SERVERS and ChaosFault.PEER_PARTITION in OWN_SERVERS
    assert not [f for plan in apart for f in plan.faults if f.kind in OWN_SERVERS]


def test_a_peer_partition_cuts_an_agent_from_its_model_or_its_resources() -> None:
    cuts = [f for plan in drawn() for f in plan.faults if f.kind is ChaosFault.PEER_PARTITION]

    assert {f.participant for f in cuts} == {ParticipantKind.MODEL, ParticipantKind.RESOURCES}
    assert {f.forward for f in cuts} == {True, False}
    assert all(0.1 <= f.seconds <= 0.6 for f in cuts)


def test_a_plan_round_trips_the_command_line() -> None:
    for plan in drawn(trials=50):
        assert TrialPlan.model_validate_json(plan.model_dump_json()) == plan


def test_a_snapshot_is_damaged_only_before_the_rerun_of_a_killed_run_each_way() -> None:
    tampers = [
        (plan, f) for plan in drawn() for f in plan.faults if f.kind is ChaosFault.SNAPSHOT_TAMPER
    ]

    assert {f.damage for _, f in tampers} == set(Damage)
    for plan, fault in tampers:
        assert fault.run == 1
        assert any(f.run == 0 and f.kind in KILLS for f in plan.faults)
        assert plan.model_copy(update={"run": 1}).before_run() == [fault]
        assert fault not in plan.model_copy(update={"run": 1}).in_process()
