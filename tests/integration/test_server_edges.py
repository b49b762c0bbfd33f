"""HTTP/1.1 edges of guarded requests behind uvicorn (h11, httptools), hypercorn and granian,
each a process of its own on 127.0.0.1 (tests/edges_app.py: a pool of one connection), spoken to
over raw sockets, counted in the database. One process per server for the module: each test gets
it with the tables emptied and nothing of the last test's requests still running, or a new one.
Each server is skipped where it is not installed.

- Clients that never read a large response (one streamed past `max_response_bytes`, replays of
  a held one): nothing holds the pool's only connection or a transaction while they do not read.
- A client that leaves mid-body (Content-Length or chunked), in both modes: nothing is claimed,
  and its retry runs once.
- A request pipelined after a `413` whose body was not read: it is answered, or the server closes
  the connection (hypercorn and granian, after an unfinished chunked body); the refused body is
  never read as a request, and nothing of the refused request is claimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.apps.servers import parse_head, read_response
from tests.edges_app import EFFECTS, MAX_BODY
from tests.integration.test_worker_servers import BOUND, Server, _available, until

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.edges_app:create_app"
_UVICORN = [sys.executable, "-m", "uvicorn", "--factory", APP, "--log-level", "warning"]
_UVICORN += ["--host", "127.0.0.1", "--port", "{port}", "--http"]
SERVERS = {
    "uvicorn-h11": (("uvicorn",), [*_UVICORN, "h11"]),
    "uvicorn-httptools": (("uvicorn", "httptools"), [*_UVICORN, "httptools"]),
    "hypercorn": (
        ("hypercorn",),
        [sys.executable, "-m", "hypercorn", "-b", "127.0.0.1:{port}", APP + "()"],
    ),
    "granian": (
        ("granian",),
        [
            *(sys.executable, "-m", "granian", "--interface", "asgi", "--factory"),
            *("--host", "127.0.0.1", "--port", "{port}", APP),
        ],
    ),
}


class Edges:
    def __init__(self, server: Server, db: asyncpg.Pool[Any]) -> None:
        self.server, self.db = server, db
        self.writers: list[asyncio.StreamWriter] = []

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        self.writers.append(writer)
        return reader, writer

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(writer.wait_closed(), BOUND)

    async def claimed(self) -> dict[str, str]:
        rows = await self.db.fetch("SELECT idem_key, state FROM idem_requests")
        return {row["idem_key"]: row["state"] for row in rows}

    async def effects(self) -> list[tuple[str, int]]:
        rows = await self.db.fetch("SELECT k, n FROM edges_effects ORDER BY k, n")
        return [(row["k"], row["n"]) for row in rows]

    async def in_transaction(self) -> int:
        n: int = await self.db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
        )
        return n


#: The server's sessions, once a test's clients are gone, are idle again within this long; if
#: not, the next test gets a server of its own.
QUIET = 5.0
_BUSY = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    " AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state <> 'idle'"
)


async def quiet(db: asyncpg.Pool[Any]) -> bool:
    """No session of the database but ours is running a statement or inside a transaction."""
    for _ in range(int(QUIET / 0.02)):
        if await db.fetchval(_BUSY) == 0:
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.fixture(scope="module", params=list(SERVERS))
def edges_server(
    request: pytest.FixtureRequest, db_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server process per kind for the module (starting one is most of a test's time):
    `edges` hands it to each test with the tables emptied and nothing of the last test's still
    running, and starts it again if it is not."""
    modules, command = SERVERS[request.param]
    if not _available(*modules):
        pytest.skip(f"{request.param}: {', '.join(modules)} not installed")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SERVERS_APP_DSN": db_dsn}
    server = Server(command, env, tmp_path_factory.mktemp("edges") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def edges(edges_server: Server, db_dsn: str) -> AsyncIterator[Edges]:
    server = edges_server
    db = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    try:
        await db.execute(EFFECTS)
        if server.proc is not None and (server.proc.poll() is not None or not await quiet(db)):
            server.stop()  # (the last test's requests never settled: a server of its own)
            server.proc = None
        async with db.acquire() as conn, conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{int(BOUND * 1000)}ms'")
            await conn.execute("TRUNCATE idem_requests, edges_effects")
        if server.proc is None:
            server.start()
        await until(server.answers, "the server")
        edges = Edges(server, db)
        try:
            yield edges
        finally:
            await edges.close()
            if not await quiet(db):
                server.stop()
                server.proc = None
    finally:
        await db.close()


def post(path: str, key: str, body: bytes = b"0123456789", length: int | None = None) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: t", f"idempotency-key: {key}"]
    head += ["content-type: application/octet-stream"]
    head += [f"content-length: {len(body) if length is None else length}"]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


def chunked(path: str, key: str, chunks: bytes) -> bytes:
    head = post(path, key).split(b"content-length")[0]
    return head + b"transfer-encoding: chunked\r\n\r\n" + chunks


async def head_of(reader: asyncio.StreamReader) -> int:
    """The status of a response whose head has arrived (its body left unread)."""
    return parse_head(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND))[0]


