"""Options that were taken and then ignored, or failed only at the first request (or at every
one): each is refused when it is given, naming itself. Found by probing."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI

from idem_middleware import LeaseExpiry, MemoryStore, Mode, Policy, idempotent
from idem_middleware.errors import ConfigurationError
from idem_middleware.fastapi import install
from idem_middleware.jobs import idempotent_job
from idem_middleware.otel import OpenTelemetryObserver
from idem_middleware.status import status_route
from idem_middleware.store.postgres import PostgresStore
from idem_middleware.tokens import token_route


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"default_polcy": Policy()}, TypeError),  # (a typo)
        ({"methods": "POST"}, ConfigurationError),
        ({"problem_base": 5}, ConfigurationError),
    ],
)
def test_install_checks_its_options_when_called(options: dict[str, Any], error: type) -> None:
    """The app makes its middleware at its first call, the lifespan's: raised there, uvicorn
    took it for a lifespan the app does not support, started, and answered every request 500."""
    app = FastAPI()
    with pytest.raises(error):
        install(app, store=MemoryStore(), **options)
    assert app.user_middleware == []  # nothing added


def test_idempotent_without_its_parentheses_is_refused() -> None:
    """The endpoint became the decorator's inner function, with no policy: every request then
    failed (FastAPI: 422, a query parameter `endpoint` missing)."""

    async def pay() -> None: ...

    with pytest.raises(ConfigurationError, match=r"write @idempotent\(\)"):
        idempotent(pay)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="takes a Policy"):
        idempotent(Mode.LEASE)  # type: ignore[arg-type]


def test_the_library_routes_take_what_they_use() -> None:
    with pytest.raises(ConfigurationError, match="the middleware's store"):
        status_route(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="a TokenIssuer"):
        token_route(MemoryStore())  # type: ignore[arg-type]


async def _reconcile(ctx: Any) -> Any: ...


async def _no_argument() -> Any: ...


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"replay_hook": lambda response: response}, "replay_hook"),
        ({"mode": Mode.LEASE, "reconciler": _no_argument}, "reconciler must take one"),
        ({"on_lease_expiry": LeaseExpiry.TAKEOVER}, "on_lease_expiry is a lease-mode option"),
    ],
    ids=["hook", "reconciler", "takeover"],
)
def test_a_policy_option_that_could_never_work_is_refused(
    options: dict[str, Any], named: str
) -> None:
    """A hook of one argument failed at every replay (logged, the replay unchanged), a
    reconciler of none at every call; a takeover on a transactional policy did nothing."""
    with pytest.raises(ConfigurationError, match=named):
        Policy(**options)


def test_the_policy_options_that_work_are_taken() -> None:
    Policy(replay_hook=lambda response, scope: response)
    Policy(mode=Mode.LEASE, reconciler=_reconcile, on_lease_expiry=LeaseExpiry.TAKEOVER)


def test_a_job_without_a_place_for_its_context_is_refused() -> None:
    """Every call failed "too many positional arguments", naming neither the context nor why."""

    async def send(*, invoice_id: str) -> None: ...

    with pytest.raises(ConfigurationError, match="IdempotencyContext"):
        idempotent_job(MemoryStore(), operation="send", key="invoice_id")(send)


def test_record_tenant_is_a_boolean() -> None:
    """`record_tenant="false"` put the tenant on every span."""
    with pytest.raises(ConfigurationError, match="record_tenant"):
        OpenTelemetryObserver(record_tenant="false")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"dsn": "postgresql://db.example/app", "listen": "false"}, "listen"),
        ({"dsn": "postgresql://db.example/app", "fast_path": "no"}, "fast_path"),
        ({"pool": object(), "statement_cache_size": 0}, "takes no statement_cache_size"),
    ],
    ids=["listen", "fast_path", "pool options"],
)
def test_store_options_read_as_what_they_do_not_say_are_refused(
    options: dict[str, Any], named: str
) -> None:
    """Strings were true; beside a pool, its options (statement_cache_size=0, which PgBouncer
    needs, among them) were dropped without a word."""
    with pytest.raises(ConfigurationError, match=named):
        PostgresStore(**options)


@pytest.mark.parametrize(
    ("sizes", "named"),
    [
        ({"max_size": 2.5}, "max_size"),
        ({"max_size": 0, "min_size": 0}, "max_size"),
        ({"min_size": -1}, "min_size"),
        ({"min_size": True}, "min_size"),
        ({"min_size": 5, "max_size": 3}, "more than max_size"),
        ({"max_size": 1}, "more than max_size"),  # (min_size's default is 2)
        ({"statement_cache_size": -1}, "statement_cache_size"),
        ({"statement_cache_size": "0"}, "statement_cache_size"),
    ],
)
def test_pool_sizes_asyncpg_would_refuse_at_open_are_refused_when_made(
    sizes: dict[str, Any], named: str
) -> None:
    """They failed only at `open()`, and a float as asyncpg's bare TypeError."""
    with pytest.raises(ConfigurationError, match=named):
        PostgresStore(dsn="postgresql://db.example/app", **sizes)


def test_the_pool_sizes_asyncpg_takes_are_taken() -> None:
    PostgresStore(dsn="postgresql://db.example/app", min_size=0, max_size=1)
    PostgresStore(dsn="postgresql://db.example/app", min_size=3, max_size=3)
    PostgresStore(dsn="postgresql://db.example/app", statement_cache_size=0)


@pytest.mark.parametrize("dsn", ["", "  ", 5])
def test_a_dsn_that_names_no_server_is_refused(dsn: Any) -> None:
    """`""` connected to libpq's defaults without a word; a number failed only at `open()`."""
    with pytest.raises(ConfigurationError, match="dsn"):
        PostgresStore(dsn=dsn)


@pytest.mark.parametrize(
    "dsn",
    [
        "nonsense",
        "postgresql://u:pw-secret@127.0.0.1:notaport/db",
        "postgresql://u:pw-secret@127.0.0.1:99999/db",
        "postgresql://u:pw-secret@[::1/db",
        "postgresql://u:pw-secret@127.0.0.1/db?sslmode=bogus",
    ],
)
async def test_a_dsn_asyncpg_cannot_read_fails_open_as_misconfiguration(dsn: str) -> None:
    """A port that is not a number escaped `open()` as asyncpg's bare ValueError ("invalid
    literal for int()"), naming no option; `nonsense` as a StoreError, a database that is down
    for now. Each is the configuration's fault, said so, and without the password."""
    with pytest.raises(ConfigurationError, match="dsn or connect_kwargs") as caught:
        await PostgresStore(dsn=dsn).open()
    assert "pw-secret" not in str(caught.value)
