"""What the defect scenarios share: a deployment in threads, proxies on its wires, the
trainer's parts wired as ``rollpoint run`` wires them, a spy on control calls, and a
``/run`` relay that holds result lines.

Owns setting these up and tearing them down. It asserts nothing: each scenario builds its
defect's situation from these parts and states what it checks itself.

- :class:`ScenarioCluster`: the shared :class:`~rollpoint.testing.LocalCluster` (a
  scripted policy and N replicas of real servers in threads, loops exposed to hold a gate
  or read a session book), every server a checkpoint participant under its own control
  token, warmed up; optionally a :class:`~rollpoint.testing.FaultProxy` on each agent's
  wire to its resources server.
- :func:`fronted`: fault proxies in front of chosen participants (their control routes and,
  for an agent, ``/run`` too).
- :func:`job` / :class:`Job`: the real :class:`~rollpoint.trainer.trainer.Trainer`.
- :class:`Rig`: ledger, barrier, the finished queue, dispatcher, release batcher and snapshot coordinator
  wired as the trainer wires them, without its feed and train loops: one group at a time.
- :class:`SpyClient`: a participant client noting every control call it makes.
- :class:`ReplyRelay`: a ``/run`` relay that holds chosen result lines (a reply on the
  wire) or ends every stream early and cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web
from pydantic import BaseModel

from rollpoint.app.config import RunConfig
from rollpoint.envs import get_environment
from rollpoint.http.client import HttpClient
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.control import CONTROL_PREFIX, StatusReply
from rollpoint.protocol.control_verbs import ControlVerb
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.episode import EnvironmentName, RunReply, RunRow, TaskRow
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing import FaultProxy, LocalCluster, LocalReplica, ProxiedRequest
from rollpoint.trainer.control.control_plane import ControlPlane
from rollpoint.trainer.control.control_transport import ControlTransport, HttpControlTransport
from rollpoint.trainer.control.participant_client import ParticipantAddress, ParticipantClient
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.dispatcher import Dispatcher
from rollpoint.trainer.dispatch.release_batcher import ReleaseBatcher
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.record.workdir_record import TRAIN_DATA_FILE
from rollpoint.trainer.restore.restorer import RestoredRun
from rollpoint.trainer.settings import SaveSettings
from rollpoint.trainer.snapshot.coordinator import SaveReport, SnapshotCoordinator
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import LedgerRecord, RecoveryLedger
from rollpoint.trainer.train_hooks import TrainHooks, TrainSample
from rollpoint.trainer.trainer import RunSummary, Trainer
from tests.support.job_config import job_config as small_job_config
from tests.support.polling import eventually

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)

KINDS = (ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES)
"""Participant order within a replica, as ``participant_clients`` lists them."""
RESUME = f"{CONTROL_PREFIX}/resume"
PREPARE = f"{CONTROL_PREFIX}/prepare"
RESTORE = f"{CONTROL_PREFIX}/restore"
RETIRE = f"{CONTROL_PREFIX}/retire"


def label(kind: ParticipantKind, replica: str) -> str:
    return f"{kind}@{replica}"


# --- the deployment -------------------------------------------------------------------


@dataclass
class ScenarioReplica(LocalReplica):
    tools: FaultProxy | None = None
    """The agent's wire to its resources server (start, tools, verify), when asked for."""


# Where a tool proxy points until its replica's resources server exists (never called).
_NOT_YET = "http://127.0.0.1:9"


