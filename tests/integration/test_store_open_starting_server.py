"""A store opened while its PostgreSQL cannot accept connections yet (57P03: starting up, in
crash recovery after a restart) asks again, bounded by `acquire_timeout`, instead of failing the
app's startup at once (a uvicorn worker started during a database restart failed, and uvicorn
stopped every worker with it). Other refusals still fail at once.

A loopback stand-in answers the first connections as a starting server does (an ErrorResponse
with SQLSTATE 57P03 to the startup message), then passes the bytes through to the real server.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError

_SSL_REQUEST = 80877103


def _error(code: str, message: str) -> bytes:
    fields = b"".join(
        kind + text.encode() + b"\0"
        for kind, text in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", code), (b"M", message))
    )
    body = fields + b"\0"
    return b"E" + struct.pack("!i", len(body) + 4) + body


async def _startup(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads the client's startup message (after declining TLS, if it asks)."""
    for _ in range(2):
        length, code = struct.unpack("!ii", await reader.readexactly(8))
        await reader.readexactly(length - 8)
        if code != _SSL_REQUEST:
            return
        writer.write(b"N")
        await writer.drain()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


class Starting:
    """Answers the first `refusals` connections with `code`, then forwards them to `upstream`
    (a coroutine function that opens a connection to the real server)."""

    def __init__(self, upstream: Any, refusals: int, code: str = "57P03") -> None:
        self.upstream, self.refusals, self.code = upstream, refusals, code
        self.refused = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refused < self.refusals:
            self.refused += 1
            try:
                await _startup(reader, writer)
                writer.write(_error(self.code, "the database system is starting up"))
                await writer.drain()
            finally:
                writer.close()
            return
        up_reader, up_writer = await self.upstream()
        for task in (_pump(reader, up_writer), _pump(up_reader, writer)):
            self.tasks.add(asyncio.ensure_future(task))


@asynccontextmanager
async def starting(dsn: str, refusals: int, code: str = "57P03") -> AsyncIterator[tuple[str, Any]]:
    """`dsn` through a stand-in at 127.0.0.1 that refuses its first `refusals` connections (the
    real server on TCP, or on a Unix socket: a `host` that is a directory)."""
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = query.pop("host", [parts.hostname or "127.0.0.1"])[0]
    port = parts.port or 5432
    if host.startswith("/"):
        upstream = partial(asyncio.open_unix_connection, f"{host}/.s.PGSQL.{port}")
    else:
        upstream = partial(asyncio.open_connection, host, port)
    stand_in = Starting(upstream, refusals, code)
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    query["sslmode"] = ["disable"]
    through = urlunsplit(parts._replace(netloc=user + address, query=urlencode(query, doseq=True)))
    try:
        yield through, stand_in
    finally:
        server.close()
        for task in stand_in.tasks:
            task.cancel()
        await asyncio.gather(*stand_in.tasks, return_exceptions=True)


async def test_a_store_opened_while_the_server_starts_up_opens_once_it_accepts(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with starting(db_dsn, refusals=3) as (dsn, stand_in):
        store = PostgresStore(dsn=dsn, min_size=1, max_size=2, acquire_timeout=10, listen=False)
        with caplog.at_level(logging.WARNING, logger="idem_middleware"):
            async with asyncio.timeout(30), store:
                assert await store.pool.fetchval("SELECT 1") == 1
    assert stand_in.refused == 3
    assert caplog.text.count("cannot accept connections yet") == 1  # once, not per attempt


async def test_a_server_still_starting_past_acquire_timeout_is_a_store_error(db_dsn: str) -> None:
    async with starting(db_dsn, refusals=1_000) as (dsn, stand_in):
        store = PostgresStore(dsn=dsn, min_size=1, max_size=2, acquire_timeout=1, listen=False)
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StoreError, match="starting up"):
            async with asyncio.timeout(30):
                await store.open()
        assert loop.time() - began < 5
    assert 2 <= stand_in.refused <= 8


async def test_another_refusal_fails_the_open_at_once(db_dsn: str) -> None:
    """53300 (too many connections) is not "try again shortly": the store fails as before."""
    async with starting(db_dsn, refusals=1_000, code="53300") as (dsn, stand_in):
        store = PostgresStore(dsn=dsn, min_size=1, max_size=2, acquire_timeout=10, listen=False)
        with pytest.raises(StoreError):
            async with asyncio.timeout(30):
                await store.open()
    assert stand_in.refused == 1
