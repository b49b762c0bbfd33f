"""What reaches SQL text, and what keeps tenants apart, whatever the session's settings.

The fast path writes values into the text of a simple-query message (store/postgres/fused.py
`_literal`). A handler may change settings that alter how PostgreSQL reads a string literal
(`standard_conforming_strings`) or which bytes a message means (`client_encoding`): neither may
turn a client's key or a tenant into SQL, or one tenant into another.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import re
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, PostgresStore, get_context
from idem_middleware.status import status_route
from idem_middleware.store.postgres import _literal
from tests.apps import (
    QueryLog,
    assert_problem,
    build_app,
    client,
    count,
    key,
    logged_pool,
    one_route_app,
    records,
)

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
    return one_route_app("/legacy", legacy_credit, store=store, default_policy=Policy(mode=mode))


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


# A dollar-quoted literal as the fast path writes it: its text cannot hold a `$`.
DOLLAR_QUOTED = re.compile(r"\$v\$[^$]*\$v\$")


@pytest.mark.parametrize(
    ("tenant", "idem_key"),
    [("t'e\\n$$a;nt", "k'\\ey; -- $1"), ("t'e\\n;a -- nt", "k'\\ey; /* x")],
    ids=["with-a-dollar", "without"],
)
async def test_client_text_reaches_a_fast_message_only_inside_a_literal_it_cannot_end(
    logged: Any, tenant: str, idem_key: str
) -> None:
    """Outside the dollar-quoted literals (which hold no `$`), every quoted literal in every
    fast message is lower-case hex, and nothing of the key or the tenant is spelled out."""
    pool, log = logged
    app = build_app(PostgresStore(pool=pool), tenant_resolver=lambda scope: tenant)
    async with client(app) as c:
        r = await c.post(
            "/accounts/a1/credits", json={"amount": 5}, headers=key(sf_string(idem_key))
        )
    assert r.status_code == 201, r.text
    fast = [q for q in log.queries if "EXECUTE idem_" in q]
    assert len(fast) == 2  # the claim and the completion
    for message in fast:
        rest = DOLLAR_QUOTED.sub("", message.split("EXECUTE", 1)[1])
        assert tenant not in rest
        assert idem_key not in rest
        assert "$" not in rest
        for literal in re.findall(r"'[^']*'", rest):
            assert re.fullmatch(r"'([0-9a-f]*|hex|UTF8)'", literal), (literal, message)
        if "$" not in tenant:
            assert f"$v${tenant}$v$" in message
    [rec] = await records(pool)
    assert (rec["tenant"], rec["idem_key"]) == (tenant, idem_key)


TEXTS = ["o'brien", "a\\b", "\\x41", "José", "東京", "", "$$", "a$v", "$v$x", "end$", "--", "/*"]


def test_text_is_dollar_quoted_without_a_dollar_inside_or_else_hex() -> None:
    for value in TEXTS:
        literal = _literal(value)
        if "$" in value:
            assert re.fullmatch(r"convert_from\(decode\('[0-9a-f]*', 'hex'\), 'UTF8'\)", literal)
        else:
            assert literal == f"$v${value}$v$::text"
        assert re.fullmatch(
            r"convert_from\(decode\('[0-9a-f]*', 'hex'\), 'UTF8'\)", _literal(value, False)
        )
    assert re.fullmatch(r"\$v\$\\x[0-9a-f]*\$v\$::bytea", _literal(b"\x00'\\\xff$v$"))
    assert re.fullmatch(r"decode\('[0-9a-f]*', 'hex'\)", _literal(b"\x00'\\\xff", False))
    assert _literal(-7) == "(-7)"  # never glued to a preceding `-` into a comment
    assert _literal(-1.5) == "(-1.5)"


async def test_literals_mean_the_same_under_any_setting(pool: Any) -> None:
    """Under UTF-8 (the only client encoding the fast path writes dollar quotes in), with
    backslash escapes on or off; in other encodings, the hex forms."""
    data = b"\x00'\\\xff$v$"
    async with pool.acquire() as conn:
        for scs in ("on", "off"):
            for encoding in ("UTF8", "LATIN1", "SJIS"):
                utf8 = encoding == "UTF8"
                async with conn.transaction():
                    await conn.execute(f"SET LOCAL standard_conforming_strings = {scs}")
                    await conn.execute(f"SET LOCAL client_encoding = '{encoding}'")
                    # Compared as UTF-8 hex on the server: no client-side decoding plays a part.
                    for text in TEXTS:
                        got = await conn.fetchval(
                            f"SELECT encode(convert_to({_literal(text, utf8)}, 'UTF8'), 'hex')"
                        )
                        assert got == text.encode().hex(), (scs, encoding, text)
                    got = await conn.fetchval(f"SELECT encode({_literal(data, utf8)}, 'hex')")
                    assert got == data.hex()
                    assert await conn.fetchval(
                        f"SELECT {_literal(-7)} = -7 AND 1-{_literal(-7)} = 8"
                    )
                    assert await conn.fetchval(f"SELECT {_literal(-1.5)}::float8 = -1.5::float8")


#: The characters that matter to a quoted or dollar-quoted literal, and some that do not.
TRICKY = ["$", "v", "$v", "$v$", "'", "\\", ";", "-", "/", "*", "E", "x", "é", "東", "🙂", "\n"]


async def test_any_text_reads_back_the_same_from_its_literal(pool: Any) -> None:
    """2,000 texts built from the characters that could end or bend a literal, read back through
    their literals under both `standard_conforming_strings` settings."""
    rng = random.Random(7)
    texts = ["".join(rng.choices(TRICKY, k=rng.randint(0, 12))) for _ in range(2000)]
    assert any("$" not in t for t in texts)
    assert any("$v" in t for t in texts)
    array = "ARRAY[" + ", ".join(_literal(t) for t in texts) + "]::text[]"
    async with pool.acquire() as conn:
        for scs in ("on", "off"):
            async with conn.transaction():
                await conn.execute(f"SET LOCAL standard_conforming_strings = {scs}")
                got = await conn.fetchval(f"SELECT {array}")
            assert got == texts, scs


async def latin1_credit(request: Request) -> Response:
    """A handler that switches its connection to LATIN1 before the completion is written."""
    ctx = get_context(request)
    await ctx.connection.execute("SET LOCAL client_encoding = 'LATIN1'")
    await ctx.connection.execute(
        "INSERT INTO test_accounts (tenant, account_id, balance) VALUES ('t', 'latin1', 5)"
    )
    return JSONResponse({"city": "Zürich"}, status_code=201)


async def test_a_completion_after_the_handler_left_utf8_is_written_in_hex(logged: Any) -> None:
    """The tenant `東京` has no LATIN1 bytes: written dollar-quoted in the handler's encoding
    the completion would fail; in hex it is stored exactly, and replayed."""
    pool, log = logged
    app = one_route_app(
        "/latin1", latin1_credit, store=PostgresStore(pool=pool), tenant_resolver=lambda s: "東京"
    )
    async with client(app) as c:
        first = await c.post("/latin1", json={}, headers={**key("k-latin1")})
        again = await c.post("/latin1", json={}, headers={**key("k-latin1")})
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == {"city": "Zürich"}
    completion = [q for q in log.queries if "EXECUTE idem_insert_final" in q]
    [message] = completion
    assert "$v$" not in message
    [rec] = await records(pool)
    assert (rec["tenant"], rec["state"]) == ("東京", "succeeded")


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


# -- client encodings (the report: a LATIN1 pool stored tenant `José` as `JosÃ©`) ----------------


def header_tenant(scope: Any) -> str:
    """The tenant from an `x-tenant` header (UTF-8), standing for an authentication backend."""
    return dict(scope["headers"]).get(b"x-tenant", b"").decode()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
@pytest.mark.parametrize(
    "tenants", [("José", "JosÃ©"), ("JosÃ©", "José")], ids=["utf8", "mojibake"]
)
async def test_a_latin1_client_encoding_keeps_non_ascii_tenants_apart(
    db_dsn: str, fast_path: bool, tenants: tuple[str, str]
) -> None:
    log = QueryLog()
    latin1 = {"server_settings": {"client_encoding": "LATIN1"}}
    async with logged_pool(db_dsn, log, **latin1) as pool:
        store = PostgresStore(pool=pool, fast_path=fast_path)
        app = build_app(store, tenant_resolver=header_tenant)
        probe = app.state.probe
        answers = []
        async with client(app) as c:
            for tenant in (*tenants, *tenants):
                headers = {**key("same-key"), "x-tenant": tenant.encode()}
                answers.append(
                    await c.post("/accounts/a1/credits", json={"amount": 5}, headers=headers)
                )
        assert [r.status_code for r in answers] == [201] * 4, [r.text for r in answers]
        # Each tenant's first request ran; each retry replayed its own tenant's response.
        assert [r.headers.get("idempotent-replayed") for r in answers] == [
            None,
            None,
            "true",
            "true",
        ]
        assert probe.calls == 2
        assert answers[2].content == answers[0].content
        assert answers[3].content == answers[1].content
    utf8 = await asyncpg.connect(db_dsn)  # read back without the pool's encoding
    try:
        stored = await utf8.fetch("SELECT tenant FROM idem_requests ORDER BY tenant")
        ledger = await utf8.fetch("SELECT tenant FROM test_ledger ORDER BY tenant")
    finally:
        await utf8.close()
    assert [r["tenant"] for r in stored] == sorted(tenants)
    assert [r["tenant"] for r in ledger] == sorted(tenants)


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_tenant_the_client_encoding_cannot_carry_is_refused_before_the_handler(
    db_dsn: str, mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    """Under LATIN1, `東京` cannot be sent as a parameter: the claim fails before anything runs
    (the fast path is not used on such a pool, so no claim is made that a lookup cannot find).
    Found by probing: asyncpg's DataError escaped the middleware, the server's bare 500 with the
    tenant in its text; it is `500 server-misconfigured`, as a tenant the database's encoding
    cannot store, and its log line does not quote the value."""
    log = QueryLog()
    latin1 = {"server_settings": {"client_encoding": "LATIN1"}}
    async with logged_pool(db_dsn, log, **latin1) as pool:
        policy = Policy(mode=mode)
        app = build_app(
            PostgresStore(pool=pool), tenant_resolver=header_tenant, default_policy=policy
        )
        async with client(app) as c:
            headers = {**key("raw-key-1"), "x-tenant": "東京".encode()}
            r = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=headers)
        assert_problem(r, 500, "server-misconfigured")  # as for a tenant with a NUL
        assert app.state.probe.calls == 0
        assert "client_encoding" in caplog.text
        assert "東京" not in caplog.text
        assert "raw-key-1" not in caplog.text
        assert not any("EXECUTE idem_" in q for q in log.queries)
        assert await count(pool, "idem_requests") == 0


async def test_the_status_of_a_tenant_the_client_encoding_cannot_carry_is_a_problem(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: the status resource's read met asyncpg's DataError as it was: the
    server's bare 500, the tenant in its text and in the log. It is `500
    server-misconfigured`, as the guarded route's answer, the value kept out of the log."""
    latin1 = {"server_settings": {"client_encoding": "LATIN1"}}
    async with logged_pool(db_dsn, QueryLog(), **latin1) as pool:
        app = Starlette(
            routes=[status_route(PostgresStore(pool=pool), tenant_resolver=header_tenant)]
        )
        async with client(app) as c:
            r = await c.get(
                "/idempotency/status",
                params={"operation": "POST /accounts/{account_id}/credits", "key": "raw-key-2"},
                headers={"x-tenant": "東京".encode()},
            )
    assert_problem(r, 500, "server-misconfigured")
    assert "東京" not in caplog.text
    assert "raw-key-2" not in caplog.text


