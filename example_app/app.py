"""The example app: tenant accounts credited through idempotent, transactional requests.

Run it with `python -m example_app`. The HTTP contract is in docs/example-app.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import asyncpg
import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection

from idem_middleware import Mode, Policy, PostgresStore, idempotent, outbox
from idem_middleware.downstream import downstream_hooks
from idem_middleware.fastapi import Idempotency, IdempotencyConnection, install
from idem_middleware.reconcile import (
    Happened,
    NotHappened,
    ReconcileContext,
    Reconciliation,
    StillUnknown,
)

from .bank import create_bank_app
from .ledger import Hold, debit, hold_funds
from .models import (
    AccountOut,
    AccountPath,
    CreditIn,
    CreditOut,
    PayoutIn,
    PayoutOut,
    http_problem,
    problem,
    problems,
    validation_problem,
)
from .settings import read_settings
from .supervisor import stop_when_orphaned

#: What the app's own database work meets when the database is unreachable or restarting: a 503.
DATABASE_DOWN = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    # A new connection refused: the database closed for maintenance (`ALLOW_CONNECTIONS false`,
    # 55000; its lock timeouts too, 55P03), dropped or renamed (3D000), too many connections.
    asyncpg.ObjectNotInPrerequisiteStateError,
    asyncpg.InvalidCatalogNameError,
    asyncpg.InsufficientResourcesError,
    # A pooled connection the server ended while it sat idle (a restart's "terminating
    # connection due to administrator command"), taken before asyncpg saw the socket close:
    # "cannot switch to state 12; another operation (2) is in progress" (as the store's own).
    asyncpg.InternalClientError,
    # The server ending the session itself (FATAL): its crash recovery, the database dropped,
    # the role's or database's `idle_session_timeout` or `idle_in_transaction_session_timeout`;
    # and a login the server refuses (a role disabled, a password rotated). The store's own
    # list has each (tests/unit/test_example_database_down.py keeps the two in step).
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.DatabaseDroppedError,
    asyncpg.exceptions.IdleSessionTimeoutError,
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
    # A server that takes no writes for now (a hot standby after a failover, or
    # `default_transaction_read_only` set for maintenance).
    asyncpg.exceptions.ReadOnlySQLTransactionError,
)


def database_unavailable() -> HTTPException:
    """What the app's own routes answer while the database is away, as the middleware answers
    the guarded ones: a 503 problem with `Retry-After`."""
    return HTTPException(503, "the database is unavailable", {"Retry-After": "1"})


#: How long shutdown waits for the publisher's batch in flight before cancelling it.
PUBLISHER_STOP_SECONDS = 5.0

logger = logging.getLogger("example_app")


#: What every 401 answers in WWW-Authenticate: the one scheme this app accepts.
CHALLENGE = "Bearer"


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


async def tenant_of(request: Request) -> str:
    # async: FastAPI runs a plain `def` dependency in a worker thread, which costs far more.
    if not request.user.is_authenticated:
        # RFC 9110: a 401 names the scheme to authenticate with (the middleware's 401s too).
        raise HTTPException(
            401, "a valid bearer token is required", headers={"WWW-Authenticate": CHALLENGE}
        )
    # The user's `identity`, as the middleware's default resolver scopes keys by: the records
    # and the rows this handler writes name the same tenant whatever the user class.
    tenant: str = request.user.identity
    return tenant


Tenant = Annotated[str, Depends(tenant_of)]


async def publish(publisher: outbox.Publisher, stop: asyncio.Event) -> None:
    """Run the outbox publisher until `stop`; a failure (the database restarting, say) is logged
    and the publisher starts over a second later. Events are sent at least once: the consumer
    (the bank's POST /webhooks) deduplicates them by event id."""
    while not stop.is_set():
        try:
            await publisher.run(stop=stop)
        except Exception:
            logger.exception("the outbox publisher failed; restarting it in 1 s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


def create_app(database_url: str | None = None) -> FastAPI:
    """Build the app. `database_url` defaults to $DATABASE_URL (set by `python -m example_app`)."""
    dsn = database_url or os.environ["DATABASE_URL"]
    settings = read_settings()  # (ValueError, naming the variable, for one it cannot use)
    wait_seconds, lease_seconds = settings.wait_seconds, settings.lease_seconds
    bank_timeout, bank_url = settings.bank_timeout, settings.bank_url
    hold_seconds = settings.hold_seconds
    run_publisher, tokens = settings.publish, settings.tokens
    store = PostgresStore(dsn=dsn, min_size=2, max_size=20)

    # The bank: a separate service (BANK_URL), or the simulator mounted in-process under /bank.
    # Every request this client makes inside an idempotent operation carries the operation's
    # downstream key as its Idempotency-Key (see idem_middleware.downstream).
    bank_app = None if bank_url else create_bank_app(loopback_only=True)
    transport = httpx.ASGITransport(app=bank_app) if bank_app is not None else None
    bank = httpx.AsyncClient(
        base_url=bank_url or "http://bank.internal",
        transport=transport,
        timeout=bank_timeout,
        event_hooks=downstream_hooks(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        orphaned = asyncio.create_task(stop_when_orphaned())
        try:
            async with store, bank, publishing():
                yield
        finally:
            orphaned.cancel()

    @asynccontextmanager
    async def publishing() -> AsyncIterator[None]:
        if not run_publisher:
            yield
            return
        # The outbox publisher: one per worker process; SKIP LOCKED keeps them apart.
        stop = asyncio.Event()
        publisher = outbox.Publisher(store.pool, outbox.webhook_sender(bank, "/webhooks"))
        task = asyncio.create_task(publish(publisher, stop))
        try:
            yield
        finally:
            stop.set()
            # A batch in flight gets a few seconds; cancelled, its transaction rolls back
            # and its events are sent again later.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(task, PUBLISHER_STOP_SECONDS)

    async def send_money(account: str, amount: int) -> dict[str, Any] | None:
        """POST the transfer; None when the bank's answer is lost (timeout or error)."""
        try:
            # httpx's own timeout does not apply to an in-process transport; this one does.
            async with asyncio.timeout(bank_timeout):
                r = await bank.post("/transfers", json={"account": account, "amount": amount})
        except (TimeoutError, httpx.HTTPError):
            return None
        if r.status_code != 201:  # (a proxy's error page is not JSON: read nothing else)
            return None
        try:
            transfer = r.json()
        except ValueError:
            return None
        # (A 201 that is no transfer, an error page's, say: as lost, never a 500 from here.)
        if not isinstance(transfer, dict) or not isinstance(transfer.get("transfer_id"), str):
            return None
        return transfer

    async def reconcile_payout(ctx: ReconcileContext) -> Reconciliation:
        """A retry met an unknown payout: ask the bank about the downstream key."""
        try:
            async with asyncio.timeout(bank_timeout):
                r = await bank.get(f"/transfers/{ctx.downstream_key}")
        except (TimeoutError, httpx.HTTPError):
            return StillUnknown("the bank cannot be reached")
        if r.status_code == 404:
            return NotHappened()  # no money moved: run the payout again
        if r.status_code != 200:
            return StillUnknown(f"the bank answered {r.status_code}")
        transfer = r.json()
        # The bank's account is "<tenant>:<account id>"; a tenant may contain ":" itself.
        owner, account_id = f"{ctx.tenant}:", transfer["account"]
        if not account_id.startswith(owner):
            return StillUnknown("the bank's transfer is for another tenant's account")
        account_id = account_id.removeprefix(owner)
        # The money moved: record the debit now, in the transaction that settles the record.
        conn = await ctx.fenced_connection()
        payout = await debit(
            conn, ctx.tenant, account_id, transfer["amount"], transfer, ctx.downstream_key
        )
        return Happened.json(201, payout.model_dump())

    app = FastAPI(title="idem_middleware example", lifespan=lifespan)
    if bank_app is not None:
        app.mount("/bank", bank_app)
    # Starlette runs middleware outside-in in this order: authentication first, so the
    # idempotency middleware scopes every key by the authenticated tenant.
    install(
        app,
        store=store,
        default_policy=Policy(wait_seconds=wait_seconds),
        www_authenticate=CHALLENGE,
    )
    app.add_middleware(AuthenticationMiddleware, backend=BearerTokens(tokens))

    # Every refusal is an RFC 9457 problem, in the shape the middleware uses for its own:
    # Starlette's HTTPException (the router's own 404 and 405 too) and FastAPI's validation 422.
    app.add_exception_handler(StarletteHTTPException, http_problem)
    app.add_exception_handler(RequestValidationError, validation_problem)

    @app.post("/accounts/{account_id}/credits", status_code=201, responses=problems(422))
    async def credit(
        account_id: AccountPath,
        body: CreditIn,
        tenant: Tenant,
        conn: IdempotencyConnection,
    ) -> CreditOut:
        # Every write runs in the claim's transaction: they commit with the stored response,
        # or roll back with it, so a retry can never credit twice nor emit a second event.
        credit_id = await conn.fetchval(
            "INSERT INTO ex_credits (tenant, account_id, amount, memo) VALUES ($1, $2, $3, $4) "
            "RETURNING credit_id::text",
            tenant,
            account_id,
            body.amount,
            body.memo,
        )
        event = {
            "credit_id": credit_id,
            "account_id": account_id,
            "amount": body.amount,
            "memo": body.memo,
        }
        await outbox.add(
            conn, "credit.created", event, event_id=f"credit:{credit_id}", tenant=tenant
        )
        try:
            balance = await conn.fetchval(
                "INSERT INTO ex_accounts AS a (tenant, account_id, balance, credits) "
                "VALUES ($1, $2, $3, 1) ON CONFLICT (tenant, account_id) DO UPDATE "
                "SET balance = a.balance + EXCLUDED.balance, credits = a.credits + 1 "
                "RETURNING balance",
                tenant,
                account_id,
                body.amount,
            )
        except asyncpg.NumericValueOutOfRangeError:
            # A 422 releases the key: the claim's transaction rolls back, credit row and all.
            raise HTTPException(422, "the balance would exceed the largest one kept") from None
        return CreditOut(
            credit_id=credit_id, account_id=account_id, amount=body.amount, balance=balance
        )

    @app.post(
        "/payouts",
        status_code=201,
        response_model=PayoutOut,
        responses=problems(402, 404, 422, 502, 503),
    )
    @idempotent(
        mode=Mode.LEASE,
        lease_seconds=lease_seconds,
        wait_seconds=wait_seconds,
        reconciler=reconcile_payout,
    )
    async def payout(body: PayoutIn, tenant: Tenant, idem: Idempotency) -> Any:
        # The money is held first, in a transaction of its own (see ledger.py): while the
        # outcome is unknown it stays held, and no other payout can spend it.
        try:
            held = await hold_funds(
                store.pool, tenant, body.account_id, body.amount, idem.downstream_key, hold_seconds
            )
        except DATABASE_DOWN:
            # As the middleware answers when the database is away (not a plain-text 500). A
            # 5xx leaves the outcome unknown: the retry asks the bank first, which was never
            # called, and runs again, finding its hold if this one committed after all.
            raise database_unavailable() from None
        if held is Hold.MISSING:
            raise HTTPException(404, "no such account")
        if held is Hold.SHORT:
            # A final failure: stored, and replayed to every retry with this key.
            return problem(
                402, "the account's balance is less than the amount", "insufficient-funds"
            )
        transfer = await send_money(f"{tenant}:{body.account_id}", body.amount)
        if transfer is None:
            # The bank may or may not have moved the money: the outcome is unknown, and the
            # money stays held. A retry asks the bank (reconcile_payout) before doing anything.
            return problem(
                502, "the bank's answer was lost; retry with the same key", "bank-answer-lost"
            )
        # The fenced transaction: it holds the idempotency record under this execution's
        # generation, and commits the debit together with the outcome, or not at all.
        conn = await idem.fenced_connection()
        return await debit(
            conn, tenant, body.account_id, body.amount, transfer, idem.downstream_key
        )

    @app.get("/accounts/{account_id}", responses=problems(401, 404, 422, 503))
    async def account(account_id: AccountPath, tenant: Tenant) -> AccountOut:
        try:
            row: Any = await store.pool.fetchrow(
                "SELECT balance, credits FROM ex_accounts WHERE tenant = $1 AND account_id = $2",
                tenant,
                account_id,
            )
        except DATABASE_DOWN:
            # As the middleware answers its own routes when the database is away.
            raise database_unavailable() from None
        if row is None:
            raise HTTPException(404, "no such account")
        return AccountOut(account_id=account_id, balance=row["balance"], credits=row["credits"])

    return app
