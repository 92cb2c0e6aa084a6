"""How soon the interpreter hands the GIL to another thread that wants it (``control_latency``).

Owns :func:`shorten_thread_switch`: CPython's switch interval set to 0.5 ms, from its default
of 5 ms, in a server process whose control routes run on a thread of their own
(:mod:`rollpoint.participant.control_listener`). A data loop at saturation never blocks, so
it gives the GIL up only when the interval has passed after another thread asked for it:
each time the control thread wakes (a request read, a verb's result back from the data
loop, its reply written) it waited up to 5 ms. Measured by ``control_latency`` at load ~24
on the 2-core VM, 64 callers of 1k-token replies with logprobs, one run each: status p50
3.6 against 12.4 ms, prepare p50 21.6 against 37.2 ms with the shorter interval
(docs/log/performance-2026.md, "Control never waits behind data").

What it costs: nothing while no other thread waits (CPython forces a switch only on a
request); with two busy threads, ten times the switches (a few microseconds each, ~1 %).
It changes nothing that is computed. The process's entry point calls it, as it installs
the other tricks (:func:`rollpoint.tuning.install`); a server without it works the same,
its control thread only waits longer for the GIL.
"""

from __future__ import annotations

import sys

__all__ = ["SWITCH_INTERVAL_S", "shorten_thread_switch"]

SWITCH_INTERVAL_S = 0.0005


def shorten_thread_switch() -> None:
    """Set the interpreter's switch interval to :data:`SWITCH_INTERVAL_S` (process-wide)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
