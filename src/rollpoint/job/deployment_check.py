"""Opening a run checks the deployment it runs on against its settings, before any row.

Owns :func:`check_deployment`: every replica's resources server is asked which environment
it serves (``GET /tools``); one serving another environment than the config names refuses
the run with one line (a :class:`~rollpoint.protocol.errors.ConfigError`: every group would
otherwise fail one by one with ``environment_mismatch``). A replica count or a policy URL
that differs from the config is said in one warning line and the run goes on: a run resumes
on another replica count on purpose (an elastic restore), and attached servers call the
engine they were started with.
"""

from __future__ import annotations

import asyncio
import logging

from rollpoint.http.client import HttpClient
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.errors import ConfigError, RollpointError
from rollpoint.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 10.0


async def check_deployment(
    runtime: RuntimeSettings, deployment: Deployment, http: HttpClient, *, attached: bool
) -> None:
    """Refuse a deployment serving another environment; for servers started apart
    (``attached``), warn of another replica count or policy URL."""
    from rollpoint.envs.registry import resolve_environment

    wanted = resolve_environment(runtime.environment).name

    async def served(url: str) -> str | None:
        try:
            reply = await http.get_json(f"{url}/tools", timeout_s=ASK_TIMEOUT_S)
        except RollpointError as exc:
            log.warning("could not ask %s which environment it serves: %s", url, exc.message)
            return None
        name = reply.get("environment") if isinstance(reply, dict) else None
        return name if isinstance(name, str) else None

    urls = [r.resources_url for r in deployment.replicas]
    for replica, name in zip(
        deployment.replicas, await asyncio.gather(*map(served, urls)), strict=True
    ):
        if name is not None and name != wanted:
            raise ConfigError(
                f"environment: this config names {runtime.environment!r} but {replica.name}'s "
                f"resources server at {replica.resources_url} serves {name!r}; run on servers "
                f"of {wanted!r}, or set environment to the one they serve"
            )
    if not attached:
        return  # started from this config: the same count and engine by construction
    names = [r.name for r in deployment.replicas]
    if len(names) != runtime.replicas:
        log.warning(
            "replicas: this config names %d, the deployment has %d (%s); the run uses those it has",
            runtime.replicas,
            len(names),
            ", ".join(names),
        )
    base = runtime.policy.base_url
    if base is not None and base.rstrip("/") != deployment.policy_url.rstrip("/"):
        log.warning(
            "policy.base_url is %s but the servers call %s (the engine they were started with)",
            base,
            deployment.policy_url,
        )
