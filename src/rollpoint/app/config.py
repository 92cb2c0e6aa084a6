"""The run configuration: one YAML file, validated by pydantic, every key named on error.

``load_config(path)`` is the only way the CLI reads a config; it turns every problem
(unreadable file, bad YAML, unknown key, bad value) into a one-line :class:`ConfigError`
that names the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from rollpoint.envs.dataset_formats import DatasetSpec
from rollpoint.protocol.engine_faults import EngineFault
from rollpoint.protocol.episode import EnvironmentName
from rollpoint.protocol.errors import ConfigError
from rollpoint.runtime.settings import DEFAULT_FORWARD_ENV

if TYPE_CHECKING:  # imported when used: loading a config need not load the trainer
    from rollpoint.job.settings import JobSettings
    from rollpoint.runtime.settings import RuntimeSettings
    from rollpoint.trainer.settings import SaveSettings, TrainerSettings

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


SAMPLING_OWNED_KEYS = frozenset(
    {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "n", "seed"}
    | {"temperature", "top_p", "max_tokens", "stop", "logprobs", "top_logprobs"}
)
"""Request keys the agent sets itself or from named sampling settings: not in ``extra``."""


class SamplingConfig(_Section):
    """What the agent sends with every policy call (None: the engine's own default)."""

    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Most completion tokens per call."""
    stop: list[Annotated[str, Field(min_length=1)]] | None = None
    """Stop strings; a single string is taken as a list of one."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """Alternatives per token (needs ``logprobs: true``)."""
    seed: Literal["episode", "turn", "none"] = "episode"
    """``episode``: one seed per episode, from its rollout id (stable across attempts and
    machines); ``turn``: one per (rollout, turn); ``none``: send no seed."""
    extra: dict[str, JsonValue] = Field(default_factory=dict)
    """Engine-specific fields passed through as they are (``top_k``, ``min_p``,
    ``repetition_penalty``, ``chat_template_kwargs``, ...)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> SamplingConfig:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        owned = sorted(SAMPLING_OWNED_KEYS & set(self.extra))
        if owned:
            raise ValueError(
                f"extra.{owned[0]} is set by rollpoint (or by its own sampling key), "
                "not passed through"
            )
        return self

    def request_fields(self) -> dict[str, JsonValue]:
        """The fixed fields of every policy call (the seed is per call, not here)."""
        fields: dict[str, JsonValue] = dict(self.extra)
        for key in ("temperature", "top_p", "max_tokens"):
            value = getattr(self, key)
            if value is not None:
                fields[key] = value
        if self.stop is not None:
            fields["stop"] = list(self.stop)
        if self.logprobs:
            fields["logprobs"] = True
            if self.top_logprobs is not None:
                fields["top_logprobs"] = self.top_logprobs
        return fields


class PolicyConfig(_Section):
    base_url: str | None = None
    """Any OpenAI-compatible URL (ending in /v1). None starts the built-in scripted policy."""
    model: str = "scripted"
    api_key: str | None = None
    latency_ms: Annotated[float, Field(ge=0)] = 20.0
    """Scripted policy only: time each call takes, in milliseconds."""
    error_rate: Annotated[float, Field(ge=0, le=1)] = 0.05
    """Scripted policy only: share of tool calls that are wrong or malformed."""
    tokens_per_call: Annotated[int, Field(ge=1)] = 48
    """Scripted policy only: completion tokens reported per call."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: Literal["vllm", "sglang"] = "vllm"
    """Which reply shape token data is read from (the scripted policy then speaks it)."""
    capture_tokens: Literal[False, True, "required"] = False
    """True: ask the engine for token ids and logprobs and keep them per turn; an engine
    that returns none is reported once at start and the run goes on without them.
    ``required``: such an engine stops the run at start instead."""
    call_log: Path | None = None
    """Scripted policy only: a JSONL file it appends every reply's token data to."""
    tool_turns: Annotated[int, Field(ge=0, le=1024)] = 3
    """Scripted policy only, environments it has no playbook for: tool-calling turns (each
    one offered tool, seeded schema-valid arguments) before its final answer."""
    generation_cut: Literal[False, True, "required"] = True
    """With ``capture_tokens``: save the prefix of every call in flight at a snapshot and
    continue it after a restore (the model server then streams every call from the engine),
    where the engine can continue it token-exactly, as the start check finds (an engine
    that cannot is said once at start, and its calls run uncut). False proxies calls as they
    come, and a crash decodes them again. ``required``: an engine that cannot stops the run
    at start."""
    token_latency_ms: Annotated[float, Field(ge=0)] = 0.0
    """Scripted policy only: decode time per completion token (with token capture, each
    token is streamed as it is decoded, so a snapshot can cut a generation mid-way)."""
    reasoning_tokens: Annotated[int, Field(ge=0)] = 0
    """Scripted policy only: stand-in reasoning tokens before every tool call."""
    weights_log: Path | None = None
    """Scripted policy only: a JSONL file it appends, per generation, which weights version
    sampled each run of its tokens (the engine's own account of a weight update)."""
    faults: list[EngineFault] = Field(default_factory=list)
    """Scripted policy only, for testing: bad engine data on purpose on the calls each fault
    names (an oversized reply, a bad streamed token id or logprob, a streamed tool call
    without an id: :mod:`rollpoint.policy.scripted_faults`). None by default; ``rollpoint
    chaos`` sets them for the run a trial names."""
    fault_log: Path | None = None
    """Scripted policy only: a JSONL file it appends every corruption ``faults`` made to."""

    @model_validator(mode="after")
    def _check(self) -> PolicyConfig:
        if self.generation_cut == "required" and not self.capture_tokens:
            raise ValueError("generation_cut: required needs capture_tokens (a cut saves ids)")
        if self.faults and self.base_url is not None:
            raise ValueError("faults are the scripted policy's: remove them, or base_url")
        return self


class TrainConfig(_Section):
    batch_size: Annotated[int, Field(ge=1)] = 16
    """Rollouts per train step; rounded up to whole prompt groups."""
    checkpoint_every_steps: Annotated[int, Field(ge=1)] | None = 1
    """Write a train checkpoint (and take a snapshot) every this many steps. The finished queue keeps the
    rollouts it consumed until their checkpoint is durable; None never checkpoints."""
    max_ready_batches: Annotated[int, Field(ge=1)] | None = 4
    """Finished rollouts waiting for training, in batches: while this many are waiting, no
    new prompt group is sent (those in flight finish). Bounds what the trainer holds when
    training is slower than rollouts; None: no bound (the wait grows with the run)."""
    step_seconds: Annotated[float, Field(ge=0)] = 0.0
    """Built-in loop only (``rollpoint run``'s :class:`~rollpoint.loop.SimulatedTrainer`):
    time a train step takes (simulated work)."""
    max_policy_lag: Annotated[int, Field(ge=0)] | None = None
    """At most this many policy versions between the live one and the oldest turn of a
    sample it trains on: new episodes wait while the oldest untrained rollout is that far
    behind, and a sample beyond it at training time is handled as ``stale_samples`` says.
    None: no bound."""
    stale_samples: Literal["resend", "mark"] = "resend"
    """A sample beyond ``max_policy_lag`` when its batch is trained: ``resend`` sends its
    group again (a new group of the same task, ``<task_id>-g<n>``) and leaves it out of the
    batch; ``mark`` hands it over with ``TrainSample.stale`` set."""


class SnapshotConfig(_Section):
    every_seconds: Annotated[float, Field(gt=0)] | None = None
    """Take a snapshot this often; None takes them only at train checkpoints."""
    keep: Annotated[int, Field(ge=1)] = 3
    deadline_seconds: Annotated[float, Field(gt=0, le=3000)] = 10.0
    """At most 3,000 s: a participant refuses a deadline more than an hour ahead of its
    clock (``ControlSettings.max_deadline_ahead_s``), and clocks may differ a little."""
    retry_after_seconds: Annotated[float, Field(ge=0)] = 10.0
    """Three failed snapshots in a row stop the run only once the failures also span this
    long: back-to-back saves (train checkpoints) that fail within milliseconds while a
    replica dies must not end the run, nor a server gone for a few seconds behind its
    address (a container restarting: rollpoint chaos stopped runs on 1 s). Every save is
    still attempted."""
    allow_restart_only: bool = False
    store: str | None = None
    """A path or fsspec URL; None keeps snapshots under <workdir>/snapshots."""
    mode: Literal["cut", "journal"] = "cut"
    """``cut``: every snapshot closes admission on every replica until it commits (the
    two-phase cut). ``journal``: periodic snapshots never close admission: each journaling
    participant records its journal position while its calls go on, the trainer its
    ledger after them, and a restore sends every try in flight again under its own id,
    continued from the journals (docs/design.md "Pause-free snapshots"). Needs
    ``journal.enabled``; a participant that does not journal makes a save take the cut.
    Not the default: journaling is off by default (below)."""

    def save_settings(self) -> SaveSettings:
        """What the snapshot coordinator is told of these keys."""
        from rollpoint.trainer.settings import SaveSettings

        return SaveSettings(
            deadline_seconds=self.deadline_seconds,
            retry_after_seconds=self.retry_after_seconds,
            allow_restart_only=self.allow_restart_only,
            mode=self.mode,
        )


class PreemptionConfig(_Section):
    """What ``rollpoint run`` does on SIGTERM or SIGINT (a scheduler's notice, Ctrl-C)."""

    grace_seconds: Annotated[float, Field(gt=0)] = 25.0
    """From the signal to the exit: one last snapshot, then the servers stop. Inside
    Kubernetes' default terminationGracePeriodSeconds (30); set it below your scheduler's
    kill delay (Slurm: the time ``--signal`` gives, or KillWait). A snapshot that cannot
    finish in time is abandoned and the previous one holds the run."""


class FailureConfig(_Section):
    """When failed prompt groups stop a run early (see "Exit codes" in docs/guide.md)."""

    max_failed_fraction: Annotated[float, Field(ge=0, le=1)] = 0.5
    """Once ``min_groups`` groups are settled (trained or failed), more than this share of
    them failed stops the run: a snapshot, then one line and exit 3. 1.0: never stop."""
    min_groups: Annotated[int, Field(ge=1)] = 8
    """Groups settled before the share is looked at (a smaller run: all of its groups)."""


class WatchdogConfig(_Section):
    """A policy engine or a resources server that takes calls and answers none."""

    warn_seconds: Annotated[float, Field(gt=0)] | None = 60.0
    """Calls waiting on one peer and none of them answered for this long: a warning naming
    the peer's URL and how many calls wait. None: off (an engine known to be slow)."""
    stop_seconds: Annotated[float, Field(gt=0)] | None = 600.0
    """... for this long: the run takes a snapshot and stops with one line (exit 1). The
    default is the model server's bound on one call: a healthy engine answers some call
    within it. None: off (rows are still given up after ``row_timeout_seconds``)."""

    @model_validator(mode="after")
    def _order(self) -> WatchdogConfig:
        warn, stop = self.warn_seconds, self.stop_seconds
        if warn is not None and stop is not None and stop < warn:
            raise ValueError(f"stop_seconds ({stop:g}) is shorter than warn_seconds ({warn:g})")
        return self


class RayConfig(_Section):
    """Where the replicas run when ``runtime: ray``; ignored on the embedded runtime."""

    address: str | None = None
    """None starts a local Ray instance; ``auto`` joins the cluster this machine is part of;
    ``ray://host:10001`` (or ``host:6379``) connects to that cluster."""
    num_cpus_per_replica: Annotated[float, Field(gt=0)] = 1.0
    """CPUs Ray reserves for each replica actor (its three server processes)."""
    forward_env: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: list(DEFAULT_FORWARD_ENV)
    )
    """Environment variables (``fnmatch`` patterns) copied from the trainer's environment
    to every replica's server processes: a cluster's workers were started elsewhere and
    have none of it. The default covers the object stores fsspec reaches (S3 and
    S3-compatible, GCS, Azure), so ``snapshot.store: s3://…`` works on Ray as on the
    embedded runtime. Tokens are not forwarded this way (they travel as actor arguments)."""


