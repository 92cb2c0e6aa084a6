"""What one chaos trial will suffer, and when: the plan the runner draws and a trial obeys.

Owns the fault vocabulary of ``rollpoint chaos`` (:class:`ChaosFault`, one member per kind
the table counts), the plan of one trial (:class:`TrialPlan`, passed as JSON on the trial
process's command line), the events a trial process prints (:class:`TrialEvent`, one JSON
line each on stdout), and :func:`draw_plans`, which draws every trial's faults from one
``random.Random(seed)`` so a seed names a run of trials.

Moments are seconds after a run's servers are up. Whole-process kills are the runner's
(it owns the process group), and so is damage to the trial's snapshots between two runs;
every other fault is applied inside the trial process, on the run the plan names. It does not run, kill or check anything.
"""

from __future__ import annotations

import random
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rollpoint.protocol.control import Verb
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.testing.faulty_store import store_url
from rollpoint.testing.snapshot_damage import Damage

MAX_RERUNS = 4
"""Reruns of a trial after its first run, until one exits 0."""
EARLY_S = 0.5
"""A lost row stream reply is planned this early in a run: streams open as groups go out."""


class ChaosFault(StrEnum):
    """The kinds of fault a trial can suffer."""

    PROCESS_KILL = "process_kill"
    """SIGKILL of the trial's whole process group (trainer and servers); then a rerun."""
    TRAINER_KILL = "trainer_kill"
    """SIGKILL of the trainer alone: the trial's servers run under ``rollpoint serve`` in a
    process group of their own and live on; the rerun attaches to them again."""
    REPLICA_KILL = "replica_kill"
    """SIGKILL of one replica's server processes; the runtime restarts the replica."""
    PARTICIPANT_RESTART = "participant_restart"
    """One server of a replica SIGKILLed and started again on the same address, empty,
    after ``seconds`` (a container restarted behind a stable address): the runtime sees no
    replica go down, the trainer a participant unreachable for a while that comes back
    having forgotten everything."""
    REPLICA_STOP = "replica_stop"
    """SIGSTOP of one replica's server processes, SIGCONT a moment later: they wake up
    past their leases and deadlines, with requests queued on their sockets."""
    LOST_RUN_REPLY = "lost_run_reply"
    """One ``POST /run`` row stream runs to its end on the agent, and its reply is lost."""
    LOST_CONTROL_REPLY = "lost_control_reply"
    """A participant applies a commit or a resume, and its reply is lost."""
    PARTITION = "partition"
    """A participant's control routes are unreachable for a moment (refused), then heal."""
    SLOW_PREPARE = "slow_prepare"
    """A participant's prepare reaches it late."""
    CLOCK_SKEW = "clock_skew"
    """One participant's control clock runs ahead or behind the trainer's, within the
    protocol's tolerance (:data:`CLOCK_SKEW_S`), for the whole run: every deadline and
    lease it keeps is read against it."""
    PEER_PARTITION = "peer_partition"
    """An agent's link to its model or resources server is cut for a moment (refused),
    then heals; with ``forward`` the request that cuts it reaches the peer, which acts (a
    tool call applied), and its reply is lost."""
    STORE_FULL = "store_full"
    """Every write to the snapshot store fails (``ENOSPC`` or ``EIO``) for a moment, for the
    trainer and every participant alike; then the disk has room again."""
    SECOND_RUN = "second_run"
    """A second run of the trial started on its workdir while the first runs (a scheduler
    retrying a job still being torn down): it must be refused, naming the holder, before
    it touches anything."""
    SNAPSHOT_TAMPER = "snapshot_tamper"
    """Between a kill and the rerun, the newest published snapshot is damaged (a byte of a
    file, a sealed field, or its manifest gone: :mod:`rollpoint.testing.snapshot_damage`);
    the rerun must skip it and resume from the one before."""