class ScenarioCluster:
    """A :class:`~rollpoint.testing.LocalCluster` whose every server is a checkpoint
    participant writing under ``snapshot_root``, its control token its own; use as an async
    context manager. ``tool_proxy`` puts a fault proxy on each agent's wire to its
    resources server."""

    def __init__(
        self,
        snapshot_root: Path,
        *,
        replicas: int = 2,
        environment: EnvironmentName = "workplace",
        latency_ms: float = 10.0,
        lease_grace_s: float = 2.0,
        tool_proxy: bool = False,
        seed: int = 0,
    ) -> None:
        self.snapshot_root = str(snapshot_root)
        self.environment = environment
        self.token = secrets.token_urlsafe(16)
        self._count = replicas
        self._latency_ms = latency_ms
        self._lease_grace_s = lease_grace_s
        self._tool_proxy = tool_proxy
        self._seed = seed
        self._stack = AsyncExitStack()
        self._local: LocalCluster | None = None
        self.replicas: list[ScenarioReplica] = []
        self.policy_url = ""

    async def __aenter__(self) -> ScenarioCluster:
        tools: dict[str, FaultProxy] = {}
        if self._tool_proxy:
            for i in range(self._count):
                proxy = FaultProxy(_NOT_YET)
                tools[f"replica-{i}"] = await self._stack.enter_async_context(proxy)

        def wire(replica: str, resources_url: str) -> str:
            tools[replica].upstream = resources_url
            return tools[replica].url

        try:
            self._local = LocalCluster(
                replicas=self._count,
                environment=self.environment,
                latency_ms=self._latency_ms,
                seed=self._seed,
                snapshot_root=self.snapshot_root,
                control_token=self.token,
                lease_grace_s=self._lease_grace_s,
                agent_resources_url=wire if tools else None,
            )
        except BaseException:
            await self._stack.aclose()
            raise
        self.policy_url = self._local.policy.url
        self.replicas = [
            ScenarioReplica(r.name, r.model, r.resources, r.agent, tools.get(r.name))
            for r in self._local.replicas
        ]
        # One request at a time before any test traffic: FastAPI builds a route's models on
        # its first request, and apps doing that at once in threads of one process race.
        _warm_up(self.policy_url + "/v1/models")
        for replica in self.replicas:
            _warm_up(replica.resources.url + "/tools")
            _warm_up(replica.model.url + "/rollpoint/v1/stats")
            _warm_up(replica.agent.url + "/rollpoint/v1/sessions")
            for kind in KINDS:
                _warm_up(replica.url(kind) + CONTROL_PREFIX + "/status", self.token)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()  # proxies first: a held tool call is cut, not waited for
        if self._local is not None:
            await asyncio.to_thread(self._local.close)

    # --- views -------------------------------------------------------------------------

    def replica(self, name: str) -> ScenarioReplica:
        (found,) = [r for r in self.replicas if r.name == name]
        return found

    def url_of(self, participant: str) -> str:
        kind, _, replica = participant.partition("@")
        return self.replica(replica).url(ParticipantKind(kind))

    def deployment(self, run_urls: Mapping[str, str] | None = None) -> Deployment:
        """The deployment; ``run_urls`` (by replica) sends that replica's ``/run`` elsewhere."""
        urls = run_urls or {}
        endpoints = [
            r.endpoints.model_copy(update={"agent_url": urls.get(r.name, r.agent.url)})
            for r in self.replicas
        ]
        return Deployment(replicas=endpoints, policy_url=f"{self.policy_url}/v1")

    def clients(
        self,
        http: HttpClient,
        *,
        urls: Mapping[str, str] | None = None,
        spy: list[ControlCall] | None = None,
    ) -> list[ParticipantClient]:
        """One control client per participant; ``urls`` (by label) reaches some through
        proxies; with ``spy``, every call is noted there."""
        clients: list[ParticipantClient] = []
        for replica in self.replicas:
            for kind in KINDS:
                url = (urls or {}).get(label(kind, replica.name), replica.url(kind))
                address = ParticipantAddress(kind=kind, replica=replica.name, url=url)
                clients.append(
                    ParticipantClient(address, http)
                    if spy is None
                    else SpyClient(address, http, spy)
                )
        return clients

    def tasks(self, n: int, seed: int = 0) -> list[TaskRow]:
        return get_environment(self.environment).make_tasks(n, seed)


def _warm_up(url: str, token: str | None = None) -> None:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10):
        pass


@asynccontextmanager
async def fronted(cluster: ScenarioCluster, *labels: str) -> AsyncIterator[dict[str, FaultProxy]]:
    """A fault proxy in front of each participant named (``"agent@replica-0"``)."""
    async with AsyncExitStack() as stack:
        yield {
            name: await stack.enter_async_context(FaultProxy(cluster.url_of(name)))
            for name in labels
        }


def rollout_is(rollout_id: str) -> Callable[[ProxiedRequest], bool]:
    """A fault-proxy predicate: the request body names an episode of ``rollout_id``."""

    def matches(request: ProxiedRequest) -> bool:
        body = request.json()
        return isinstance(body, dict) and body.get("episode", {}).get("rollout_id") == rollout_id

    return matches


