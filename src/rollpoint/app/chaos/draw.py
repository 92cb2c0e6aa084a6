"""Drawing every trial's faults from one seed: :func:`draw_plans`.

Owns how ``rollpoint chaos`` chooses what each trial suffers and when: the kinds, their
moments within a run, which run of a trial they hit, and the shares and bounds
:mod:`rollpoint.app.chaos.plan` names. Every draw comes from ``random.Random(seed)``, so a
seed names a run of trials; the faults added later (issue 33's engine-data breaks, the
journal's) come from generators of their own, so a seed's other faults stay what they were
with them or without.
"""

from __future__ import annotations

import random
from pathlib import Path

from rollpoint.app.chaos.plan import (
    CHECKPOINT_KILL_SHARE,
    CLOCK_SKEW_S,
    COMMIT_KILL_SHARE,
    DRAWN_APART,
    EARLY_S,
    ENGINE_CALLS,
    ENGINE_SHARES,
    IN_PROCESS,
    JOURNAL_DAMAGE_SHARE,
    JOURNAL_DAMAGES,
    KILLS,
    LATER_SHARES,
    LOCK_TAMPERING,
    LOST_REPLY_VERBS,
    OWN_SERVERS,
    PACK_DAMAGE_SHARE,
    PACK_DAMAGES,
    PROXIED,
    RESTART_DOWN_S,
    SECOND_RUN_SHARE,
    SIGNALLED,
    STOP_S,
    STORE_FULL_S,
    TAMPER_SHARE,
    TRAINER_KILL_SHARE,
    ChaosFault,
    PlannedFault,
    TrialPlan,
)
from rollpoint.protocol.control import Verb
from rollpoint.protocol.engine_faults import TOKEN_DATA_HOWS
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.testing.snapshot_damage import Damage


def draw_plans(
    trials: int,
    seed: int,
    *,
    config: Path,
    root: Path,
    replicas: int,
    within_s: float,
    journaled: bool = False,
) -> list[TrialPlan]:
    """Every trial's plan, drawn from ``random.Random(seed)``; trial ``k`` works in
    ``root/trial-<k>``. Faults land within ``within_s`` of a run's servers coming up.
    ``journaled`` (the job has ``journal.enabled``) adds the journal faults, drawn after
    every other fault of a trial: a seed's other faults are the same either way."""
    rng = random.Random(seed)
    # Issue 33's engine-data breaks: a generator of their own, so a seed's other faults
    # stay what they were without them, in every trial (not only in the first).
    engine_rng = random.Random(f"engine-data/{seed}")
    plans = []
    for k in range(trials):
        faults = _draw_faults(rng, replicas, within_s)
        faults += _draw_engine_data(engine_rng, faults)
        plans.append(TrialPlan(trial=k, config=config, workdir=root / f"trial-{k}", faults=faults))
    if journaled:
        # From a stream of their own: the rest of every trial's plan stays as it was, but
        # for a full store: it is injected through an fsspec store (``faultyfile://``),
        # where a journal is spooled and shipped, and a full store then fails the ships,
        # not the appends: not the fault it means to inject.
        journal_rng = random.Random(f"journal-{seed}")
        commit_rng = random.Random(f"journal-commit-{seed}")
        plans = [
            plan.model_copy(
                update={
                    "faults": [
                        _in_a_commit(commit_rng, f)
                        for f in plan.faults
                        if f.kind is not ChaosFault.STORE_FULL
                    ]
                    + _draw_journal_damage(journal_rng, plan.faults)
                }
            )
            for plan in plans
        ]
    return plans


def _draw_engine_data(rng: random.Random, drawn: list[PlannedFault]) -> list[PlannedFault]:
    """The engine-data faults of a trial whose other faults are ``drawn``: none where its
    servers run apart (the scripted policy is ``rollpoint serve``'s, started once for all
    its runs). Drawn as many times from ``rng`` whatever they come to."""
    killed = any(f.kind in KILLS and f.run == 0 for f in drawn)
    apart = any(f.kind is ChaosFault.TRAINER_KILL for f in drawn)
    faults = []
    for kind, share in ENGINE_SHARES.items():
        hit, second, call = rng.random(), rng.random(), rng.randint(*ENGINE_CALLS)
        how = rng.choice(TOKEN_DATA_HOWS)
        if hit >= share or apart:
            continue
        run = 1 if killed and second < 0.5 else 0
        faults.append(
            PlannedFault(
                kind=kind,
                run=run,
                at_s=0.0,
                call=call,
                how=how if kind is ChaosFault.BAD_TOKEN_DATA else None,
            )
        )
    return faults


def _in_a_commit(rng: random.Random, fault: PlannedFault) -> PlannedFault:
    """``fault``, or a process kill made a ``journal_commit_kill`` (one draw per fault)."""
    hit = rng.random() < COMMIT_KILL_SHARE
    if fault.kind is ChaosFault.PROCESS_KILL and hit:
        return fault.model_copy(update={"kind": ChaosFault.JOURNAL_COMMIT_KILL})
    return fault


