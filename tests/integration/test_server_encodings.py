"""Databases in another server encoding than UTF-8: what the store refuses, and how.

A tenant, operation or key is text: PostgreSQL converts it to the database's encoding. Where
that conversion maps two characters to one (EUC_JP writes U+00A6 and U+FFE4 alike), two tenants
would share records, so the store refuses to open on such a database. Where the encoding has no
bytes for a character (an emoji in a LATIN1 database), the claim is refused: the client gets
`500 server-misconfigured` as a problem document, and nothing runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware import ConfigurationError, PostgresStore
from tests.apps import assert_problem, build_app, client, key
from tests.conftest import migrated_database


def header_tenant(scope: Any) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-tenant":
            return value.decode()  # type: ignore[no-any-return]
    return None


async def _database(admin_dsn: str, name: str, encoding: str) -> str:
    options = f"ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    return await migrated_database(admin_dsn, name, options)


@pytest.fixture
async def latin1_dsn(admin_dsn: str) -> str:
    return await _database(admin_dsn, "idem_latin1", "LATIN1")


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_tenant_the_database_cannot_store_is_a_problem_document_and_runs_nothing(
    latin1_dsn: str, fast_path: bool
) -> None:
    store = PostgresStore(dsn=latin1_dsn, fast_path=fast_path)
    await store.open()
    try:
        app = build_app(store, tenant_resolver=header_tenant)
        async with client(app) as c:
            headers = {**key("k"), "x-tenant": "caf\u00e9 \U0001f600".encode()}
            refused = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=headers)
            latin = {**key("k"), "x-tenant": "caf\u00e9".encode()}
            served = await c.post("/accounts/a1/credits", json={"amount": 5}, headers=latin)
        assert_problem(refused, 500, "server-misconfigured")
        assert "encoding" in refused.json()["detail"]
        assert served.status_code == 201  # a tenant LATIN1 can carry is served as ever
        assert app.state.probe.calls == 1
    finally:
        await store.close()


async def test_a_database_whose_encoding_merges_characters_is_refused_at_open(
    admin_dsn: str,
) -> None:
    dsn = await _database(admin_dsn, "idem_euc_jp", "EUC_JP")
    store = PostgresStore(dsn=dsn)
    with pytest.raises(ConfigurationError, match="EUC_JP") as refused:
        await store.open()
    assert "UTF8" in str(refused.value)
