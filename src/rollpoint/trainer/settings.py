"""What the trainer library is told of a run, typed: :class:`SaveSettings` (the snapshot
coordinator's) and :class:`TrainerSettings` (the trainer loop's).

The trainer library reads no run config. ``rollpoint run``'s YAML (:mod:`rollpoint.app.config`,
the app's) builds these (:meth:`~rollpoint.app.config.RunConfig.trainer_settings`,
:meth:`~rollpoint.app.config.SnapshotConfig.save_settings`); an embedding or a test builds them
as it likes. The defaults are the config's, and a value the config would refuse is refused
here too, as one :class:`~rollpoint.protocol.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import JsonValue

from rollpoint.protocol.errors import ConfigError

MAX_DEADLINE_S = 3000.0
"""A participant refuses a deadline more than an hour ahead of its clock
(``ControlSettings.max_deadline_ahead_s``), and clocks may differ a little."""


@dataclass(frozen=True, slots=True)
class SaveSettings:
    """How the snapshot coordinator saves."""

    deadline_seconds: float = 10.0
    """A save's one deadline, from its prepare to the last commit (and a restore's)."""
    retry_after_seconds: float = 10.0
    """Three failed snapshots in a row stop the run only once the failures also span this
    long (see ``snapshot.retry_after_seconds`` in docs/guide.md)."""
    allow_restart_only: bool = False
    """Save a deployment whose participants can only restart their episodes."""
    mode: Literal["cut", "journal"] = "cut"
    """``journal``: periodic saves close no admission (``snapshot.mode``, docs/design.md
    "Pause-free snapshots"); a final save and a save with a participant that does not
    journal take the cut."""

    def __post_init__(self) -> None:
        if not (0 < self.deadline_seconds <= MAX_DEADLINE_S):
            raise ConfigError(
                f"SaveSettings.deadline_seconds must be in (0, {MAX_DEADLINE_S:g}],"
                f" not {self.deadline_seconds!r}"
            )
        if not (self.retry_after_seconds >= 0 and math.isfinite(self.retry_after_seconds)):
            raise ConfigError(
                "SaveSettings.retry_after_seconds must be a finite number >= 0,"
                f" not {self.retry_after_seconds!r}"
            )


@dataclass(frozen=True, slots=True)
class TrainerSettings:
    """What one run of the trainer loop (:class:`~rollpoint.trainer.Trainer`) needs."""

    workdir: Path
    """Where ``train_data.jsonl`` and the train checkpoints go."""
    group_size: int = 4
    """Rollouts per prompt group."""
    concurrency: int = 32
    """Episodes in flight at once, across all replicas."""
    max_turns: int = 8
    batch_size: int = 16
    """Rollouts per train step; rounded up to whole prompt groups."""
    checkpoint_every_steps: int | None = 1
    """A train checkpoint (and a snapshot) every this many steps; None never checkpoints."""
    max_policy_lag: int | None = None
    """At most this many policy versions between the live one and a trained sample's
    oldest turn (:mod:`rollpoint.trainer.policy_lag`); None: no bound."""
    stale_samples: Literal["resend", "mark"] = "resend"
    """A sample beyond ``max_policy_lag`` at training time: its group sent again, or
    handed over marked ``stale``."""
    max_ready_batches: int | None = 4
    """While this many batches of finished rollouts wait for training, no new prompt group
    is sent (the groups in flight finish): the trainer holds at most about this many
    batches plus what is in flight, however slow training is. None: no bound."""
    row_timeout_seconds: float = 300.0
    """Give up on one row after this long (time paused by a snapshot not counted)."""
    snapshot_every_seconds: float | None = None
    """A snapshot this often, besides those at train checkpoints; None: only those."""
    max_reply_bytes: int = 64 * 1024 * 1024
    """The longest row result the dispatcher reads from an agent; a longer one fails its
    row's try, which is re-sent fresh (and the row its group after the dispatcher's tries)."""
    save: SaveSettings = field(default_factory=SaveSettings)
    fingerprint: dict[str, JsonValue] = field(default_factory=dict)
    """The config keys a snapshot's saved state depends on: saved with every snapshot, and
    a restore refuses a snapshot whose keys differ (naming the key)."""
    max_failed_fraction: float = 0.5
    """Stop the run early (a snapshot, then :class:`~rollpoint.protocol.errors.GroupsFailedError`)
    once more than this share of the groups settled so far failed; 1.0 never stops."""
    failure_min_groups: int = 8
    """Groups settled (trained or failed) before ``max_failed_fraction`` is applied (or
    every group of a smaller run)."""
    stuck_warn_seconds: float | None = 60.0
    """Calls in flight and none answered for this long: one warning naming the peer and
    how many calls wait (None: never)."""
    stuck_stop_seconds: float | None = 600.0
    """... and for this long: a snapshot, then :class:`~rollpoint.protocol.errors.RunStuckError`
    (None: never; the row timeout still gives rows up)."""
    retry_failed: bool = False
    """Send the failed groups of the restored run again, under new group ids."""
    journaled: bool = False
    """The servers journal their work (``journal.enabled``): a replica lost mid-run gets
    every try it held back, not only the latest snapshot's (docs/journal.md)."""

    def __post_init__(self) -> None:
        for name in ("group_size", "concurrency", "max_turns", "batch_size", "max_reply_bytes"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"TrainerSettings.{name} must be at least 1, not {value!r}")
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise ConfigError(
                "TrainerSettings.checkpoint_every_steps must be at least 1 or None,"
                f" not {self.checkpoint_every_steps!r}"
            )
        if self.max_policy_lag is not None and self.max_policy_lag < 0:
            raise ConfigError(
                f"TrainerSettings.max_policy_lag must be >= 0 or None, not {self.max_policy_lag!r}"
            )
        if self.stale_samples not in ("resend", "mark"):
            raise ConfigError(
                "TrainerSettings.stale_samples must be 'resend' or 'mark',"
                f" not {self.stale_samples!r}"
            )
        if self.max_ready_batches is not None and self.max_ready_batches < 1:
            raise ConfigError(
                "TrainerSettings.max_ready_batches must be at least 1 or None,"
                f" not {self.max_ready_batches!r}"
            )
        if not self.row_timeout_seconds > 0:
            raise ConfigError(
                f"TrainerSettings.row_timeout_seconds must be > 0, not {self.row_timeout_seconds!r}"
            )
        if not 0 <= self.max_failed_fraction <= 1:
            raise ConfigError(
                "TrainerSettings.max_failed_fraction must be in [0, 1],"
                f" not {self.max_failed_fraction!r}"
            )
        if self.failure_min_groups < 1:
            raise ConfigError(
                f"TrainerSettings.failure_min_groups must be at least 1, not {self.failure_min_groups!r}"
            )
        for name in ("stuck_warn_seconds", "stuck_stop_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"TrainerSettings.{name} must be > 0 or None, not {value!r}")
        every = self.snapshot_every_seconds
        if every is not None and not every > 0:
            raise ConfigError(
                f"TrainerSettings.snapshot_every_seconds must be > 0 or None, not {every!r}"
            )