def _draw_journal_damage(rng: random.Random, faults: list[PlannedFault]) -> list[PlannedFault]:
    """A journal damaged before the rerun of a trial whose first run is killed whole (a
    journal is read again only when its server starts again; a trainer killed alone
    leaves its servers and their journals open), in :data:`JOURNAL_DAMAGE_SHARE` of them."""
    killed = any(f.kind is ChaosFault.PROCESS_KILL and f.run == 0 for f in faults)
    if rng.random() >= JOURNAL_DAMAGE_SHARE or not killed:
        return []
    return [
        PlannedFault(
            kind=rng.choice(sorted(JOURNAL_DAMAGES)),
            run=1,
            at_s=0.0,
            participant=rng.choice(list(ParticipantKind)),
        )
    ]


def _draw_faults(rng: random.Random, replicas: int, within_s: float) -> list[PlannedFault]:
    faults: list[PlannedFault] = []
    kill_at: float | None = None
    kill = ChaosFault.PROCESS_KILL
    if rng.random() < 0.5:
        kill_at = rng.uniform(0.1, within_s)
        if rng.random() < TRAINER_KILL_SHARE:
            kill = ChaosFault.TRAINER_KILL
        faults.append(PlannedFault(kind=kill, run=0, at_s=kill_at))
        if rng.random() < 0.25:  # the rerun killed too, often during its restore
            faults.append(PlannedFault(kind=kill, run=1, at_s=rng.uniform(0.0, 1.0)))
    # One proxied fault per participant and run: a partition heals its whole proxy.
    free = {run: [(r, p) for r in range(replicas) for p in ParticipantKind] for run in range(2)}
    # Servers apart from the trainer are not its processes: it cannot signal a replica's.
    pool = sorted(
        IN_PROCESS - DRAWN_APART - (OWN_SERVERS if kill is ChaosFault.TRAINER_KILL else set())
    )
    kinds = rng.sample(pool, rng.randint(0 if kill_at is not None else 1, 3))
    # A replica kill first: proxied faults then avoid its replica (once it restarts on new
    # ports, the trainer no longer goes through their proxy).
    kinds.sort(key=lambda k: k is not ChaosFault.REPLICA_KILL)
    for kind in kinds:
        # With a kill, the fault lands before it or in the resumed run.
        run = 0 if kill_at is None or rng.random() < 0.5 else 1
        last = kill_at if run == 0 and kill_at is not None else within_s
        if kind is ChaosFault.LOST_RUN_REPLY:
            # Row streams open as groups are sent, most of them early: a late rule
            # would wait for a stream that never comes.
            last = min(last, EARLY_S)
        at_s = rng.uniform(0.05, max(last, 0.1))
        fault = _draw_one(rng, kind, run, at_s, free[run], replicas)
        if fault is None:
            continue
        faults.append(fault)
        if kind is ChaosFault.REPLICA_KILL and replicas > 1:
            free[run] = [t for t in free[run] if t[0] != fault.replica]
    # Drawn last, so the other faults of a seed stay what they were without them.
    if rng.random() < SECOND_RUN_SHARE:
        run = 0 if kill_at is None or rng.random() < 0.5 else 1
        last = kill_at if run == 0 and kill_at is not None else within_s
        faults.append(
            PlannedFault(
                kind=ChaosFault.SECOND_RUN, run=run, at_s=rng.uniform(0.05, max(last, 0.1))
            )
        )
    if kill_at is not None and rng.random() < TAMPER_SHARE:
        faults.append(
            PlannedFault(
                kind=ChaosFault.SNAPSHOT_TAMPER, run=1, at_s=0.0, damage=rng.choice(list(Damage))
            )
        )
    tampered = any(f.kind is ChaosFault.SNAPSHOT_TAMPER for f in faults)
    faults += _draw_later(rng, kill_at, within_s, tampered=tampered)
    if kill is not ChaosFault.TRAINER_KILL and rng.random() < CHECKPOINT_KILL_SHARE:
        run = 0 if kill_at is None or rng.random() < 0.5 else 1
        last = kill_at if run == 0 and kill_at is not None else within_s
        at_s = rng.uniform(0.05, max(last, 0.1))
        # Not a replica a proxied fault of the run stands in front of: restarted on new
        # ports, the trainer would no longer go through that proxy.
        proxied = {f.replica for f in faults if f.run == run and f.kind in PROXIED}
        targets = [r for r in range(replicas) if r not in proxied]
        if targets:
            faults.append(
                PlannedFault(
                    kind=ChaosFault.CHECKPOINT_KILL,
                    run=run,
                    at_s=at_s,
                    replica=rng.choice(targets),
                    servers=list(ParticipantKind),
                )
            )
    return faults


