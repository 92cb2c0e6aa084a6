"""The participant SDK: what makes any ASGI server (FastAPI or Starlette) a checkpoint participant.

The public, stable surface (``__all__``, pinned by a test); the modules behind it (in this
package) are not part of it:

- the hooks a server implements: :class:`Participant` (``kind``, ``name``, ``replica``,
  ``mode``, ``portable``, ``features``, admission, readiness, export, install, retire,
  forget, ack, stats), :class:`CapturingParticipant` (a two-step export whose pause is a
  copy) and :class:`JournalingParticipant` (its journal's position saved with each cut), with the values they return (:class:`Readiness`, :class:`RetireOutcome`,
  :class:`RetireOutcomeKind`);
- :class:`Fence`, which runs one participant's phase machine, lease, retire marks and
  replays, and :class:`ControlSettings`, its token, snapshot root and lease grace;
  :class:`RetireMarks`, the marks themselves (``Fence.marks``: the fence writes them, a
  server reads them or calls ``Fence.check_attempt``);
- :func:`mount_participant`, the one function that mounts the control routes over a fence,
  with the control token passed explicitly (and serves them again on a listener of their
  own thread, loop and port, so data-plane load cannot delay them); :func:`close_control_plane` on shutdown,
  :func:`control_fence` to find it again;
- :class:`StateImage`, a participant's saved form kept current between checkpoints so a
  capture copies a dict, and the scope readers :class:`EpisodeScope`,
  :func:`episode_pairs`, :func:`latest_attempts`; :class:`RecordMemo`, which hands out the
  same record object while what it wraps is unchanged, so a snapshot references it rather
  than writing it again;
- :class:`AdmissionGate`, the gate a server closes to hold new work while a checkpoint is
  prepared;
- the identities and modes on the protocol: :class:`EpisodeId`, :class:`CheckpointMode`,
  :class:`ParticipantKind`.

The built-in model, agent and resources servers use the SDK through this package; see
docs/environments.md ("Wrapping an existing server with the SDK").
"""

from rollpoint.participant.admission_gate import AdmissionGate
from rollpoint.participant.control_mount import (
    close_control_plane,
    control_fence,
    mount_participant,
)
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.episode_scope import EpisodeScope, episode_pairs, latest_attempts
from rollpoint.participant.fence import Fence
from rollpoint.participant.participant import (
    CapturingParticipant,
    JournalingParticipant,
    Participant,
    Readiness,
    RetireOutcome,
    RetireOutcomeKind,
)
from rollpoint.participant.record_memo import RecordMemo
from rollpoint.participant.retire_marks import RetireMarks
from rollpoint.participant.state_image import StateImage
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind

__all__ = [
    "AdmissionGate",
    "CapturingParticipant",
    "CheckpointMode",
    "ControlSettings",
    "EpisodeId",
    "EpisodeScope",
    "Fence",
    "JournalingParticipant",
    "Participant",
    "ParticipantKind",
    "Readiness",
    "RecordMemo",
    "RetireMarks",
    "RetireOutcome",
    "RetireOutcomeKind",
    "StateImage",
    "close_control_plane",
    "control_fence",
    "episode_pairs",
    "latest_attempts",
    "mount_participant",
]