KILLS = frozenset({ChaosFault.PROCESS_KILL, ChaosFault.TRAINER_KILL})
"""The runner's faults: it SIGKILLs the trial process's group (with the servers in it, or
not when they run under ``rollpoint serve``)."""
RUNNER_DURING = frozenset({ChaosFault.SECOND_RUN})
"""The runner's other faults during a run: it starts a second run beside it."""
BETWEEN_RUNS = frozenset({ChaosFault.SNAPSHOT_TAMPER})
"""The runner's faults on the trial's folder, after one run ended and before the next."""
IN_PROCESS = frozenset(set(ChaosFault) - KILLS - BETWEEN_RUNS - RUNNER_DURING)
"""Faults the trial process applies itself."""
SECOND_RUN_SHARE = 0.15
"""Of all trials, this share start a second run on the workdir while one runs."""
TAMPER_SHARE = 0.3
"""Of the trials drawn with a kill, this share damage a snapshot before the rerun."""
TRAINER_KILL_SHARE = 0.3
"""Of the trials drawn with a kill, this share kill the trainer alone."""
PROXIED = frozenset(
    {
        ChaosFault.LOST_RUN_REPLY,
        ChaosFault.LOST_CONTROL_REPLY,
        ChaosFault.PARTITION,
        ChaosFault.SLOW_PREPARE,
    }
)
"""Faults applied by a fault proxy in front of one participant's URL."""
SIGNALLED = frozenset(
    {ChaosFault.REPLICA_KILL, ChaosFault.REPLICA_STOP, ChaosFault.PARTICIPANT_RESTART}
)
"""Faults the trial process signals its own runtime's server processes with."""
SPEC_FAULTS = frozenset({ChaosFault.PEER_PARTITION, ChaosFault.CLOCK_SKEW})
"""Faults set up in a server's spec as the runtime starts it."""
OWN_SERVERS = SIGNALLED | SPEC_FAULTS
"""Faults that need the trial's servers to be its own processes (not ``rollpoint serve``'s):
signalled, or set up in their specs as they start."""
PEER_PATHS = {ParticipantKind.MODEL: "/v1/", ParticipantKind.RESOURCES: "/tools/"}
"""What a ``peer_partition`` is cut on: a policy call, or a tool call (a side effect)."""
CLOCK_SKEW_S = 2.0
"""How far a ``clock_skew`` moves a participant's clock, either way: within the
tolerance docs/protocol.md states (well under ``snapshot.deadline_seconds``)."""
RESTART_DOWN_S = (0.0, 3.0)
"""How long a ``participant_restart``'s server is gone before it starts again (then its
own start-up, about a second)."""
STORE_FULL_S = (0.2, 0.8)
"""How long a ``store_full`` lasts."""
STOP_S = (0.2, 2.5)
"""How long a ``replica_stop`` lasts: from shorter than a lease to past a save's deadline."""
LOST_REPLY_VERBS = (
    Verb.PREPARE,
    Verb.RENEW,
    Verb.COMMIT,
    Verb.CONFIRM,
    Verb.RESUME,
    Verb.RETIRE,
    Verb.FORGET,
    Verb.ACK,
)
"""The verbs a ``lost_control_reply`` may lose at any moment, each sent by the run's
trainer (``ack`` to agents only); a rerun may lose a ``restore`` reply too (its first call,
struck whatever the moment)."""


