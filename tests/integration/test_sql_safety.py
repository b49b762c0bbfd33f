"""What reaches SQL text, and what keeps tenants apart, whatever the session's settings.

The fast path writes values into the text of a simple-query message (store/postgres.py
`_literal`). A handler may change settings that alter how PostgreSQL reads a string literal
(`standard_conforming_strings`) or which bytes a message means (`client_encoding`): neither may
turn a client's key or a tenant into SQL, or one tenant into another.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, get_context
from idem_middleware.store.postgres import _literal
from tests.apps import BearerBackend, QueryLog, build_app, client, count, key, logged_pool, records

# The key of the report: with standard_conforming_strings off, `\'` ends the inlined literal and
# the rest of the key became two statements committed with the record.
INJECTION = (
    "\\',$$$$::bytea,1,1,$$succeeded$$,200,NULL,NULL,NULL);"
    "UPDATE test_accounts SET balance=1000000;"
    "INSERT INTO test_accounts VALUES($$tenant-b$$,$$pwned$$,999);--"
)
# Its lease-mode twin ran a function inside the fenced settlement.
LEASE_INJECTION = "\\' || pg_sleep(0)::text || (SELECT 1/0)::text || '"


def sf_string(value: str) -> str:
    """`value` as an Idempotency-Key header (an RFC 8941 sf-string)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


async def legacy_credit(request: Request) -> Response:
    """A handler from legacy code that relies on backslash escapes in its own SQL."""
    ctx = get_context(request)
    conn = ctx.connection if ctx.mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()
    await conn.execute("SET LOCAL standard_conforming_strings = off")
    await conn.execute(
        "INSERT INTO test_accounts (tenant, account_id, balance) VALUES ($1, 'legacy', 5)",
        ctx.tenant,
    )
    return JSONResponse({"ok": True}, status_code=201)


def legacy_app(store: PostgresStore, mode: Mode) -> Starlette:
    return Starlette(
        routes=[Route("/legacy", legacy_credit, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=BearerBackend()),
            Middleware(IdempotencyMiddleware, store=store, default_policy=Policy(mode=mode)),
        ],
    )


@pytest.fixture
async def logged(db_dsn: str) -> Any:
    log = QueryLog()
    async with logged_pool(db_dsn, log) as pool:
        yield pool, log


@pytest.mark.parametrize(
    ("mode", "idem_key"),
    [(Mode.TRANSACTIONAL, INJECTION), (Mode.LEASE, LEASE_INJECTION), (Mode.LEASE, INJECTION)],
)
async def test_a_handler_turning_standard_conforming_strings_off_injects_nothing(
    logged: Any, mode: Mode, idem_key: str
) -> None:
    pool, log = logged
    app = legacy_app(PostgresStore(pool=pool, listen=False), mode)
    async with client(app) as c:
        first = await c.post("/legacy", json={}, headers=key(sf_string(idem_key)))
        again = await c.post("/legacy", json={}, headers=key(sf_string(idem_key)))
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    # The completion went the fast way, after the handler's SET LOCAL, and injected nothing.
    assert any(q.endswith("; COMMIT") for q in log.queries)
    accounts = await pool.fetch("SELECT tenant, account_id, balance FROM test_accounts")
    assert [tuple(r) for r in accounts] == [("tenant-a", "legacy", 5)]
    [rec] = await records(pool)
    assert (rec["tenant"], rec["idem_key"], rec["state"]) == ("tenant-a", idem_key, "succeeded")


async def test_no_client_text_reaches_a_fast_message_outside_hex(logged: Any) -> None:
    """Every quoted literal in every fast message is lower-case hex, and nothing of the key or
    the tenant is spelled out anywhere in the message."""
    pool, log = logged
    tenant = "t'e\\n$$a;nt"
    app = build_app(PostgresStore(pool=pool), tenant_resolver=lambda scope: tenant)
    idem_key = "k'\\ey; -- $1"
    async with client(app) as c:
        r = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=key(sf_string(idem_key)))
    assert r.status_code == 201, r.text
    fast = [q for q in log.queries if "EXECUTE idem_" in q]
    assert len(fast) == 2  # the claim and the completion
    for message in fast:
        assert tenant not in message and idem_key not in message
        without_statements = message.split("EXECUTE", 1)[1]
        for literal in re.findall(r"'[^']*'", without_statements):
            assert re.fullmatch(r"'([0-9a-f]*|hex|UTF8)'", literal), (literal, message)
    [rec] = await records(pool)
    assert (rec["tenant"], rec["idem_key"]) == (tenant, idem_key)


def test_literals_of_text_and_bytes_are_hex_whatever_the_value() -> None:
    for value in ("o'brien", "a\\b", "\\x41", "José", "東京", "$$", ""):
        literal = _literal(value)
        assert re.fullmatch(r"convert_from\(decode\('[0-9a-f]*', 'hex'\), 'UTF8'\)", literal)
    assert re.fullmatch(r"decode\('[0-9a-f]*', 'hex'\)", _literal(b"\x00'\\\xff"))
    assert _literal(-7) == "(-7)"  # never glued to a preceding `-` into a comment
    assert _literal(-1.5) == "(-1.5)"


async def test_hex_literals_mean_the_same_under_any_setting(pool: Any) -> None:
    texts = ["o'brien", "a\\b", "\\x41", "José", "東京", ""]
    data = b"\x00'\\\xff"
    async with pool.acquire() as conn:
        for scs in ("on", "off"):
            for encoding in ("UTF8", "LATIN1", "SJIS"):
                async with conn.transaction():
                    await conn.execute(f"SET LOCAL standard_conforming_strings = {scs}")
                    await conn.execute(f"SET LOCAL client_encoding = '{encoding}'")
                    # Compared as UTF-8 hex on the server: no client-side decoding plays a part.
                    for text in texts:
                        got = await conn.fetchval(
                            f"SELECT encode(convert_to({_literal(text)}, 'UTF8'), 'hex')"
                        )
                        assert got == text.encode().hex(), (scs, encoding, text)
                    got = await conn.fetchval(f"SELECT encode({_literal(data)}, 'hex')")
                    assert got == data.hex()
                    assert await conn.fetchval(f"SELECT {_literal(-7)} = -7 AND 1-{_literal(-7)} = 8")
                    assert await conn.fetchval(f"SELECT {_literal(-1.5)}::float8 = -1.5::float8")


async def test_a_key_that_reads_as_a_literal_escape_under_legacy_settings(logged: Any) -> None:
    """A response body and a key whose backslash-escape reading differs are stored exactly."""
    pool, _ = logged
    app = legacy_app(PostgresStore(pool=pool), Mode.TRANSACTIONAL)
    async with client(app) as c:
        r = await c.post("/legacy", json={}, headers=key(sf_string("\\x41\\\\")))
    assert r.status_code == 201, r.text
    [rec] = await records(pool)
    assert rec["idem_key"] == "\\x41\\\\"
    assert rec["response_body"] == b'{"ok":true}'
    assert await count(pool, "test_accounts") == 1


