"""Trainer-side control clients of fences in this process: the coordinator's unit-test rig.

Owns :func:`in_process_client`, which gives a
:class:`~rollpoint.trainer.control.participant_client.ParticipantClient` over an
:class:`~rollpoint.participant.in_process_control.InProcessControlTransport` (no sockets),
named after the fence's own status, optionally behind a
:class:`~rollpoint.testing.fault_transport.FaultTransport`. Builds no fence and no
participant: a test brings its own (the SDK's :class:`~rollpoint.participant.Fence` over a
built-in participant or one of its own).
"""

from __future__ import annotations

from rollpoint.participant.fence import Fence
from rollpoint.participant.in_process_control import InProcessControlTransport
from rollpoint.testing.fault_transport import FaultTransport
from rollpoint.trainer.control.control_transport import ControlTransport
from rollpoint.trainer.control.participant_client import ParticipantAddress, ParticipantClient

__all__ = ["in_process_client"]


def in_process_client(
    fence: Fence, *, faults: bool = False, control_timeout_s: float = 30.0
) -> ParticipantClient:
    """The control client of ``fence``, labelled by its participant (``kind@replica``).

    ``faults``: the calls go through a :class:`FaultTransport` (``client.transport``) to
    which the test adds rules."""
    status = fence.status()
    label = f"{status.kind}@{status.replica}"
    transport: ControlTransport = InProcessControlTransport(fence, peer=f"in-process {label}")
    if faults:
        transport = FaultTransport(transport, peer=f"fault transport {label}")
    address = ParticipantAddress(
        kind=status.kind,
        replica=status.replica,
        url=f"in-process://{status.kind}/{status.name}-{status.replica}",
    )
    return ParticipantClient(address, control_timeout_s=control_timeout_s, transport=transport)
