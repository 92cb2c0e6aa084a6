"""The test kit shipped with rollpoint, for environment authors and our own tests.

Everything here runs real servers on loopback; nothing mocks a rollpoint server. So far:

- :mod:`rollpoint.testing.fault_proxy`: an HTTP proxy that loses replies, delays, resets,
  partitions, holds and garbles requests on command, in front of any server; the faults
  it applies are described in :mod:`rollpoint.testing.fault`.
"""

from __future__ import annotations

from rollpoint.testing.fault import Fault, FaultKind, ProxiedRequest, RequestMatch
from rollpoint.testing.fault_proxy import FaultProxy, ProxyStats, Rule

__all__ = [
    "Fault",
    "FaultKind",
    "FaultProxy",
    "ProxiedRequest",
    "ProxyStats",
    "RequestMatch",
    "Rule",
]
