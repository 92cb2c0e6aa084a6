"""The chaos plan's draw: every fault kind comes up, and each lands where it can strike."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from rollpoint.app.chaos import draw as chaos_draw
from rollpoint.app.chaos.draw import draw_plans
from rollpoint.app.chaos.plan import (
    ENGINE_CALLS,
    ENGINE_DATA,
    JOURNAL_DAMAGES,
    KILLS,
    LOST_REPLY_VERBS,
    OWN_SERVERS,
    PROXIED,
    SIGNALLED,
    STOP_S,
    ChaosFault,
    PlannedFault,
    TrialPlan,
)
from rollpoint.protocol.control import Verb
from rollpoint.protocol.engine_faults import TOKEN_DATA_HOWS
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.testing.snapshot_damage import Damage


def drawn(trials: int = 400, seed: int = 7, *, journaled: bool = False) -> list[TrialPlan]:
    return draw_plans(
        trials,
        seed,
        config=Path("job.yaml"),
        root=Path("/runs"),
        replicas=2,
        within_s=3.0,
        journaled=journaled,
    )


def test_a_seed_names_the_plans() -> None:
    assert drawn(seed=3) == drawn(seed=3)
    assert drawn(seed=3) != drawn(seed=4)


def test_every_kind_and_every_lost_reply_verb_is_drawn() -> None:
    faults = [f for plan in drawn() + drawn(journaled=True) for f in plan.faults]

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


def test_issue_33s_breaks_are_drawn_after_the_other_faults_and_leave_them_as_they_were() -> None:
    later = {
        ChaosFault.LOCK_TAMPER,
        ChaosFault.SECOND_JOB,
        ChaosFault.PACK_DAMAGE,
        ChaosFault.PACK_DAMAGE_LIVE,
        *ENGINE_DATA,
        ChaosFault.CHECKPOINT_KILL,  # issue 37's, drawn after these
    }
    for plan in drawn():
        kinds = [f.kind for f in plan.faults]
        first_later = next((i for i, k in enumerate(kinds) if k in later), len(kinds))
        assert not set(kinds[first_later:]) - later, kinds
        if ChaosFault.PACK_DAMAGE in kinds:
            # After a kill (the runner has it wait for the store's first rebase), and
            # never with the newest snapshot damaged too (nothing might be left).
            assert [f for f in plan.faults if f.kind in KILLS and f.run == 0]
            assert ChaosFault.SNAPSHOT_TAMPER not in kinds
            (damage,) = [f for f in plan.faults if f.kind is ChaosFault.PACK_DAMAGE]
            assert damage.run == 1 and damage.how in {"flip", "truncate", "delete"}
    hows = {f.how for p in drawn() for f in p.faults if f.kind is ChaosFault.LOCK_TAMPER}
    assert hows == {"deleted", "replaced"}


def test_the_engine_data_breaks_leave_every_fault_drawn_before_them_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Drawn from a generator of their own: the draw as it was before they existed (none
    # drawn, no random number taken for them) gives every trial the same other faults
    # (not only the first trial: one shared generator would shift every later one's).
    with_them = drawn()
    monkeypatch.setattr(chaos_draw, "_draw_engine_data", lambda rng, faults: [])
    without = drawn()

    assert [[f for f in p.faults if f.kind not in ENGINE_DATA] for p in with_them] == [
        p.faults for p in without
    ]
    assert sum(f.kind in ENGINE_DATA for p in with_them for f in p.faults) > 0


def test_an_engine_data_break_names_its_call_and_never_lands_on_servers_run_apart() -> None:
    plans = drawn()
    engine = [(p, f) for p in plans for f in p.faults if f.kind in ENGINE_DATA]

    assert {f.kind for _, f in engine} == ENGINE_DATA
    for plan, fault in engine:
        assert not plan.servers_apart  # the scripted policy would be serve's, for all runs
        assert ENGINE_CALLS[0] <= fault.call <= ENGINE_CALLS[1]
        assert fault in plan.model_copy(update={"run": fault.run}).in_process()
        if fault.run == 1:
            assert any(f.run == 0 and f.kind in KILLS for f in plan.faults)
        assert "on policy call" in fault.describe()
    hows = {f.how for _, f in engine if f.kind is ChaosFault.BAD_TOKEN_DATA}
    assert hows == set(TOKEN_DATA_HOWS)
    assert {f.how for _, f in engine if f.kind is not ChaosFault.BAD_TOKEN_DATA} == {None}


def test_a_journal_is_damaged_only_before_the_rerun_of_a_whole_killed_job_that_journals() -> None:
    journaled = drawn(journaled=True)
    damaged = [(p, f) for p in journaled for f in p.faults if f.kind in JOURNAL_DAMAGES]

    assert {f.kind for _, f in damaged} == set(JOURNAL_DAMAGES)
    assert {f.participant for _, f in damaged} == set(ParticipantKind)
    for plan, fault in damaged:
        assert fault.run == 1 and fault is plan.faults[-1]  # drawn after every other fault
        assert [f.kind for f in plan.faults if f.run == 0 and f.kind in KILLS] in (
            [ChaosFault.PROCESS_KILL],
            [ChaosFault.JOURNAL_COMMIT_KILL],
        )
        assert plan.model_copy(update={"run": 1}).before_run()[-1] == fault
    # A job that does not journal draws none, and every other fault of a seed stays.
    plain = drawn()
    assert not [f for p in plain for f in p.faults if f.kind in JOURNAL_DAMAGES]

    # ... but a full store (through an fsspec store, where a journal is spooled), and some
    # process kills timed into a group commit.
    def as_plain(f: PlannedFault) -> PlannedFault:
        if f.kind is ChaosFault.JOURNAL_COMMIT_KILL:
            return f.model_copy(update={"kind": ChaosFault.PROCESS_KILL})
        return f

    assert [
        [as_plain(f) for f in p.faults if f.kind not in JOURNAL_DAMAGES] for p in journaled
    ] == [[f for f in p.faults if f.kind is not ChaosFault.STORE_FULL] for p in plain]
    assert not [f for p in journaled for f in p.faults if f.kind is ChaosFault.STORE_FULL]
    commits = [f for p in journaled for f in p.faults if f.kind is ChaosFault.JOURNAL_COMMIT_KILL]
    kills = [f for p in plain for f in p.faults if f.kind is ChaosFault.PROCESS_KILL]
    assert 0 < len(commits) < len(kills)
    assert not [f for p in plain for f in p.faults if f.kind is ChaosFault.JOURNAL_COMMIT_KILL]


def test_a_checkpoint_kill_is_drawn_last_on_a_replica_no_proxy_stands_in_front_of() -> None:
    plans = drawn()
    kills = [
        (plan, f) for plan in plans for f in plan.faults if f.kind is ChaosFault.CHECKPOINT_KILL
    ]
    assert kills
    for plan, fault in kills:
        # The last of the seed's own stream (the engine-data faults come from another).
        assert [f for f in plan.faults if f.kind not in ENGINE_DATA][-1] is fault
        assert not plan.servers_apart
        assert fault.servers == list(ParticipantKind)
        proxied = {f.replica for f in plan.faults if f.run == fault.run and f.kind in PROXIED}
        assert fault.replica not in proxied
