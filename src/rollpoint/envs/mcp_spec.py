"""The spec file an ``mcp:<spec file>`` reference names, and reading it.

Owns :class:`McpSpec` (YAML: the server to start or reach, :class:`McpServerSpec`; which of
its tools the policy sees and the arguments the environment fills in, :class:`McpToolSpec`;
the setup calls; the tasks; the verify function; the ``_meta`` key the idempotency key goes
under; the timeout) and :func:`load_spec`, whose refusals are one ConfigError line naming
the reference, the file and the key at fault. The environments made from a spec are
:mod:`rollpoint.envs.mcp_env`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Field, JsonValue, ValidationError, model_validator

from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.model_base import StrictModel

PREFIX = "mcp:"
META_KEY = "rollpoint/idempotency_key"


# ---- the spec file ----------------------------------------------------------------------
class McpServerSpec(StrictModel):
    """Where the server is: a command to start (stdio) or a URL (streamable HTTP)."""

    command: list[str] | None = None
    """The stdio server's command and arguments, e.g. ``[mcp-server-sqlite, --db-path, x.db]``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the environment the stdio server is started with."""
    cwd: str | None = None
    url: str | None = None
    """A streamable HTTP server's endpoint, e.g. ``http://127.0.0.1:8000/mcp``."""
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of 'command' (stdio) or 'url' (streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("'command' is empty")
        return self


class McpToolSpec(StrictModel):
    bind: dict[str, JsonValue] = Field(default_factory=dict)
    """Arguments the environment sets on every call of this tool (hidden from the policy)."""


class McpTasksSpec(StrictModel):
    prompt: str
    """The opening user message of task ``i``; ``{index}`` and ``{task_id}`` are replaced."""
    params: dict[str, JsonValue] = Field(default_factory=dict)


class McpSetupCall(StrictModel):
    tool: str
    arguments: dict[str, JsonValue] = Field(default_factory=dict)


class McpSpec(StrictModel):
    """The spec file ``mcp:<path>`` names (YAML)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z_][\w-]*$")] | None = None
    """What task ids start with; the file's stem by default."""
    server: McpServerSpec
    tools: dict[str, McpToolSpec] | None = None
    """The server's tools the policy sees (all of them when absent), with bound arguments."""
    setup: list[McpSetupCall] = Field(default_factory=list)
    """Calls made once per connection before any episode's (idempotent: every process runs them)."""
    tasks: McpTasksSpec
    verify: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")] | None = None
    meta_key: str = META_KEY
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Bound on starting the server and on each call."""


def load_spec(ref: str) -> tuple[McpSpec, Path]:
    path = Path(ref.removeprefix(PREFIX))
    where = f"environment {ref!r}"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path} ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {path} is not YAML ({' '.join(str(exc).split())})") from None
    try:
        return McpSpec.model_validate(data), path
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "top level"
        raise ConfigError(f"{where}: {path}: key '{loc}': {err['msg']}") from None
