"""Finding and waiting on processes by parent, for tests that kill things."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path


def _processes(file: str) -> Iterator[tuple[int, bytes]]:
    """(pid, the bytes of ``/proc/<pid>/<file>``) of every process still there (Linux only)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / file).read_bytes()
        except OSError:
            continue


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (scans /proc; Linux only)."""
    found = []
    for child, raw in _processes("stat"):
        stat = raw.decode(errors="replace")
        # The command name may hold spaces or parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(child)
    return found


def descendants_of(pid: int) -> list[int]:
    """Every process below ``pid``: a launcher's server zygote and the servers it forked
    (:mod:`rollpoint.runtime.warm_start`), or the servers it exec'd."""
    parents: dict[int, int] = {}
    for child, raw in _processes("stat"):
        stat = raw.decode(errors="replace")
        parents[child] = int(stat[stat.rfind(")") + 2 :].split()[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        below = [child for child, ppid in parents.items() if ppid == parent]
        found.extend(below)
        frontier.extend(below)
    return found


def servers_of(pid: int) -> list[int]:
    """The server processes below ``pid`` (their command line names the server entry
    point, forked or exec'd), without the zygote."""
    wanted = b"rollpoint.runtime.server_process"
    below = set(descendants_of(pid))
    return [p for p, cmdline in _processes("cmdline") if p in below and wanted in cmdline]


def replica_servers(root: Path, replica: str) -> list[int]:
    """The server processes of ``replica`` serving from ``root`` (its workdir, in their
    command lines), whoever started them."""
    wanted = (b"rollpoint.runtime.server_process", f'"replica":"{replica}"'.encode())
    return [
        pid
        for pid, cmdline in _processes("cmdline")
        if all(w in cmdline for w in wanted) and str(root).encode() in cmdline
    ]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat[stat.rfind(")") + 2 :].split()[0]
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the timeout."""
    deadline = time.monotonic() + timeout_s
    remaining = list(pids)
    while remaining and time.monotonic() < deadline:
        remaining = [p for p in remaining if alive(p)]
        if remaining:
            time.sleep(0.05)
    return remaining


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (scans /proc; Linux only)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = entry.joinpath("stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found
