"""The benchmark apps: one FastAPI app per variant, all with the same business handler.

`uvicorn bench.app:create_app --factory` with `BENCH_VARIANT`, `BENCH_DSN` (a libpq URL) and
`BENCH_POOL_SIZE` in the environment. Every variant has:

- `POST /accounts/{account_id}/credits`: one ledger INSERT and one balance UPSERT in one
  transaction (the bare app's own; the claim's in `ours-tx`, and in `ours-tx-sqla` through a
  SQLAlchemy session on it; the fenced one in `ours-lease`; the handler's own under the peers'
  middleware). The response echoes the Idempotency-Key so the load generator can count the
  distinct keys that got a 2xx.
- `GET /accounts/{account_id}`: one SELECT on the same pool (never guarded).
- `POST /blobs`: answers `size` bytes (the memory measurement's stored responses); no writes.

`ours-memory` is the bare app (its handler on its own pool) behind IdempotencyMiddleware with a
MemoryStore: the middleware's own Python work, with no statements of its own. `floor-memory` is
the bare app behind `bench.floor.FloorMiddleware`, the least a pure-Python idempotency middleware
can do per request (a yardstick, not a product).

Authentication (a bearer token naming the tenant) is the same Starlette middleware everywhere:
the example app's, as are the request and account models (example_app/app.py).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Annotated, Any

import asyncpg
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.middleware.authentication import AuthenticationMiddleware

from example_app.app import AccountOut, BearerTokens, CreditIn
from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, PostgresStore, idempotent
from idem_middleware.fastapi import Idempotency, IdempotencyConnection

#: The variants `python -m bench` knows, in their default order.
VARIANTS = (
    "bare",
    "ours-memory",
    "floor-memory",
    "ours-tx",
    "ours-tx-sqla",
    "ours-lease",
    "fastidempotent",
    "fastapi-idempotency",
)
OURS = frozenset({"ours-tx", "ours-tx-sqla", "ours-lease"})
TOKEN = "bench-token"
TENANT = "tenant-bench"

LEDGER_INSERT = (
    "INSERT INTO bench_ledger (tenant, account_id, amount, memo, idem_key) "
    "VALUES ($1, $2, $3, $4, $5) RETURNING id"
)
BALANCE_UPSERT = (
    "INSERT INTO bench_accounts AS a (tenant, account_id, balance, credits) "
    "VALUES ($1, $2, $3, 1) ON CONFLICT (tenant, account_id) DO UPDATE "
    "SET balance = a.balance + EXCLUDED.balance, credits = a.credits + 1 RETURNING balance"
)
ACCOUNT_SELECT = "SELECT balance, credits FROM bench_accounts WHERE tenant = $1 AND account_id = $2"

SCHEMA = """
CREATE TABLE IF NOT EXISTS bench_accounts (
    tenant      text   NOT NULL,
    account_id  text   NOT NULL,
    balance     bigint NOT NULL DEFAULT 0,
    credits     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, account_id)
);
CREATE TABLE IF NOT EXISTS bench_ledger (
    id          bigserial   PRIMARY KEY,
    tenant      text        NOT NULL,
    account_id  text        NOT NULL,
    amount      bigint      NOT NULL CHECK (amount > 0),
    memo        text,
    idem_key    text,
    created_at  timestamptz NOT NULL DEFAULT now()
);
"""


class BearerTenant(BearerTokens):
    """The example app's bearer authentication, with the one token of the bench tenant."""

    def __init__(self) -> None:
        super().__init__({TOKEN: TENANT})


def tenant_of(request: Request) -> str:
    if not request.user.is_authenticated:
        raise HTTPException(401, "a valid bearer token is required")
    # The user's `identity`, as the middleware's default resolver scopes keys by: the records
    # and the rows this handler writes name the same tenant whatever the user class.
    tenant: str = request.user.identity
    return tenant


Tenant = Annotated[str, Depends(tenant_of)]


class CreditOut(BaseModel):
    credit_id: int
    account_id: str
    amount: int
    balance: int
    key: str | None


class BlobIn(BaseModel):
    size: int = Field(ge=0, le=8 * 1024 * 1024)


async def write_credit(
    conn: Any, tenant: str, account_id: str, body: CreditIn, key: str | None
) -> CreditOut:
    """The business transaction's two statements, on whatever connection the variant gives."""
    credit_id = await conn.fetchval(LEDGER_INSERT, tenant, account_id, body.amount, body.memo, key)
    balance = await conn.fetchval(BALANCE_UPSERT, tenant, account_id, body.amount)
    return CreditOut(
        credit_id=credit_id, account_id=account_id, amount=body.amount, balance=balance, key=key
    )