class PlannedFault(StrictModel):
    kind: ChaosFault
    run: Annotated[int, Field(ge=0, le=MAX_RERUNS)]
    """Which run of the trial suffers it: 0 the first, 1 the first rerun, ..."""
    at_s: Annotated[float, Field(ge=0)]
    """Seconds after that run's servers are up (or after ``after_snapshots``)."""
    after_snapshots: Annotated[int, Field(ge=0)] = 0
    """When not 0, ``at_s`` counts from the moment that run has published this many
    snapshots that saved episodes in flight: a fault that needs saved state to act on (a
    kill whose rerun continues saved episodes, a damage that needs a snapshot before the
    newest) gets it however slow the machine is, instead of hoping a fixed moment comes
    after it."""
    replica: Annotated[int, Field(ge=0)] = 0
    participant: ParticipantKind = ParticipantKind.AGENT
    """Proxied faults: whose URL the proxy stands in front of; ``peer_partition``: which
    of the agent's peers it cuts the agent from."""
    servers: list[ParticipantKind] = Field(default_factory=list)
    """``replica_kill``, ``replica_stop``: which of the replica's servers are signalled;
    ``participant_restart``: the one restarted."""
    verb: Verb | None = None
    """``lost_control_reply``: the verb whose reply is lost."""
    seconds: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    """``partition``, ``peer_partition``, ``replica_stop``, ``store_full``: how long it
    lasts; ``participant_restart``: how long the server is gone; ``slow_prepare``: how late the prepare arrives; ``clock_skew``: how far ahead
    (negative: behind) the participant's clock runs."""
    forward: bool = False
    """``partition``, ``peer_partition``: the participant gets the request that starts it
    (its reply is lost)."""
    damage: Damage | None = None
    """``snapshot_tamper``: how the newest snapshot is damaged."""
    error: Literal["ENOSPC", "EIO"] | None = None
    """``store_full``: what the failed writes raise."""

    @model_validator(mode="after")
    def _durations_are_not_negative(self) -> PlannedFault:
        if self.seconds < 0 and self.kind is not ChaosFault.CLOCK_SKEW:
            raise ValueError(f"{self.kind}: seconds must be >= 0, got {self.seconds}")
        return self

    def describe(self) -> str:
        where = f"replica-{self.replica}"
        if self.kind in PROXIED or self.kind is ChaosFault.CLOCK_SKEW:
            where = f"{self.participant}@{where}"
        elif self.kind is ChaosFault.PEER_PARTITION:
            where = f"agent-{self.participant} link@{where}"
        extra = {
            ChaosFault.REPLICA_KILL: f" ({', '.join(self.servers)})",
            ChaosFault.PARTICIPANT_RESTART: f" ({', '.join(self.servers)}, down {self.seconds:.2f}s)",
            ChaosFault.REPLICA_STOP: f" ({', '.join(self.servers)}, {self.seconds:.2f}s)",
            ChaosFault.LOST_CONTROL_REPLY: f" ({self.verb})",
            ChaosFault.PARTITION: f" ({self.seconds:.2f}s{', forwarded' if self.forward else ''})",
            ChaosFault.PEER_PARTITION: f" ({self.seconds:.2f}s{', forwarded' if self.forward else ''})",
            ChaosFault.SLOW_PREPARE: f" (+{self.seconds:.2f}s)",
            ChaosFault.STORE_FULL: f" ({self.error}, {self.seconds:.2f}s)",
            ChaosFault.CLOCK_SKEW: f" ({self.seconds:+.2f}s)",
        }.get(self.kind, "")
        at = f"{self.at_s:.2f}s" + (
            f" after {self.after_snapshots} snapshots with episodes" if self.after_snapshots else ""
        )
        if self.kind is ChaosFault.SECOND_RUN:
            return f"{self.kind} on the workdir at {at} of run {self.run}"
        if self.kind is ChaosFault.SNAPSHOT_TAMPER:
            return f"{self.kind} of the newest snapshot ({self.damage}) before run {self.run}"
        if self.kind is ChaosFault.PROCESS_KILL:
            where = "trial"
        elif self.kind is ChaosFault.STORE_FULL:
            where = "the snapshot store"
        elif self.kind is ChaosFault.TRAINER_KILL:
            where = "trainer"
        return f"{self.kind} of {where}{extra} at {at} of run {self.run}"


