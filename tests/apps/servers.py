"""A real uvicorn server on 127.0.0.1, run in the test's own event loop, and raw connections to
it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from tests.apps.concurrency import BOUND


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


@contextlib.asynccontextmanager
async def uvicorn_serving(app: Any, http: str) -> AsyncIterator[int]:
    """`app` served by uvicorn (`http`: its HTTP/1.1 implementation) in this loop; its port."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=http, log_level="warning")
    async with uvicorn_in_loop(config, BOUND) as server:
        yield port_of(server)


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def parse_head(head: bytes) -> tuple[int, dict[bytes, bytes]]:
    """The status and the headers (by lower-case name, the last of each) of a response head."""
    status_line, *lines = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response (all of the middleware's and the app's have a Content-Length, or none)."""
    status, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return status, headers, body
