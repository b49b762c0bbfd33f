"""An adopter's typed code, never run: test_readme_examples type-checks it with the docs' apps
under `mypy --strict`. What the docs say each option takes is accepted, and a misspelt option
is an error (each `type: ignore` below must be needed: `--strict` reports one that is not)."""

from __future__ import annotations

import uuid
from fractions import Fraction
from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import text
from starlette.requests import Request

from idem_middleware import IdempotencyContext, MemoryStore, Mode, Policy, get_context, idempotent
from idem_middleware.fastapi import install
from idem_middleware.jobs import idempotent_job
from idem_middleware.outbox import webhook_sender
from idem_middleware.pytest_plugin import Replay
from idem_middleware.sqla import open_claim_session

store = MemoryStore()

# A mode or a lease expiry as its value; names in a set or a list; a Fraction of seconds.
LEASED = Policy(
    mode="lease",
    on_lease_expiry="takeover",
    include_headers={"x-api-version"},
    exclude_fields=["/meta/trace"],
    wait_seconds=Fraction(1, 2),
)
SHORTER = LEASED.replace(lease_seconds=10, mode=Mode.LEASE, include_fields={"a": 1}.keys())
# One string is not a collection of names: the checker says so, as the policy does at run time.
ONE_NAME = Policy(include_headers="x-api-version")  # type: ignore[arg-type]
BAD_MODE = Policy(mode="leased")  # type: ignore[arg-type]
MISSPELT = Policy(wait_secnds=2)  # type: ignore[call-arg]


@idempotent(mode="lease", retention_seconds=3600)
async def pay(request: Request) -> dict[str, str]:
    return {"tenant": get_context(request).tenant}


@idempotent(wait_secnds=2)  # type: ignore[call-arg]
async def misspelt(request: Request) -> None: ...


app = FastAPI()
install(app, store=store, www_authenticate="Bearer", max_waiters=64)
install(app, store=store, www_authenticat="Bearer")  # type: ignore[call-arg]


def account_of(*args: Any, account: uuid.UUID, **kwargs: Any) -> uuid.UUID:
    return account


@idempotent_job(store, operation="send", key="invoice_id", tenant=account_of, mode="lease")
async def send_invoice(job: IdempotencyContext, invoice_id: str, account: uuid.UUID) -> int:
    return 1


async def jobs_called() -> None:
    await send_invoice(invoice_id="i-1", account=uuid.uuid4())
    await send_invoice(invoce_id="i-1", account=uuid.uuid4())  # type: ignore[call-arg]


SENDER = webhook_sender(httpx.AsyncClient(), httpx.URL("http://127.0.0.1:9/hook"))
NO_CONTEXT = get_context(42)  # type: ignore[arg-type]


async def with_a_session(request: Request) -> None:
    async with open_claim_session(request) as session:  # (a SQLAlchemy AsyncSession)
        await session.execute(text("SELECT 1"))
        await session.no_such_method()  # type: ignore[attr-defined]


async def a_test(idem_replay: Replay, client: httpx.AsyncClient, sync: httpx.Client) -> None:
    first, second = await idem_replay(client, "POST", "/pay", json={})
    assert first.status_code == second.status_code  # (httpx responses)
    first, _ = idem_replay(sync, "POST", "/pay", json={})  # (a sync client: no await)
    idem_replay(client, "POST", "/pay")  # type: ignore[unused-coroutine]
