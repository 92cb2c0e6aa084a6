"""A streamable-HTTP MCP server built with the official SDK, for the MCP adapter's tests.

``python -m tests.support.mcp_http_server LOG`` listens on a loopback port it prints (one
line, ``port <n>``), and serves two tools: ``note(text, tag)`` appends ``{"text", "tag",
"key"}`` to the JSONL file ``LOG`` (``key``: the idempotency key the call's ``_meta``
carried, or null) and answers ``noted <text>``; ``refuse()`` answers an ``isError`` result.
The log is the server's own record of every call it applied.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import uvicorn
from mcp.server.fastmcp import Context, FastMCP

META_KEY = "rollpoint/idempotency_key"


def main(log: str) -> None:
    server = FastMCP("notes")

    @server.tool(description="Write a note")
    def note(text: str, tag: str, ctx: Context) -> str:  # type: ignore[type-arg]
        meta = ctx.request_context.meta
        key = None if meta is None else (meta.model_extra or {}).get(META_KEY)
        with open(log, "a", encoding="utf-8") as out:
            out.write(json.dumps({"text": text, "tag": tag, "key": key}) + "\n")
        return f"noted {text}"

    @server.tool(description="Always refuses")
    def refuse() -> str:
        raise ValueError("not today")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections wait in the backlog until uvicorn accepts them
    print(f"port {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main(sys.argv[1])
