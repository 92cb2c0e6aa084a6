"""The test kit shipped with rollpoint, for environment authors and our own tests.

Nothing here mocks a rollpoint server: the proxy runs in front of real servers on loopback,
the in-process clients call a real fence. So far:

- :mod:`rollpoint.testing.fault_proxy`: an HTTP proxy that loses replies, delays, resets,
  partitions, holds and garbles requests on command, in front of any server; the faults
  it applies are described in :mod:`rollpoint.testing.fault`;
- :mod:`rollpoint.testing.fault_transport`: the same faults applied to control calls
  without a socket, around another control transport (an in-process fence, in unit tests);
- :mod:`rollpoint.testing.in_process`: a trainer's control client of a fence in this
  process (:func:`in_process_client`), with a fault transport in between when asked;
- :mod:`rollpoint.testing.local_cluster`: rollpoint's real servers on loopback in threads
  of this process (:class:`LocalCluster`), for a trainer's or an environment's tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rollpoint.testing.fault import Fault, FaultKind, ProxiedRequest, RequestMatch
from rollpoint.testing.fault_proxy import FaultProxy, ProxyStats, Rule
from rollpoint.testing.fault_transport import FaultTransport
from rollpoint.testing.in_process import in_process_client

if TYPE_CHECKING:
    from rollpoint.testing.local_cluster import LocalCluster, LocalReplica

__all__ = [
    "Fault",
    "FaultKind",
    "FaultProxy",
    "FaultTransport",
    "LocalCluster",
    "LocalReplica",
    "ProxiedRequest",
    "ProxyStats",
    "RequestMatch",
    "Rule",
    "in_process_client",
]


def __getattr__(name: str) -> Any:
    # The local cluster brings the servers and the trainer side with it: imported on first
    # use (PEP 562), so the fault proxy or the conformance kit alone loads neither.
    if name in ("LocalCluster", "LocalReplica"):
        return getattr(importlib.import_module("rollpoint.testing.local_cluster"), name)
    raise AttributeError(f"module 'rollpoint.testing' has no attribute {name!r}")
