"""One replica of the environment deployment as server specs: what both runtimes start.

Owns replica naming, the three :class:`ServerSpec` of replica ``i`` (resources and model
first, then the agent, which needs its peers' URLs) and starting them in a
:class:`ProcessGroup`. The plan is a wire model so the Ray runtime can hand it to an actor
on another node as JSON. It does not own process lifetimes (``process_group``), the policy,
or watching replicas (each runtime's ``supervise``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import JsonValue

from rollpoint.protocol.deployment import ReplicaEndpoints
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode, session_mode
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.server_spec import ServerSpec
from rollpoint.runtime.settings import RuntimeSettings

_REPLICA_PREFIX = "replica-"


def replica_name(index: int) -> str:
    return f"{_REPLICA_PREFIX}{index}"


def replica_index(name: str) -> int:
    return int(name.removeprefix(_REPLICA_PREFIX))


def replica_of(server_name: str) -> str | None:
    """``agent-replica-1`` → ``replica-1``; None for servers outside any replica (the policy)."""
    _, sep, replica = server_name.partition(f"-{_REPLICA_PREFIX}")
    return f"{_REPLICA_PREFIX}{replica}" if sep else None


def _checkpoint_mode(environment: str) -> str:
    from rollpoint.envs.registry import resolve_environment

    return str(resolve_environment(environment).checkpoint_mode)


def _environment_name(environment: str) -> str:
    """The environment's own name (what its resources server reports on ``/tools``), which
    the agent checks; the reference (maybe an import path) is what the resources load."""
    from rollpoint.envs.registry import resolve_environment

    return resolve_environment(environment).name


class ReplicaPlan(StrictModel):
    """Everything a launcher needs to start any replica of one run."""

    host: str
    environment: str
    policy_url: str
    """The engine the model servers proxy to (ending in ``/v1``)."""
    builtin_policy: bool = False
    """The engine is the scripted policy this run started: the model servers send it the
    data token (it guards its routes like every data route)."""
    model_name: str
    checkpoint_mode: str
    base_port: int | None
    """Fixed ports from this one up (policy at +0, then 3 per replica); None: free ports."""
    snapshot_root: str | None
    """Set: every server is a checkpoint participant writing under it. None: data plane only."""
    upstream_connections: int | None = None
    """Each agent's cap on connections to its model and resources servers (None: no cap)."""
    sampling: dict[str, JsonValue] = {}
    """Fields every policy call carries (``policy.sampling``)."""
    seed_policy: str = "episode"
    capture_tokens: bool = False
    generation_cut: bool = True
    """``policy.generation_cut`` as the start check decided it (off for an engine that
    cannot continue a cut call token-exactly)."""
    engine: str = "vllm"
    """The reply shape token data is read from (``policy.engine``)."""
    agent_loop: str | None = None
    """The agents' custom loop by import path (None: the built-in one)."""
    final_states_dir: str | None = None
    """Set: each resources server logs every verified episode's state there
    (``final_states_log``)."""
    journal_window_s: float | None = None
    """Set: the model, resources and agent servers journal their work in the snapshot store
    (``journal.enabled``), with this group-commit window."""

    @classmethod
    def of(
        cls,
        settings: RuntimeSettings,
        *,
        policy_url: str,
        snapshot_root: str | None,
        generation_cut: bool | None = None,
    ) -> ReplicaPlan:
        """``generation_cut``: the start check's decision (None: the settings')."""
        policy = settings.policy
        return cls(
            host=settings.host,
            environment=settings.environment,
            policy_url=policy_url,
            builtin_policy=policy.base_url is None,
            model_name=policy.model,
            checkpoint_mode=_checkpoint_mode(settings.environment),
            base_port=settings.base_port,
            snapshot_root=snapshot_root,
            upstream_connections=settings.upstream_connections,
            sampling=dict(policy.sampling),
            seed_policy=policy.seed,
            capture_tokens=bool(policy.capture_tokens),
            generation_cut=(
                bool(policy.generation_cut) if generation_cut is None else generation_cut
            ),
            engine=policy.engine,
            agent_loop=settings.agent_loop,
            final_states_dir=None
            if settings.final_states_log is None
            else str(settings.final_states_log.resolve()),
            journal_window_s=settings.journal_window_s,
        )

    def _port(self, offset: int, restarted: bool) -> int:
        # Fixed ports are for the first start only; a restarted replica takes free ones.
        return 0 if self.base_port is None or restarted else self.base_port + offset

    def _settings(self, index: int, name: str, **more: JsonValue) -> dict[str, JsonValue]:
        control = {} if self.snapshot_root is None else {"snapshot_root": self.snapshot_root}
        return {"name": name, "replica": replica_name(index), **more, **control}

    def _journal(self) -> dict[str, JsonValue]:
        if self.journal_window_s is None or self.snapshot_root is None:
            return {}
        return {"journal": True, "journal_window_s": self.journal_window_s}

    def peer_specs(self, index: int, *, restarted: bool) -> list[ServerSpec]:
        """The resources and model servers of replica ``index``: they need nothing else."""
        replica = replica_name(index)
        resources = ServerSpec(
            kind="resources",
            name=f"resources-{replica}",
            host=self.host,
            port=self._port(1 + 3 * index, restarted),
            settings=self._settings(
                index,
                "resources",
                environment=self.environment,
                **(
                    {}
                    if self.final_states_dir is None
                    else {"final_states_dir": self.final_states_dir}
                ),
                **self._journal(),
            ),
        )
        model = ServerSpec(
            kind="model",
            name=f"model-{replica}",
            host=self.host,
            port=self._port(2 + 3 * index, restarted),
            # The engine's api_key is no setting: settings travel on the command line, which
            # every user of the machine can read. It reaches the model servers by environment.
            settings=self._settings(
                index,
                "model",
                upstream_url=self.policy_url,
                engine=self.engine,
                upstream_data_token=self.builtin_policy,
                # The generation cut needs token ids for a prefix: on with token capture.
                cut_generations=self.capture_tokens and self.generation_cut,
                **self._journal(),
            ),
        )
        return [resources, model]

    def agent_spec(
        self, index: int, *, model_url: str, resources_url: str, restarted: bool
    ) -> ServerSpec:
        replica = replica_name(index)
        return ServerSpec(
            kind="agent",
            name=f"agent-{replica}",
            host=self.host,
            port=self._port(3 + 3 * index, restarted),
            settings=self._settings(
                index,
                "agent",
                model_url=model_url,
                resources_url=resources_url,
                environment=_environment_name(self.environment),
                checkpoint_mode=session_mode(CheckpointMode(self.checkpoint_mode)),
                model_name=self.model_name,
                upstream_connections=self.upstream_connections,
                sampling=self.sampling,
                seed_policy=self.seed_policy,
                capture_tokens=self.capture_tokens,
                engine=self.engine,
                agent_loop=self.agent_loop,
                # A restart-only agent resumes nothing: its episodes start over anyway.
                **(self._journal() if self.checkpoint_mode == "turn" else {}),
            ),
        )


SpecHook = Callable[[ServerSpec], Awaitable[ServerSpec]]
"""Sees each replica server's spec before it starts and returns the one to start: chaos
trials put a fault proxy between an agent and its peers (its ``model_url`` or
``resources_url``) or skew a participant's control clock (``clock_skew_s``)."""


async def start_replica(
    group: ProcessGroup,
    plan: ReplicaPlan,
    index: int,
    *,
    restarted: bool = False,
    spec_hook: SpecHook | None = None,
) -> ReplicaEndpoints:
    """Start replica ``index``'s three servers in ``group``; their URLs once all listen."""
    peers = plan.peer_specs(index, restarted=restarted)
    if spec_hook is not None:
        peers = [await spec_hook(spec) for spec in peers]
    resources, model = await group.start(peers)
    spec = plan.agent_spec(
        index, model_url=model.url, resources_url=resources.url, restarted=restarted
    )
    if spec_hook is not None:
        spec = await spec_hook(spec)
    (agent,) = await group.start([spec])
    return ReplicaEndpoints(
        name=replica_name(index),
        model_url=model.url,
        agent_url=agent.url,
        resources_url=resources.url,
    )
