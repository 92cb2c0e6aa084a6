"""How a participant's control plane is set up: :class:`ControlSettings`.

Owns the settings a server process builds its :class:`~rollpoint.participant.fence.Fence`
and control routes with: the control token, the snapshot root, the lease grace and how far
ahead a deadline may lie, each checked when the settings are made (a bad one is a
:class:`~rollpoint.protocol.errors.ConfigError` at start, not a refusal mid-run). What the
fence does with them is :mod:`rollpoint.participant.fence`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rollpoint.protocol.errors import ConfigError

__all__ = ["ControlSettings"]


@dataclass(frozen=True)
class ControlSettings:
    """How a participant's control plane is set up; build one per server process."""

    token: str = field(repr=False)
    """Bearer token every control call must carry (see :func:`rollpoint.http.auth.load_token`)."""
    snapshot_root: str
    """Local folder or fsspec URL; commit and restore name folders relative to it."""
    lease_grace_s: float = 2.0
    """The lease lapses this long after the last deadline, then the participant reopens."""
    max_deadline_ahead_s: float = 3600.0
    """A ``deadline_ts`` further ahead of this participant's clock than this is refused
    (400): a deadline holds admission closed until it lapses, and one of ``1e12`` (a
    duration or milliseconds sent for Unix seconds) would close it for good."""

    def __post_init__(self) -> None:
        if not self.token.strip():
            raise ConfigError(
                "no control token configured: set ROLLPOINT_CONTROL_TOKEN or pass a token file"
            )
        if not self.snapshot_root.strip():
            raise ConfigError("snapshot_root is empty: give the folder snapshots are written to")
        if not math.isfinite(self.lease_grace_s) or self.lease_grace_s < 0:
            raise ConfigError(f"lease_grace_s must be >= 0 seconds, got {self.lease_grace_s}")
        if not math.isfinite(self.max_deadline_ahead_s) or self.max_deadline_ahead_s <= 0:
            raise ConfigError(
                f"max_deadline_ahead_s must be > 0 seconds, got {self.max_deadline_ahead_s}"
            )