async def statuses(clients: list[ParticipantClient]) -> dict[str, StatusReply]:
    replies = await asyncio.gather(*(c.status() for c in clients))
    return {c.label: r for c, r in zip(clients, replies, strict=True)}


def run_row(ledger: RecoveryLedger, record: LedgerRecord, *, attempt: int | None = None) -> RunRow:
    """The ``/run`` row of a ledger record (of ``attempt``, by default the record's)."""
    episode = (
        record.episode
        if attempt is None
        else record.episode.model_copy(update={"attempt": attempt})
    )
    return RunRow(
        task=ledger.task(record.task_id),
        group_id=record.group_id,
        row=record.row,
        episode=episode,
        max_turns=12,
    )


async def play(http: HttpClient, agent_url: str, rows: list[RunRow]) -> list[dict[str, Any]]:
    """``POST /run`` straight to an agent; every result line, once all arrived."""
    body = {"rows": [row.model_dump(mode="json") for row in rows]}
    return [line async for line in http.stream_ndjson(f"{agent_url}/run", body)]


# --- control calls, noted --------------------------------------------------------------


@dataclass(frozen=True)
class ControlCall:
    participant: str
    verb: str
    checkpoint_id: str | None
    scope: int | None
    """How many episodes the request named (commit, restore, retire, ack), else None."""


class SpyTransport:
    """The HTTP control transport, noting every control call before it makes it."""

    def __init__(self, label: str, inner: ControlTransport, log: list[ControlCall]) -> None:
        self._label = label
        self._inner = inner
        self._log = log

    def relocated(self, url: str) -> SpyTransport:
        return SpyTransport(self._label, self._inner.relocated(url), self._log)

    async def call(
        self, verb: ControlVerb[Any, R], request: BaseModel | None, timeout_s: float
    ) -> R:
        episodes = getattr(request, "episode_ids", None)
        keys = getattr(request, "episode_keys", None) or []  # a commit's scope may be keys
        self._log.append(
            ControlCall(
                self._label,
                str(verb.verb),
                getattr(request, "checkpoint_id", None),
                None if episodes is None else len(episodes) + len(keys),
            )
        )
        return await self._inner.call(verb, request, timeout_s)


class SpyClient(ParticipantClient):
    """Our own participant client, its calls noted by a :class:`SpyTransport`."""

    def __init__(
        self, address: ParticipantAddress, http: HttpClient, log: list[ControlCall]
    ) -> None:
        inner = HttpControlTransport(http, address.url)
        super().__init__(address, transport=SpyTransport(address.label, inner, log))


# --- the real trainer -------------------------------------------------------------------


def job_config(workdir: Path, **overrides: Any) -> RunConfig:
    """A small job; ``overrides`` replace whole keys (a section replaces its section)."""
    return small_job_config(
        workdir,
        **{
            "workdir": str(workdir),
            "tasks": 6,
            "concurrency": 4,
            "max_turns": 12,
            "policy": {},
            "train": {"batch_size": 4, "checkpoint_every_steps": None},
            "snapshot": {"keep": 100, "deadline_seconds": 5, "retry_after_seconds": 0},
            **overrides,
        },
    )


@dataclass
class Job:
    cluster: ScenarioCluster
    config: RunConfig
    trainer: Trainer
    store: SnapshotStore
    metrics: TrainerMetrics
    direct: dict[str, ParticipantClient]
    """Every participant by label, reached without any proxy."""

    @property
    def coordinator(self) -> SnapshotCoordinator:
        assert self.trainer.coordinator is not None
        return self.trainer.coordinator

    async def start(self, *, in_flight: int = 2) -> asyncio.Task[RunSummary]:
        """Start the job; return once ``in_flight`` rows are in flight."""
        run = asyncio.create_task(self.trainer.run())
        await eventually(
            lambda: run.done() or self.trainer.ledger.in_flight_count() >= in_flight,
            "rows in flight",
        )
        if run.done():
            run.result()
            raise AssertionError("the job ended before the scenario could act")
        return run

    def train_rows(self) -> list[dict[str, Any]]:
        return train_rows(self.config.workdir)

    async def counts(self, kind: ParticipantKind, key: str) -> dict[str, int]:
        """One status count of every participant of ``kind``, by label."""
        clients = [c for c in self.direct.values() if c.address.kind == kind]
        return {name: s.counts[key] for name, s in (await statuses(clients)).items()}

    def every_row(self) -> set[tuple[str, int]]:
        ledger = self.trainer.ledger
        return {(gid, row) for gid in ledger.group_ids() for row in range(self.config.group_size)}