# -- the claim lock (the report: a 32-bit unkeyed hash, a shared lock found in 50 s) -------------


def expected_lock(secret: bytes, *parts: str) -> int:
    message = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
    return int.from_bytes(
        hmac.new(secret, message, hashlib.sha256).digest()[:8], "big", signed=True
    )


async def test_the_claim_lock_is_a_keyed_64_bit_hash_of_the_length_prefixed_tuple(
    db_dsn: str,
) -> None:
    tuples = [
        ("tenant-a", "POST /pay", "k"),
        ("José", "POST /pay", "k"),
        ("", "POST /pay", "\\'; --"),
        ("a\x1fb", "c", "d"),  # the old encoding (chr(31) separators) made these two one lock
        ("a", "b\x1fc", "d"),
    ]
    for encoding in ("UTF8", "LATIN1"):  # the lock cannot depend on the client's encoding
        conn = await asyncpg.connect(db_dsn, server_settings={"client_encoding": encoding})
        try:
            inner = await conn.fetchval("SELECT inner_key FROM idem_lock_secret")
            secret = bytes(b ^ 0x36 for b in inner)
            locks = []
            for parts in tuples:
                lock = await conn.fetchval(
                    "SELECT idem_key_lock(convert_from(decode($1, 'hex'), 'UTF8'), $2, $3)",
                    parts[0].encode().hex(),
                    *parts[1:],
                )
                assert lock == expected_lock(secret, *parts), (encoding, parts)
                locks.append(lock)
        finally:
            await conn.close()
        assert len(set(locks)) == len(tuples)


async def test_a_claim_waits_on_the_keyed_lock(pool: Any) -> None:
    """`idem_claim_key` takes the one-bigint advisory lock `idem_key_lock` names."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.fetch("SELECT * FROM idem_claim_key('tenant-a', 'POST /pay', 'k')")
        held = await conn.fetch(
            "SELECT (classid::bigint << 32) | objid::bigint AS lock FROM pg_locks "
            "WHERE locktype = 'advisory' AND objsubid = 1 AND pid = pg_backend_pid()"
        )
        want = await conn.fetchval("SELECT idem_key_lock('tenant-a', 'POST /pay', 'k')")
    assert [r["lock"] for r in held] == [want]
