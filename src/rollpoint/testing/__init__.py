"""The test kit shipped with rollpoint, for environment authors and our own tests.

Nothing here mocks a rollpoint server: the proxy runs in front of real servers on loopback,
the in-process clients call a real fence. So far:

- :mod:`rollpoint.testing.fault_proxy`: an HTTP proxy that loses replies, delays, resets,
  partitions, holds and garbles requests on command, in front of any server; the faults
  it applies are described in :mod:`rollpoint.testing.fault`;
- :mod:`rollpoint.testing.fault_transport`: the same faults applied to control calls
  without a socket, around another control transport (an in-process fence, in unit tests);
- :mod:`rollpoint.testing.in_process`: a trainer's control client of a fence in this
  process (:func:`in_process_client`), with a fault transport in between when asked.
"""

from __future__ import annotations

from rollpoint.testing.fault import Fault, FaultKind, ProxiedRequest, RequestMatch
from rollpoint.testing.fault_proxy import FaultProxy, ProxyStats, Rule
from rollpoint.testing.fault_transport import FaultTransport
from rollpoint.testing.in_process import in_process_client

__all__ = [
    "Fault",
    "FaultKind",
    "FaultProxy",
    "FaultTransport",
    "ProxiedRequest",
    "ProxyStats",
    "RequestMatch",
    "Rule",
    "in_process_client",
]
