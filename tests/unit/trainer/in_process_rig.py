"""Real fences over small participants of the test, reached in-process (no sockets).

One :class:`Rig` per test: per replica a model, an agent and a resources participant (the
fake participant of the gym tests, saving its sessions as an agent does: its readiness,
failures and state are the test's), each
behind a real :class:`~rollpoint.participant.Fence` writing under ``tmp_path``, a trainer's
control client of each (:func:`rollpoint.testing.in_process_client`, with a fault transport
in between), and the trainer's parts a coordinator needs, on a store in the same root.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pydantic import JsonValue

from rollpoint.participant import ControlSettings, Fence
from rollpoint.participant.in_process_control import InProcessControlTransport
from rollpoint.protocol.control import Phase
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing import FaultTransport, in_process_client
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
from rollpoint.trainer.restore.resume_point import ResumePoint, read_trainer_document
from rollpoint.trainer.settings import SaveSettings
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator
from rollpoint.trainer.snapshot.publication import FINISHED_QUEUE_FILE, LEDGER_FILE, TRAINER_FILE
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger
from tests.unit.participant.fake_participant import FakeParticipant

KINDS = (ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES)
TASK = TaskRow(task_id="t1", environment="workplace", prompt="book a meeting")


class SessionParticipant(FakeParticipant):
    """The fake participant saving each episode as an agent does: a record whose top-level
    ``episode`` and ``turn`` say which try it holds and how far it got, so the coordinator
    counts it as saved (the fake's own records name episodes by key: restarts)."""

    async def export(self, scope: list[EpisodeId]) -> list[dict[str, JsonValue]]:
        self._hook("export")
        return [
            {"episode": e.model_dump(mode="json"), "turn": self.state[e.key]}
            for e in scope
            if e.key in self.state
        ]

    async def install(
        self, records: list[dict[str, JsonValue]], scope: list[EpisodeId]
    ) -> list[EpisodeId]:
        self._hook("install")
        wanted = {e.key for e in scope}
        state: dict[str, int] = {}
        for record in records:
            episode, turn = record.get("episode"), record.get("turn")
            if not isinstance(episode, dict) or not isinstance(turn, int):
                raise InvalidCheckpointStateError(f"bad record {record!r}")
            saved = EpisodeId.model_validate(episode)
            if saved.key in wanted:
                state[saved.next_attempt().key] = turn
        self.state = state  # all or nothing: replaced once every record was read
        return [e.next_attempt() for e in scope]


@dataclass
class Rig:
    root: Path
    participants: dict[str, SessionParticipant] = field(default_factory=dict)
    """By label, ``kind@replica``."""
    fences: dict[str, Fence] = field(default_factory=dict)
    clients: list[ParticipantClient] = field(default_factory=list)
    ledger: RecoveryLedger = field(default_factory=RecoveryLedger)
    finished_queue: FinishedQueue = field(default_factory=FinishedQueue)
    barrier: DispatchBarrier = field(default_factory=DispatchBarrier)

    @property
    def store(self) -> SnapshotStore:
        return SnapshotStore(str(self.root), keep=100, clean_leftovers=False)

    def client(self, label: str) -> ParticipantClient:
        return next(c for c in self.clients if c.label == label)

    def faults(self, label: str) -> FaultTransport:
        transport = self.client(label).transport
        assert isinstance(transport, FaultTransport)
        return transport

    def phases(self) -> dict[str, Phase]:
        return {label: fence.phase for label, fence in self.fences.items()}

    def calls(self, label: str) -> list[str]:
        """The verbs that reached ``label``'s fence, in order."""
        inner = self.faults(label).inner
        assert isinstance(inner, InProcessControlTransport)
        return inner.calls

    def dispatch(self, replica: str = "replica-0", rows: int = 2) -> list[EpisodeId]:
        """A group of ``rows`` tries in flight on ``replica``, each one turn in on every
        participant of it."""
        group = f"g{len(self.ledger.group_ids())}"
        records = self.ledger.add_group(TASK, group, rows)
        episodes = [self.ledger.dispatch(r.rollout_id, replica).episode for r in records]
        for kind in KINDS:
            self.participants[f"{kind}@{replica}"].state.update({e.key: 1 for e in episodes})
        return episodes

    def coordinator(self, deadline_s: float = 2.0) -> SnapshotCoordinator:
        return SnapshotCoordinator(
            self.clients,
            store=self.store,
            ledger=self.ledger,
            finished_queue=self.finished_queue,
            barrier=self.barrier,
            config=SaveSettings(deadline_seconds=deadline_s),
            metrics=TrainerMetrics(self.root.parent / "metrics.jsonl"),
            trainer_state=lambda: {"train_step": 0, "policy_version": 0},
            config_fingerprint={},
        )

    def resume_point(self, snapshot_id: str) -> ResumePoint:
        """The published snapshot as the restore reads it, with a train checkpoint at step 0."""
        store = self.store
        checkpoint = TrainCheckpoint(
            step=0,
            policy_version=0,
            train_data_bytes=0,
            episodes_trained=0,
            groups_trained=0,
            written_at=time.time(),
        )
        return ResumePoint(
            manifest=store.verify(snapshot_id),
            checkpoint=checkpoint,
            ledger_doc=read_trainer_document(store, snapshot_id, LEDGER_FILE),
            finished_queue_doc=read_trainer_document(store, snapshot_id, FINISHED_QUEUE_FILE),
            trainer_doc=orjson.loads(store.read_file(snapshot_id, TRAINER_FILE)),
        )

    async def aclose(self) -> None:
        for client in self.clients:
            inner = self.faults(client.label).inner
            assert isinstance(inner, InProcessControlTransport)
            await inner.aclose()
        for fence in self.fences.values():
            await fence.aclose()


def build_rig(
    root: Path,
    replicas: tuple[str, ...] = ("replica-0",),
    *,
    lease_grace_s: float = 2,
    participant: type[SessionParticipant] = SessionParticipant,
) -> Rig:
    rig = Rig(root=root)
    settings = ControlSettings(
        token="unused-in-process", snapshot_root=str(root), lease_grace_s=lease_grace_s
    )
    for replica in replicas:
        for kind in KINDS:
            made = participant(kind=kind, name=str(kind), replica=replica)
            fence = Fence(made, settings)
            label = f"{kind}@{replica}"
            rig.participants[label] = made
            rig.fences[label] = fence
            rig.clients.append(in_process_client(fence, faults=True, control_timeout_s=5.0))
    return rig