def _draw_later(
    rng: random.Random, kill_at: float | None, within_s: float, *, tampered: bool
) -> list[PlannedFault]:
    """Issue 33's breaks, drawn after every other fault of the trial. A shared records
    file is damaged only where the newest snapshot is not (two damages at once may leave
    no snapshot to fall back to, rightly refused)."""
    faults = []
    for kind, share in LATER_SHARES.items():
        if rng.random() >= share:
            continue
        run = 0 if kill_at is None or rng.random() < 0.5 else 1
        last = kill_at if run == 0 and kill_at is not None else within_s
        at_s = rng.uniform(0.05, max(last, 0.1))
        if kind is ChaosFault.PACK_DAMAGE_LIVE:
            # Once snapshots share records files: at least two with saved episodes.
            faults.append(PlannedFault(kind=kind, run=run, at_s=0.0, after_snapshots=2))
        elif kind is ChaosFault.LOCK_TAMPER:
            faults.append(
                PlannedFault(kind=kind, run=run, at_s=at_s, how=rng.choice(LOCK_TAMPERING))
            )
        else:
            faults.append(PlannedFault(kind=kind, run=run, at_s=at_s))
    if kill_at is not None and rng.random() < PACK_DAMAGE_SHARE and not tampered:
        faults.append(
            PlannedFault(kind=ChaosFault.PACK_DAMAGE, run=1, at_s=0.0, how=rng.choice(PACK_DAMAGES))
        )
    return faults


def _draw_one(
    rng: random.Random,
    kind: ChaosFault,
    run: int,
    at_s: float,
    free: list[tuple[int, ParticipantKind]],
    replicas: int,
) -> PlannedFault | None:
    """One fault of ``kind``; None when no participant it can target is still free."""
    if kind is ChaosFault.STORE_FULL:
        # Shorter than a save's retry window (retry_after_seconds): the run rides it out;
        # a longer one stops it on purpose (three failed saves in a row).
        return PlannedFault(
            kind=kind,
            run=run,
            at_s=at_s,
            seconds=rng.uniform(*STORE_FULL_S),
            error=rng.choice(["ENOSPC", "EIO"]),
        )
    if kind is ChaosFault.PARTICIPANT_RESTART:
        return PlannedFault(
            kind=kind,
            run=run,
            at_s=at_s,
            replica=rng.randrange(replicas),
            servers=[rng.choice(list(ParticipantKind))],
            seconds=rng.uniform(*RESTART_DOWN_S),
        )
    if kind is ChaosFault.CLOCK_SKEW:
        return PlannedFault(
            kind=kind,
            run=run,
            at_s=0.0,
            replica=rng.randrange(replicas),
            participant=rng.choice(list(ParticipantKind)),
            seconds=rng.uniform(-CLOCK_SKEW_S, CLOCK_SKEW_S),
        )
    if kind is ChaosFault.PEER_PARTITION:
        return PlannedFault(
            kind=kind,
            run=run,
            at_s=at_s,
            replica=rng.randrange(replicas),
            participant=rng.choice([ParticipantKind.MODEL, ParticipantKind.RESOURCES]),
            seconds=rng.uniform(0.1, 0.6),
            forward=rng.random() < 0.5,
        )
    if kind in SIGNALLED:
        servers = rng.choice(
            [[ParticipantKind.AGENT], [ParticipantKind.RESOURCES], list(ParticipantKind)]
        )
        fault = PlannedFault(
            kind=kind, run=run, at_s=at_s, replica=rng.randrange(replicas), servers=servers
        )
        if kind is ChaosFault.REPLICA_STOP:
            return fault.model_copy(update={"seconds": rng.uniform(*STOP_S)})
        return fault
    # Model and resources URLs carry only control traffic from the trainer: a partition of
    # them cuts the control routes, not the row streams. /run is the agent's.
    allowed = {
        ChaosFault.LOST_RUN_REPLY: {ParticipantKind.AGENT},
        ChaosFault.PARTITION: {ParticipantKind.MODEL, ParticipantKind.RESOURCES},
    }.get(kind, set(ParticipantKind))
    targets = [t for t in free if t[1] in allowed]
    if not targets:
        return None
    replica, participant = rng.choice(targets)
    free.remove((replica, participant))
    fault = PlannedFault(kind=kind, run=run, at_s=at_s, replica=replica, participant=participant)
    if kind is ChaosFault.LOST_CONTROL_REPLY:
        return fault.model_copy(
            update={
                "verb": rng.choice(
                    [
                        v
                        for v in (*LOST_REPLY_VERBS, *([Verb.RESTORE] if run else []))
                        if v is not Verb.ACK or participant is ParticipantKind.AGENT
                    ]
                )
            }
        )
    if kind is ChaosFault.PARTITION:
        return fault.model_copy(
            update={"seconds": rng.uniform(0.1, 0.6), "forward": rng.random() < 0.5}
        )
    if kind is ChaosFault.SLOW_PREPARE:
        return fault.model_copy(update={"seconds": rng.uniform(0.1, 1.5)})
    return fault
