"""A real uvicorn server on 127.0.0.1, run in the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn


@contextlib.asynccontextmanager
async def uvicorn_in_loop(
    config: uvicorn.Config, stop_within: float
) -> AsyncIterator[uvicorn.Server]:
    """`config` served until the block ends (then stopped, within `stop_within` seconds); the
    server's port is `port_of(server)`."""
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server._serve())  # (serve() would take the signal handlers)
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, stop_within)


def port_of(server: uvicorn.Server) -> int:
    port: int = server.servers[0].sockets[0].getsockname()[1]
    return port
