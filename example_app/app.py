"""The example app: tenant accounts credited through idempotent, transactional requests.

Run it with `python -m example_app`. The HTTP contract is fixed in PROTOCOL §7.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection

from idem_middleware import IdempotencyMiddleware, Policy, PostgresStore
from idem_middleware.fastapi import IdempotencyConnection

DEFAULT_TOKENS = "demo-a:tenant-a,demo-b:tenant-b"


def parse_tokens(spec: str) -> dict[str, str]:
    """`EXAMPLE_TOKENS="token:tenant,..."` -> {token: tenant}."""
    tokens = {}
    for item in spec.split(","):
        token, sep, tenant = item.strip().partition(":")
        if not sep or not token or not tenant:
            raise ValueError(f"EXAMPLE_TOKENS entry {item!r} is not token:tenant")
        tokens[token] = tenant
    return tokens


class BearerTokens(AuthenticationBackend):
    """Demo authentication: a fixed bearer-token table. The tenant comes only from here."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        tenant = self.tokens.get(token) if scheme.lower() == "bearer" else None
        if tenant is None:
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(tenant)


def tenant_of(request: Request) -> str:
    if not request.user.is_authenticated:
        raise HTTPException(401, "a valid bearer token is required")
    tenant: str = request.user.display_name
    return tenant


Tenant = Annotated[str, Depends(tenant_of)]


class CreditIn(BaseModel):
    amount: int = Field(gt=0)
    memo: str | None = None


class CreditOut(BaseModel):
    credit_id: str
    account_id: str
    amount: int
    balance: int


class AccountOut(BaseModel):
    account_id: str
    balance: int
    credits: int


def create_app(database_url: str | None = None) -> FastAPI:
    """Build the app. `database_url` defaults to $DATABASE_URL (set by `python -m example_app`)."""
    dsn = database_url or os.environ["DATABASE_URL"]
    wait_seconds = float(os.environ.get("EXAMPLE_WAIT_SECONDS", "5"))
    tokens = parse_tokens(os.environ.get("EXAMPLE_TOKENS") or DEFAULT_TOKENS)
    store = PostgresStore(dsn=dsn, min_size=2, max_size=20)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with store:
            yield

    app = FastAPI(title="idem_middleware example", lifespan=lifespan)
    # Starlette runs middleware outside-in in this order: authentication first, so the
    # idempotency middleware scopes every key by the authenticated tenant.
    app.add_middleware(
        IdempotencyMiddleware, store=store, default_policy=Policy(wait_seconds=wait_seconds)
    )
    app.add_middleware(AuthenticationMiddleware, backend=BearerTokens(tokens))

    @app.exception_handler(HTTPException)
    async def problem(request: Request, exc: HTTPException) -> JSONResponse:
        # The same RFC 9457 shape the middleware uses for its own refusals.
        return JSONResponse(
            {"type": "about:blank", "title": exc.detail, "status": exc.status_code},
            status_code=exc.status_code,
            media_type="application/problem+json",
        )

    @app.post("/accounts/{account_id}/credits", status_code=201)
    async def credit(
        account_id: str,
        body: CreditIn,
        tenant: Tenant,
        conn: IdempotencyConnection,
    ) -> CreditOut:
        # Both writes run in the claim's transaction: they commit with the stored response,
        # or roll back with it, so a retry can never credit twice.
        credit_id = await conn.fetchval(
            "INSERT INTO ex_credits (tenant, account_id, amount, memo) VALUES ($1, $2, $3, $4) "
            "RETURNING credit_id::text",
            tenant,
            account_id,
            body.amount,
            body.memo,
        )
        balance = await conn.fetchval(
            "INSERT INTO ex_accounts AS a (tenant, account_id, balance, credits) "
            "VALUES ($1, $2, $3, 1) ON CONFLICT (tenant, account_id) DO UPDATE "
            "SET balance = a.balance + EXCLUDED.balance, credits = a.credits + 1 "
            "RETURNING balance",
            tenant,
            account_id,
            body.amount,
        )
        return CreditOut(
            credit_id=credit_id, account_id=account_id, amount=body.amount, balance=balance
        )

    @app.get("/accounts/{account_id}")
    async def account(account_id: str, tenant: Tenant) -> AccountOut:
        row: Any = await store.pool.fetchrow(
            "SELECT balance, credits FROM ex_accounts WHERE tenant = $1 AND account_id = $2",
            tenant,
            account_id,
        )
        if row is None:
            raise HTTPException(404, "no such account")
        return AccountOut(account_id=account_id, balance=row["balance"], credits=row["credits"])

    return app