@pytest.mark.parametrize("route", ["/t", "/l"], ids=["transactional", "lease"])
async def test_clients_that_never_read_a_large_response_hold_no_connection(
    edges: Edges, route: str
) -> None:
    # Streamed past max_response_bytes (8 MB), then replays of a held one (900 kB): each
    # client reads the head and stops, its server blocked on a full socket.
    reader, writer = await edges.connect()
    writer.write(post(f"{route}/big?size=8000000", "big"))
    assert await head_of(reader) == 201
    reader, writer = await edges.connect()
    writer.write(post(f"{route}/held?size=900000", "held"))
    status, _, body = await asyncio.wait_for(read_response(reader), BOUND)
    assert (status, len(body)) == (201, 900000)
    for _ in range(3):
        reader, writer = await edges.connect()
        writer.write(post(f"{route}/held?size=900000", "held"))
        assert await head_of(reader) == 201

    # The pool's one connection is free: another request is answered, and none is held in
    # a transaction.
    reader, writer = await edges.connect()
    writer.write(post(f"{route}/other", "other"))
    assert (await asyncio.wait_for(read_response(reader), BOUND))[0] == 201
    assert await edges.in_transaction() == 0
    assert await edges.claimed() == {"big": "succeeded", "held": "succeeded", "other": "succeeded"}
    assert await edges.effects() == [("big", 10), ("held", 10), ("other", 10)]


@pytest.mark.parametrize("route", ["/t", "/l"], ids=["transactional", "lease"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_client_that_leaves_mid_body_claims_nothing(
    edges: Edges, route: str, framing: str
) -> None:
    path = f"{route}/left"
    reader, writer = await edges.connect()
    if framing == "chunked":
        writer.write(chunked(path, "left", b"5\r\n01234\r\n"))
    else:
        writer.write(post(path, "left")[:-4])
    await writer.drain()
    # A request on another connection, answered after the server has the first one's bytes.
    other_reader, other_writer = await edges.connect()
    other_writer.write(post(f"{route}/other", "other"))
    assert (await asyncio.wait_for(read_response(other_reader), BOUND))[0] == 201
    assert "left" not in await edges.claimed()
    reader, writer = await edges.connect()
    writer.write(post(path, "left"))
    assert (await asyncio.wait_for(read_response(reader), BOUND))[0] == 201
    assert await edges.effects() == [("left", 10), ("other", 10)]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_request_pipelined_after_a_413_is_never_read_from_the_refused_body(
    edges: Edges, framing: str
) -> None:
    # The refused body is a request itself: read as one, it would claim "smuggled".
    smuggled = post("/t/smuggled", "smuggled")
    padding = b"x" * (MAX_BODY + 1 - len(smuggled))
    if framing == "chunked":
        refused = chunked("/t/big", "big", b"%x\r\n" % (len(smuggled + padding)))
        refused += smuggled + padding + b"\r\n0\r\n\r\n"
    else:
        refused = post("/t/big", "big", smuggled + padding)
    reader, writer = await edges.connect()
    writer.write(refused + post("/t/next", "next"))
    status, headers, _ = await asyncio.wait_for(read_response(reader), BOUND)
    assert (status, headers[b"content-type"]) == (413, b"application/problem+json")
    try:
        answered = (await asyncio.wait_for(read_response(reader), BOUND))[0]
    except asyncio.IncompleteReadError:  # (the server closed the connection)
        answered = None
    if answered is None:
        reader, writer = await edges.connect()
        writer.write(post("/t/next", "next"))
        answered = (await asyncio.wait_for(read_response(reader), BOUND))[0]
    assert answered == 201
    assert await edges.claimed() == {"next": "succeeded"}
    assert await edges.effects() == [("next", 10)]