@asynccontextmanager
async def job(
    cluster: ScenarioCluster,
    config: RunConfig,
    *,
    fronts: Mapping[str, FaultProxy] | None = None,
    run_urls: Mapping[str, str] | None = None,
    hooks: TrainHooks | None = None,
    stall_timeout_s: float = 600.0,
    restored: RestoredRun | None = None,
) -> AsyncIterator[Job]:
    """The real trainer over ``cluster``; participants in ``fronts`` are reached through
    their proxy (an agent's ``/run`` too), ``run_urls`` send a replica's ``/run`` elsewhere."""
    proxies = fronts or {}
    urls = {name: proxy.url for name, proxy in proxies.items()}
    runs = {
        name.partition("@")[2]: url
        for name, url in urls.items()
        if name.startswith(f"{ParticipantKind.AGENT}@")
    } | dict(run_urls or {})
    async with HttpClient(token=cluster.token) as http:
        store = SnapshotStore(cluster.snapshot_root, keep=config.snapshot.keep)
        metrics = TrainerMetrics(config.workdir / "metrics.jsonl")
        control = ControlPlane(cluster.clients(http, urls=urls), store, metrics)
        trainer = Trainer(
            config.trainer_settings(),
            cluster.deployment(runs),
            cluster.tasks(config.tasks or 1, config.seed),
            hooks=hooks or SimulatedTrainer(config.train.step_seconds),
            stall_timeout_s=stall_timeout_s,
            control=control,
            restored=restored,
        )
        direct = {c.label: c for c in cluster.clients(http)}
        try:
            yield Job(cluster, config, trainer, store, metrics, direct)
        finally:
            metrics.close()


class RecordingHooks:
    """Train hooks that keep every sample they are given."""

    def __init__(self) -> None:
        self.samples: list[TrainSample] = []

    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        self.samples.extend(batch)
        return {"rollouts": float(len(batch))}


async def save_with_episodes(j: Job, replicas: set[str], *, min_turns: int = 1) -> SaveReport:
    """Save until a published snapshot holds, on each of ``replicas``, an episode saved
    mid-conversation (at least ``min_turns`` turns done)."""
    found: list[SaveReport] = []

    async def saved() -> bool:
        report = await j.coordinator.save()
        m = report.manifest
        if not report.published or m is None:
            return False
        if replicas <= {e.replica for e in m.episodes if e.turns_completed >= min_turns}:
            found.append(report)
            return True
        return False

    # A hang guard, not a speed check: it returns at the first such snapshot; 15 s was
    # missed once on a fresh-clone run of the whole suite (2 cores, 4 workers).
    await eventually(saved, f"a snapshot with episodes saved on {sorted(replicas)}", within_s=60)
    return found[0]


async def crash(run: asyncio.Task[Any]) -> None:
    """The trainer dies here: nothing of it runs after this returns."""
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