@functools.cache
def _bound(query: str) -> Any:
    """An asyncpg statement as SQLAlchemy `text()`: `$n` parameters become `:pn` binds."""
    from sqlalchemy import text

    return text(re.sub(r"\$(\d+)", r":p\1", query))


class SessionStatements:
    """`write_credit`'s `fetchval` on a SQLAlchemy session: `session.execute(text(...))`."""

    def __init__(self, session: Any) -> None:
        self.session = session

    async def fetchval(self, query: str, *args: Any) -> Any:
        params = {f"p{n}": value for n, value in enumerate(args, 1)}
        return (await self.session.execute(_bound(query), params)).scalar_one()


def _libpq_parts(dsn: str) -> dict[str, Any]:
    """host (a socket directory or a name), port, user, database of a libpq URL."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    return {
        "host": query.get("host", [parts.hostname or "localhost"])[0],
        "port": int(query.get("port", [parts.port or 5432])[0]),
        "user": parts.username or "postgres",
        "password": parts.password or "",
        "database": parts.path.lstrip("/") or "postgres",
    }


def create_app(
    variant: str | None = None,
    dsn: str | None = None,
    pool_size: int | None = None,
    pool_init: Callable[[Any], Awaitable[None]] | None = None,
) -> FastAPI:
    """The app of one variant. `pool_init` runs on every new pooled connection of the app's own
    asyncpg pool (bench.roundtrips adds its query loggers there)."""
    variant = variant or os.environ["BENCH_VARIANT"]
    dsn = dsn or os.environ["BENCH_DSN"]
    pool_size = pool_size or int(os.environ.get("BENCH_POOL_SIZE", "20"))
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    pool_kwargs: dict[str, Any] = {"min_size": pool_size, "max_size": pool_size}
    if pool_init is not None:
        pool_kwargs["init"] = pool_init
    if variant in OURS:
        app = _ours(dsn, pool_kwargs, variant)
    elif variant == "bare":
        app = _bare(dsn, pool_kwargs)
    elif variant == "ours-memory":
        app = _ours_memory(dsn, pool_kwargs)
    elif variant == "floor-memory":
        app = _floor_memory(dsn, pool_kwargs)
    elif variant == "fastidempotent":
        app = _fastidempotent(dsn, pool_kwargs)
    else:
        app = _fastapi_idempotency(dsn, pool_kwargs)
    if os.environ.get("BENCH_GC_STATS"):
        from .gcstats import install  # python -m bench.gcstats

        install(app)
    app.state.variant = variant
    return app


# -- the routes every variant shares ------------------------------------------------------------


def _shared_routes(app: FastAPI, pool: Callable[[], Any]) -> None:
    @app.get("/accounts/{account_id}")
    async def account(account_id: str, tenant: Tenant) -> AccountOut:
        row = await pool().fetchrow(ACCOUNT_SELECT, tenant, account_id)
        if row is None:
            raise HTTPException(404, "no such account")
        return AccountOut(account_id=account_id, balance=row["balance"], credits=row["credits"])

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"variant": app.state.variant}


def _blob(body: BlobIn) -> Response:
    return Response(b"b" * body.size, status_code=201, media_type="application/octet-stream")


def _own_pool_app(dsn: str, pool_kwargs: dict[str, Any]) -> Any:
    """An app whose handler opens its own transaction on its own asyncpg pool (bare, peers)."""
    holder: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            holder["pool"] = await stack.enter_async_context(
                asyncpg.create_pool(dsn, **pool_kwargs)
            )
            for hook in app.state.startup:
                await stack.enter_async_context(hook(app))
            yield

    app = FastAPI(lifespan=lifespan)
    app.state.startup = []

    def pool() -> Any:
        return holder["pool"]

    @app.post("/accounts/{account_id}/credits", status_code=201)
    async def credit(
        account_id: str, body: CreditIn, tenant: Tenant, request: Request
    ) -> CreditOut:
        key = request.headers.get("idempotency-key")
        async with pool().acquire() as conn, conn.transaction():
            return await write_credit(conn, tenant, account_id, body, key)

    @app.post("/blobs", status_code=201)
    async def blobs(body: BlobIn, tenant: Tenant) -> Response:
        return _blob(body)

    _shared_routes(app, pool)
    return app


def _bare(dsn: str, pool_kwargs: dict[str, Any]) -> FastAPI:
    app: FastAPI = _own_pool_app(dsn, pool_kwargs)
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app


def _ours_memory(dsn: str, pool_kwargs: dict[str, Any]) -> FastAPI:
    """The bare app behind IdempotencyMiddleware with a MemoryStore (no claim statements)."""
    app: FastAPI = _own_pool_app(dsn, pool_kwargs)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app


def _floor_memory(dsn: str, pool_kwargs: dict[str, Any]) -> FastAPI:
    """The bare app behind `bench.floor.FloorMiddleware`: the yardstick for `ours-memory`."""
    from .floor import FloorMiddleware

    app: FastAPI = _own_pool_app(dsn, pool_kwargs)
    app.add_middleware(FloorMiddleware)
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app


def _ours(dsn: str, pool_kwargs: dict[str, Any], variant: str) -> FastAPI:
    init = {"init": pool_kwargs["init"]} if "init" in pool_kwargs else None
    store = PostgresStore(
        dsn=dsn,
        min_size=pool_kwargs["min_size"],
        max_size=pool_kwargs["max_size"],
        connect_kwargs=init,
        fast_path=os.environ.get("BENCH_FAST_PATH", "1") != "0",
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with store:
            yield

    app = FastAPI(lifespan=lifespan)

    if variant == "ours-tx":

        @app.post("/accounts/{account_id}/credits", status_code=201)
        async def credit(
            account_id: str,
            body: CreditIn,
            tenant: Tenant,
            request: Request,
            conn: IdempotencyConnection,
        ) -> CreditOut:
            key = request.headers.get("idempotency-key")
            return await write_credit(conn, tenant, account_id, body, key)

    elif variant == "ours-tx-sqla":
        from idem_middleware.sqla import claim_session  # sqlalchemy: only this variant needs it

        claim = Depends(claim_session)

        @app.post("/accounts/{account_id}/credits", status_code=201)
        async def credit_sqla(
            account_id: str,
            body: CreditIn,
            tenant: Tenant,
            request: Request,
            session: Any = claim,
        ) -> CreditOut:
            key = request.headers.get("idempotency-key")
            return await write_credit(SessionStatements(session), tenant, account_id, body, key)

    if variant != "ours-lease":

        @app.post("/blobs", status_code=201)
        async def blobs(body: BlobIn, tenant: Tenant) -> Response:
            return _blob(body)

    else:

        @app.post("/accounts/{account_id}/credits", status_code=201)
        @idempotent(mode=Mode.LEASE)
        async def credit_lease(
            account_id: str, body: CreditIn, tenant: Tenant, request: Request, idem: Idempotency
        ) -> CreditOut:
            key = request.headers.get("idempotency-key")
            conn = await idem.fenced_connection()
            return await write_credit(conn, tenant, account_id, body, key)

        @app.post("/blobs", status_code=201)
        @idempotent(mode=Mode.LEASE)
        async def blobs_lease(body: BlobIn, tenant: Tenant) -> Response:
            return _blob(body)

    _shared_routes(app, lambda: store.pool)
    # Outermost first: authentication runs before the idempotency middleware needs a tenant.
    app.add_middleware(IdempotencyMiddleware, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app


def _fastidempotent(dsn: str, pool_kwargs: dict[str, Any]) -> FastAPI:
    """fastidempotent's middleware with its PostgreSQL backend (SQLAlchemy + asyncpg)."""
    from fastidempotent import IdempotencyMiddleware
    from fastidempotent.backends.postgres import PostgresBackend

    p = _libpq_parts(dsn)
    url = f"postgresql+asyncpg://{p['user']}@/{p['database']}?host={p['host']}&port={p['port']}"
    backend = PostgresBackend(
        url=url, table_name="fastidempotent_keys", pool_size=pool_kwargs["max_size"]
    )

    @asynccontextmanager
    async def started(app: FastAPI) -> AsyncIterator[None]:
        await backend.init()  # CREATE TABLE IF NOT EXISTS
        try:
            yield
        finally:
            await backend.close()

    app: FastAPI = _own_pool_app(dsn, pool_kwargs)
    app.state.startup.append(started)
    app.add_middleware(IdempotencyMiddleware, backend=backend, methods=["POST"])
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app


def _fastapi_idempotency(dsn: str, pool_kwargs: dict[str, Any]) -> FastAPI:
    """fastapi-idempotency's middleware with its Tortoise ORM store on PostgreSQL (asyncpg)."""
    from fastapi_idempotency import IdempotencyMiddleware
    from fastapi_idempotency.stores.tortoise import TortoiseStore
    from tortoise.contrib.fastapi import RegisterTortoise

    p = _libpq_parts(dsn)
    config = {
        "connections": {
            "default": {
                "engine": "tortoise.backends.asyncpg",
                "credentials": {
                    **p,
                    "minsize": pool_kwargs["min_size"],
                    "maxsize": pool_kwargs["max_size"],
                },
            }
        },
        "apps": {"idem": {"models": ["fastapi_idempotency.stores.tortoise"]}},
    }

    def started(app: FastAPI) -> Any:
        return RegisterTortoise(app, config=config, generate_schemas=True)

    app: FastAPI = _own_pool_app(dsn, pool_kwargs)
    app.state.startup.append(started)
    app.add_middleware(IdempotencyMiddleware, store=TortoiseStore(), methods=["POST"])
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app
