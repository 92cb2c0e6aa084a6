"""A journal writer process for the crash test: ``python -m tests.support.journal_writer DIR SEED``.

Opens the journal in DIR and appends forever from 64 concurrent appenders, records of
random sizes (up to 64 KiB, so a group commit spans many pages); after each append returns
(its record durable) it writes one line ``ACK <key>`` to stdout, so the parent that kills it
knows exactly what was acknowledged. Each payload is :func:`payload_for` its key, so a
reader can tell a whole record from a half-written one.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys

from rollpoint.store.journal import Journal


def payload_for(key: str) -> bytes:
    size = int(hashlib.sha256(key.encode()).hexdigest()[:4], 16)  # 0..65535 bytes
    block = hashlib.sha256(b"payload " + key.encode()).digest()
    return (block * (size // 32 + 1))[:size]


async def _appender(journal: Journal, prefix: str, rng: random.Random) -> None:
    n = 0
    while True:
        key = f"{prefix}|{n}|{rng.randrange(1 << 30)}"
        await journal.append(key, "policy_call", payload_for(key))
        os.write(1, f"ACK {key}\n".encode())
        n += 1


async def main(folder: str, seed: int) -> None:
    journal = Journal.open(folder, window_s=0.001, segment_bytes=1 << 20)
    os.write(1, b"READY\n")
    rng = random.Random(seed)
    await asyncio.gather(*(_appender(journal, f"s{seed}-w{i}", rng) for i in range(64)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