class TrialPlan(StrictModel):
    """One run of one trial: what ``python -m rollpoint.app.chaos.trial`` is given."""

    trial: Annotated[int, Field(ge=0)]
    config: Path
    """The job's config; the trial overrides its workdir, snapshot store and ports."""
    workdir: Path
    run: Annotated[int, Field(ge=0, le=MAX_RERUNS)] = 0
    """0 starts the job fresh; a rerun resumes from the trial's snapshots."""
    faults: list[PlannedFault] = Field(default_factory=list)
    """Every fault of the trial, of every run."""
    served: Path | None = None
    """The deployment ``rollpoint serve --json`` printed, when the trial's servers run
    apart from the trainer (set by the runner for a trial with a trainer kill)."""

    @property
    def servers_apart(self) -> bool:
        """The trial's servers outlive its trainer: it plans a trainer kill."""
        return any(f.kind is ChaosFault.TRAINER_KILL for f in self.faults)

    def in_process(self) -> list[PlannedFault]:
        """The faults this run's trial process applies itself."""
        return [f for f in self.faults if f.run == self.run and f.kind in IN_PROCESS]

    def kills(self) -> list[PlannedFault]:
        """The runner's kill of this run (at most one)."""
        return [f for f in self.faults if f.run == self.run and f.kind in KILLS]

    def second_runs(self) -> list[PlannedFault]:
        """The runner's second runs beside this one."""
        return [f for f in self.faults if f.run == self.run and f.kind in RUNNER_DURING]

    def before_run(self) -> list[PlannedFault]:
        """The runner's faults on the trial's folder before this run starts."""
        return [f for f in self.faults if f.run == self.run and f.kind in BETWEEN_RUNS]


def trial_store_folder(plan: TrialPlan) -> Path:
    """The local folder of a trial's snapshot store: its own ``snapshots`` folder."""
    return plan.workdir / "snapshots"


def trial_store(plan: TrialPlan) -> str:
    """The ``snapshot.store`` of a trial's runs and of its servers apart (named alike by
    both): its own folder, through the fault-injecting ``faultyfile://`` protocol when the
    plan fills the disk (:mod:`rollpoint.testing.faulty_store`)."""
    folder = trial_store_folder(plan)
    if any(f.kind is ChaosFault.STORE_FULL for f in plan.faults):
        return store_url(folder)
    return str(folder)


def final_states_dir(plan: TrialPlan) -> Path:
    """Where a trial's resources servers log every verified episode's final state (the
    run's ``final_states_log``), whoever starts them: I2 is counted from it."""
    return plan.workdir / "final-states"


class TrialEvent(StrictModel):
    """One line a trial process prints on stdout."""

    event: Literal["up", "fault", "over", "missed", "resumed", "finished", "error"]
    """``fault``: a planned fault took effect; ``over``: it ended (a partition healed, a
    killed replica is back up); ``missed``: it did not take effect, ``reason`` says why;
    ``finished``/``error``: the run's last line."""
    ts: float
    """Unix time it happened."""
    kind: ChaosFault | None = None
    """``fault`` and ``over``: which kind of fault."""
    detail: str = ""
    """``fault``, ``over``, ``missed``: the fault as :meth:`PlannedFault.describe` says it."""
    reason: str = ""
    """``missed``: why it did not take effect; a runner's fault on the trial's folder
    (``fault``): what it did."""
    snapshot_id: str | None = None
    continued: int = 0
    """``resumed``: episodes continued from the snapshot."""
    restarted: int = 0
    """``resumed``: episodes the snapshot could not continue, started over."""


def draw_plans(
    trials: int, seed: int, *, config: Path, root: Path, replicas: int, within_s: float
) -> list[TrialPlan]:
    """Every trial's plan, drawn from ``random.Random(seed)``; trial ``k`` works in
    ``root/trial-<k>``. Faults land within ``within_s`` of a run's servers coming up."""
    rng = random.Random(seed)
    return [
        TrialPlan(
            trial=k,
            config=config,
            workdir=root / f"trial-{k}",
            faults=_draw_faults(rng, replicas, within_s),
        )
        for k in range(trials)
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
    pool = sorted(IN_PROCESS - (OWN_SERVERS if kill is ChaosFault.TRAINER_KILL else set()))
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
