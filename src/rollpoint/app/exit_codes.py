"""What ``rollpoint run``'s exit status means (the table in docs/guide.md, "Exit codes").

Owns the numbers, so the CLI, the tests and the docs say the same thing. A scheduler or a
script tells a good run from one to look at by these alone.
"""

from __future__ import annotations

OK = 0
"""Every group trained (or the run was already finished)."""
ERROR = 1
"""The run stopped on an error: a server that could not start, a stuck engine, a snapshot
store that failed, a crash (an uncaught exception exits 1 too)."""
REFUSED = 2
"""Refused at start: a config or command line that cannot work; nothing ran."""
GROUPS_FAILED = 3
"""The run ended, or was stopped early by ``failure.max_failed_fraction``, with failed
groups; its last line says how many and the most common reasons."""
SIGINT = 130
"""Stopped by SIGINT (Ctrl-C), after the final snapshot."""
SIGTERM = 143
"""Stopped by SIGTERM (a scheduler's notice), after the final snapshot."""
