"""What a launcher tells one server process to be: the spec passed on its command line."""

from __future__ import annotations

from typing import Literal

from pydantic import JsonValue

from rollpoint.protocol.model_base import StrictModel

ServerKind = Literal["policy", "model", "agent", "resources"]


class ServerSpec(StrictModel):
    kind: ServerKind
    name: str
    """Process name for logs, e.g. ``agent-replica-0``."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 lets the OS pick a free port; the process reports the one it bound."""
    settings: dict[str, JsonValue]
    """Keyword settings of the server's app factory (validated by that server's model)."""
    watch_parent: bool = True
    """Exit when standard input closes: the launcher died, even by SIGKILL."""


class ReadyLine(StrictModel):
    """The one line a server process prints on stdout once it listens."""

    ready: Literal[True] = True
    name: str
    url: str
    pid: int
