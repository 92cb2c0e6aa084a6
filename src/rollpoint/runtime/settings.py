"""What a runtime is told of a run, typed: :class:`RuntimeSettings`, with the policy it starts
or reaches (:class:`PolicySettings`) and where Ray places replicas (:class:`RaySettings`).

The runtimes read no run config. ``rollpoint run``'s YAML (:mod:`rollpoint.app.config`, the
app's) builds these (:meth:`~rollpoint.app.config.RunConfig.runtime_settings`); an embedding,
a bench or a test builds them as it likes. The defaults are the config's; the values are
taken as given (the config checked them, and so does each server as it starts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import JsonValue

__all__ = ["DEFAULT_FORWARD_ENV", "PolicySettings", "RaySettings", "RuntimeSettings"]

DEFAULT_FORWARD_ENV = (
    "AWS_*",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "AZURE_STORAGE_*",
    "FSSPEC_*",
)
"""What ``ray.forward_env`` copies by default: the credentials and endpoints s3fs
(botocore), gcsfs and adlfs read, and fsspec's own configuration variables."""


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """The policy engine: one at ``base_url``, or the scripted policy the runtime starts."""

    base_url: str | None = None
    """Any OpenAI-compatible URL (ending in /v1); None starts the scripted policy."""
    model: str = "scripted"
    api_key: str | None = None
    engine: str = "vllm"
    """The reply shape token data is read from (the scripted policy then speaks it)."""
    capture_tokens: bool | Literal["required"] = False
    generation_cut: bool | Literal["required"] = True
    sampling: Mapping[str, JsonValue] = field(default_factory=dict)
    """The fixed fields every policy call carries."""
    seed: str = "episode"
    """How each call is seeded: ``episode``, ``turn`` or ``none``."""
    # The scripted policy only (``policy.*`` in docs/guide.md says what each does).
    latency_ms: float = 20.0
    error_rate: float = 0.05
    tokens_per_call: int = 48
    tool_turns: int = 3
    call_log: Path | None = None
    weights_log: Path | None = None
    token_latency_ms: float = 0.0
    reasoning_tokens: int = 0
    faults: tuple[Mapping[str, JsonValue], ...] = ()
    """Bad engine data on purpose (:class:`rollpoint.policy.scripted_faults.EngineFault`
    fields each; the scripted policy checks them as it starts)."""
    fault_log: Path | None = None


@dataclass(frozen=True, slots=True)
class RaySettings:
    """Where the Ray runtime places replicas."""

    address: str | None = None
    """None starts a local Ray instance; else the cluster to connect to."""
    num_cpus_per_replica: float = 1.0
    forward_env: tuple[str, ...] = DEFAULT_FORWARD_ENV
    """Patterns of this process's environment variables copied to every replica's servers."""


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """What a runtime starts: ``replicas`` copies of the servers of ``environment`` (and the
    policy), where, and with which options."""

    workdir: Path
    """The run's folder: the servers' logs go to ``<workdir>/logs`` unless told otherwise."""
    environment: str = "workplace"
    replicas: int = 2
    runtime: Literal["embedded", "ray"] = "embedded"
    host: str = "127.0.0.1"
    base_port: int | None = None
    """Fixed ports from this one up (policy, then 3 per replica); None picks free ports."""
    seed: int = 0
    agent_loop: str | None = None
    upstream_connections: int | None = None
    final_states_log: Path | None = None
    journal_window_s: float | None = None
    """Set: the model and resources servers journal their calls with this group-commit
    window (``journal.enabled``); None: no journal."""
    policy: PolicySettings = field(default_factory=PolicySettings)
    ray: RaySettings = field(default_factory=RaySettings)