def train_rows(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / TRAIN_DATA_FILE
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


# --- the trainer's parts, without its loops ---------------------------------------------


class Rig:
    """Ledger, barrier, the finished queue, dispatcher, release batcher and coordinator, wired as the
    trainer wires them; groups are added and run one at a time by the scenario. The
    release batcher flushes only before a save (the trainer also flushes it on a timer)."""

    def __init__(
        self,
        cluster: ScenarioCluster,
        workdir: Path,
        *,
        data: HttpClient,
        control: HttpClient,
        fronts: Mapping[str, FaultProxy] | None = None,
        run_urls: Mapping[str, str] | None = None,
        releases: bool = True,
        concurrency: int = 8,
        row_timeout_s: float = 30.0,
        deadline_s: float = 5.0,
    ) -> None:
        self.cluster = cluster
        self.ledger = RecoveryLedger()
        self.barrier = DispatchBarrier()
        self.finished_queue = FinishedQueue()
        self.replies: list[RunReply] = []
        urls = {name: proxy.url for name, proxy in (fronts or {}).items()}
        self.roster = ReplicaRoster.of_deployment(
            cluster.deployment(run_urls), cluster.clients(control, urls=urls)
        )
        self.releases = (
            ReleaseBatcher(self.roster, self.ledger, barrier=self.barrier) if releases else None
        )
        self.dispatcher = Dispatcher(
            self.ledger,
            self.roster.deployment(),
            data,
            concurrency=concurrency,
            max_turns=12,
            row_timeout_s=row_timeout_s,
            barrier=self.barrier,
            on_reply=self._on_reply,
            roster=self.roster,
            releases=self.releases,
        )
        self.store = SnapshotStore(cluster.snapshot_root, keep=100)
        self.metrics = TrainerMetrics(workdir / "metrics.jsonl")
        self.coordinator = SnapshotCoordinator(
            self.roster,
            store=self.store,
            ledger=self.ledger,
            finished_queue=self.finished_queue,
            barrier=self.barrier,
            config=SaveSettings(deadline_seconds=deadline_s),
            metrics=self.metrics,
            trainer_state=lambda: {"train_step": 0, "policy_version": 0},
            config_fingerprint={},
        )
        if self.releases is not None:
            self.coordinator.before_save = self.releases.flush

    def add_group(self, group_id: str = "g", size: int = 4) -> list[LedgerRecord]:
        (task,) = self.cluster.tasks(1, seed=len(self.ledger.group_ids()))
        records = self.ledger.add_group(
            task.model_copy(update={"task_id": group_id}), group_id, size
        )
        self.finished_queue.expect_group(group_id, size)
        return records

    def sealed(self, rollout_id: str) -> bool:
        return any(r.episode.rollout_id == rollout_id for r in self.replies)

    async def _on_reply(self, reply: RunReply) -> None:
        record = self.ledger.seal(reply.episode.rollout_id)
        if self.releases is not None and record.replica is not None:
            self.releases.sealed(reply.episode, record.replica)
        self.finished_queue.put(reply)
        self.replies.append(reply)

    async def aclose(self) -> None:
        await self.dispatcher.aclose()
        self.metrics.close()


@asynccontextmanager
async def rig(cluster: ScenarioCluster, workdir: Path, **options: Any) -> AsyncIterator[Rig]:
    async with HttpClient() as data, HttpClient(token=cluster.token) as control:
        built = Rig(cluster, workdir, data=data, control=control, **options)
        try:
            yield built
        finally:
            await built.aclose()


# --- a /run relay -----------------------------------------------------------------------


class ReplyRelay:
    """A ``/run`` relay in front of one agent, on the test's loop.

    Result lines pass through as they arrive, except those ``hold`` picks: each waits (and
    the lines behind it in its stream with it) until :meth:`release`, which is for good.
    With ``end_after`` every stream ends cleanly after that many lines, the rest unread.
    """

    def __init__(
        self,
        upstream: str,
        *,
        hold: Callable[[dict[str, Any]], bool] | None = None,
        end_after: int | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self._hold = hold
        self._end_after = end_after
        self._released = asyncio.Event()
        self.held: list[dict[str, Any]] = []
        """The lines held so far, in the order they arrived."""
        self.cut: list[list[str]] = []
        """Per stream ended early: the rollout ids it never passed on."""
        self._port = 0
        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def release(self) -> None:
        self._released.set()

    async def __aenter__(self) -> ReplyRelay:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runner = web.ServerRunner(web.Server(self._serve), shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self._port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method != "POST" or request.path != "/run":
            return web.Response(status=404)
        assert self._session is not None
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with self._session.post(f"{self.upstream}/run", data=body, headers=headers) as up:
            if up.status != 200:
                return web.Response(status=up.status, body=await up.read(), headers=headers)
            reply = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await reply.prepare(request)
            rows = [row["episode"]["rollout_id"] for row in orjson.loads(body)["rows"]]
            owed = list(rows)
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                async for raw in up.content:
                    if not raw.strip():
                        continue
                    line = orjson.loads(raw)
                    if self._hold is not None and not self._released.is_set() and self._hold(line):
                        self.held.append(line)
                        await self._released.wait()
                    await reply.write(raw)
                    owed.remove(line["episode"]["rollout_id"])
                    if (
                        self._end_after is not None
                        and owed
                        and len(rows) - len(owed) >= self._end_after
                    ):
                        self.cut.append(owed)
                        break
                await reply.write_eof()
        return reply