class JournalConfig(_Section):
    """The durable-turns journal (issue 35, ``docs/journal.md``): each model server journals
    every finished policy call (streamed ones too), each resources server every applied tool call and each
    agent server every completed turn and finished reply, in the snapshot store before the
    work goes on; after a crash each episode resumes at its last journaled turn and a call
    made again is answered from the journal instead of being sampled or run again."""

    enabled: bool = False
    """Off by default: it costs 4-10 % of CPU a turn in a job with ~1k-token turns
    (docs/PERFORMANCE.md, measured by ``bench journal_job``), and the whole test suite has
    not been run with it on (``docs/journal.md``, "Not wired yet"). With an fsspec snapshot
    store each journal is spooled on its server's machine and shipped to the store every
    second."""
    window_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    """The group-commit window: records ready within it share one fsync."""


class MetricsConfig(_Section):
    """Where the trainer serves Prometheus ``/metrics`` (each server also serves its own)."""

    host: str | None = None
    """None: the run's ``host``. Anything but loopback needs ``allow_remote_bind``."""
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """0 picks a free port (printed at start); set one for a fixed scrape target."""


class RunConfig(_Section):
    workdir: Path = Path("runs/demo")
    environment: EnvironmentName = "workplace"
    """A built-in name, a name an installed package registers (entry-point group
    ``rollpoint.environments``) or an import path ``package.module:ClassName``."""
    agent_loop: str | None = None
    """A custom agent loop by import path ``package.module:ClassName`` (``rollpoint.agent_loops``);
    None sends the policy the transcript as it is."""
    tasks: Annotated[int, Field(ge=0)] | None = 32
    """Number of synthetic tasks; ignored when ``dataset`` is given. 0 only for a run that
    takes its groups while it runs (``Rollouts(..., more_groups=True)``)."""
    dataset: Path | DatasetSpec | None = None
    """A JSONL file of task rows ({task_id, environment, prompt, params}), or a mapping
    ``{path, format, split, data_files, columns}`` for Parquet files and local Hugging Face
    datasets (:class:`~rollpoint.envs.dataset_formats.DatasetSpec`, docs/guide.md)."""
    group_size: Annotated[int, Field(ge=1, le=1024)] = 4
    max_turns: Annotated[int, Field(ge=1, le=1024)] = 8
    replicas: Annotated[int, Field(ge=1, le=64)] = 2
    concurrency: Annotated[int, Field(ge=1)] = 32
    """Episodes in flight at once, across all replicas."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    failure: FailureConfig = Field(default_factory=FailureConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    recovery: Literal["turn", "restart"] = "turn"
    """After a crash, ``turn`` continues every saved episode from its last completed turn;
    ``restart`` starts every unfinished episode over from its prompt (the baseline that
    turn-level recovery is measured against)."""
    runtime: Literal["embedded", "ray"] = "embedded"
    """``embedded``: every server a local process; ``ray``: each replica a Ray actor."""
    ray: RayConfig = Field(default_factory=RayConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    journal: JournalConfig = Field(default_factory=JournalConfig)
    seed: int = 0
    host: str = "127.0.0.1"
    base_port: Annotated[int, Field(ge=1, le=65000)] | None = None
    """Fixed ports from this one up (policy, then 3 per replica); None picks free ports."""
    allow_remote_bind: bool = False
    """Listening on anything but loopback needs this set on purpose."""
    upstream_connections: Annotated[int, Field(ge=1)] | None = None
    """Most connections each agent keeps open to its model server, and to its resources
    server; calls beyond wait in the agent (their sessions are in flight and saved like
    any other), and only the time a call spends on the wire counts against its timeout.
    None: no cap, one socket per call. Set it when in-flight sessions near the open-file
    limit (each in-flight call holds a socket on every hop)."""
    row_timeout_seconds: Annotated[float, Field(gt=0)] = 300.0
    """Give up on one row after this long (time paused by a snapshot not counted)."""
    max_reply_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    """The longest episode reply (one row's result line, its transcript and token data) the
    trainer reads from an agent: 64 MiB by default, where a 48k-token, tokens-captured
    episode is about 1.5 MiB. A longer reply fails that row's try with a message naming
    its size and this cap; the row is re-sent fresh, and fails its group after the
    dispatcher's tries."""
    final_states_log: Path | None = None
    """An audit folder: each resources server appends every verified episode's final
    environment state there (``resources-<replica>.jsonl``), before the verify reply.
    ``rollpoint chaos`` sets it and counts tool side effects (I2) from it. None: off."""

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.dataset is None and self.tasks is None:
            raise ValueError("give either 'tasks' or 'dataset'")
        if self.policy.base_url is None and self.policy.api_key is not None:
            raise ValueError(
                "policy.api_key is set but policy.base_url is not: the built-in scripted "
                "policy takes no API key (it would refuse every call as unauthorized); "
                "remove api_key, or set base_url to the engine it is for"
            )
        if not self.allow_remote_bind and self.host not in _LOOPBACK:
            raise ValueError(
                f"host {self.host!r} is not loopback; set allow_remote_bind: true to listen on it"
            )
        if not self.allow_remote_bind and self.metrics.host not in (None, *_LOOPBACK):
            raise ValueError(
                f"metrics.host {self.metrics.host!r} is not loopback;"
                " set allow_remote_bind: true to listen on it"
            )
        return self

    @property
    def metrics_host(self) -> str:
        return self.metrics.host or self.host

    def snapshot_root(self) -> str:
        """Where snapshots go: ``snapshot.store``, or ``<workdir>/snapshots`` made absolute."""
        return self.snapshot.store or str((self.workdir / "snapshots").resolve())

    def fingerprint(self) -> dict[str, JsonValue]:
        """The keys a snapshot's saved state depends on; a restore must match them."""
        return self.job_settings().fingerprint()

    def runtime_settings(self) -> RuntimeSettings:
        """What a runtime is told of this config (the runtimes read no config)."""
        from rollpoint.runtime.settings import PolicySettings, RaySettings, RuntimeSettings

        policy = self.policy
        return RuntimeSettings(
            workdir=self.workdir,
            environment=self.environment,
            replicas=self.replicas,
            runtime=self.runtime,
            host=self.host,
            base_port=self.base_port,
            seed=self.seed,
            agent_loop=self.agent_loop,
            upstream_connections=self.upstream_connections,
            final_states_log=self.final_states_log,
            journal_window_s=self.journal.window_ms / 1000 if self.journal.enabled else None,
            policy=PolicySettings(
                base_url=policy.base_url,
                model=policy.model,
                api_key=policy.api_key,
                engine=policy.engine,
                capture_tokens=policy.capture_tokens,
                generation_cut=policy.generation_cut,
                sampling=policy.sampling.request_fields(),
                seed=policy.sampling.seed,
                latency_ms=policy.latency_ms,
                error_rate=policy.error_rate,
                tokens_per_call=policy.tokens_per_call,
                tool_turns=policy.tool_turns,
                call_log=policy.call_log,
                weights_log=policy.weights_log,
                token_latency_ms=policy.token_latency_ms,
                reasoning_tokens=policy.reasoning_tokens,
                faults=tuple(f.model_dump(mode="json") for f in policy.faults),
                fault_log=policy.fault_log,
            ),
            ray=RaySettings(
                address=self.ray.address,
                num_cpus_per_replica=self.ray.num_cpus_per_replica,
                forward_env=tuple(self.ray.forward_env),
            ),
        )

    def job_settings(self) -> JobSettings:
        """What the job (and the façade over it) is told of this config: the runtime's
        settings, the trainer's, and the job's own keys (the job reads no config)."""
        from rollpoint.job.settings import JobSettings

        return JobSettings(
            runtime=self.runtime_settings(),
            # The job computes the fingerprint as the run starts (a dataset is read once).
            trainer=self._trainer_settings(fingerprint={}),
            tasks=self.tasks,
            dataset=self.dataset,
            snapshot_store=self.snapshot.store,
            snapshot_keep=self.snapshot.keep,
            continue_episodes=self.recovery == "turn",
            grace_seconds=self.preemption.grace_seconds,
            metrics_host=self.metrics_host,
            metrics_port=self.metrics.port,
            record=self.model_dump(mode="json"),
        )

    def trainer_settings(self) -> TrainerSettings:
        """What the trainer loop is told of this config (the library reads no config)."""
        return self._trainer_settings(fingerprint=self.fingerprint())

    def _trainer_settings(self, *, fingerprint: dict[str, JsonValue]) -> TrainerSettings:
        from rollpoint.trainer.settings import TrainerSettings

        return TrainerSettings(
            workdir=self.workdir,
            group_size=self.group_size,
            concurrency=self.concurrency,
            max_turns=self.max_turns,
            batch_size=self.train.batch_size,
            checkpoint_every_steps=self.train.checkpoint_every_steps,
            max_policy_lag=self.train.max_policy_lag,
            stale_samples=self.train.stale_samples,
            max_ready_batches=self.train.max_ready_batches,
            row_timeout_seconds=self.row_timeout_seconds,
            max_reply_bytes=self.max_reply_bytes,
            snapshot_every_seconds=self.snapshot.every_seconds,
            save=self.snapshot.save_settings(),
            fingerprint=fingerprint,
            max_failed_fraction=self.failure.max_failed_fraction,
            failure_min_groups=self.failure.min_groups,
            stuck_warn_seconds=self.watchdog.warn_seconds,
            stuck_stop_seconds=self.watchdog.stop_seconds,
            journaled=self.journal.enabled,
        )


def _format_validation_error(source: str, exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "<top level>"
    if err["type"] == "extra_forbidden":
        from rollpoint.app.config_keys import did_you_mean

        return f"{source}: unknown key '{loc}'{did_you_mean(RunConfig, err['loc'])}"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{source}: key '{loc}': {err['msg']}{more}"


def parse_config(data: object, *, source: str = "config") -> RunConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level")
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(source, exc)) from None
    # Resolved now, before any server starts: a plugin that does not load is one line here,
    # not three dead server processes. (Each server process resolves it again.)
    from rollpoint.envs.registry import resolve_environment

    try:
        resolve_environment(config.environment)
    except ConfigError as exc:
        raise ConfigError(f"{source}: key 'environment': {exc}") from None
    from rollpoint.envs.registry import adapter_prefix

    if adapter_prefix(config.environment) == "mcp:" and not config.journal.enabled:
        # The MCP server's state is outside every snapshot: only the journal keeps a
        # restored episode from sending a completed call again (docs/environments.md).
        raise ConfigError(
            f"{source}: key 'journal.enabled': environment {config.environment!r} needs"
            f" it true (a restored episode's completed MCP calls are answered from it)"
        )
    if config.snapshot.mode == "journal" and not config.journal.enabled:
        raise ConfigError(
            f"{source}: key 'snapshot.mode': 'journal' needs journal.enabled: true (a"
            " journal-mode snapshot saves journal positions, not episodes)"
        )
    if config.agent_loop is not None:
        from rollpoint.agent_loops import resolve_agent_loop

        try:
            resolve_agent_loop(config.agent_loop)
        except ConfigError as exc:
            raise ConfigError(f"{source}: key 'agent_loop': {exc}") from None
    return config


def load_config(path: Path) -> RunConfig:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    return parse_config(data, source=str(path))
