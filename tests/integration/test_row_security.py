"""Row-level security on the store's tables, and a claim the database refuses.

Found by probing: a DBA's blanket tenant policy on `idem_requests` (`USING (tenant =
current_setting('app.tenant', true))`) opened a store without complaint. A claim then could not
see the records it must find: a key committed under the handler's setting was never replayed
(`409` at each retry, its handler run and rolled back each time), lease claims and the ordinary
path failed with the server's bare 500, and a policy on `idem_lock_secret` made `open` say
"run migrate" to a migrated database. The store's open now refuses row-level security that
applies to its role, naming the fix. And a claim the database refuses for good (a privilege
revoked after the store opened) is `500 server-misconfigured` as a problem document, in every
mode, instead of the server's bare 500.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from idem_middleware import Mode, Policy, PostgresStore
from idem_middleware.errors import ConfigurationError
from tests.apps import BOUND, assert_problem, build_app, client, key
from tests.integration.test_store_access import (
    APP_GRANTS,
    Setup,
    _owner_runs,
    role_database,  # noqa: F401 - the fixture, used by name
)

CREDIT = "/accounts/a/credits"
TENANT_POLICY = (
    "ALTER TABLE {table} ENABLE ROW LEVEL SECURITY;"
    "CREATE POLICY by_tenant ON {table} USING (tenant = current_setting('app.tenant', true))"
)
#: For a table without a tenant column: the rows of sessions that set `app.tenant`.
SESSION_POLICY = (
    "ALTER TABLE {table} ENABLE ROW LEVEL SECURITY;"
    "CREATE POLICY by_session ON {table} USING (current_setting('app.tenant', true) <> '')"
)


@pytest.mark.parametrize(
    ("table", "policy"),
    [
        ("idem_requests", TENANT_POLICY),
        ("idem_tokens", TENANT_POLICY),
        ("idem_waiters", SESSION_POLICY),
        ("idem_lock_secret", SESSION_POLICY),
    ],
)
async def test_row_level_security_over_the_stores_tables_fails_the_open_naming_the_fix(
    role_database: Setup,  # noqa: F811 - the fixture
    table: str,
    policy: str,
) -> None:
    dsn, role = await role_database(APP_GRANTS, policy.format(table=table))
    with pytest.raises(ConfigurationError) as refused:
        await PostgresStore(dsn=dsn, listen=False).open()
    message = str(refused.value)
    assert f"row-level security is active on public.{table} for the role {role}" in message
    assert f"ALTER ROLE {role} BYPASSRLS" in message
    # The fix it names is enough: keys are replayed again.
    await _owner_runs(dsn, f"ALTER ROLE {role} BYPASSRLS")
    async with PostgresStore(dsn=dsn, listen=False) as store, client(build_app(store)) as c:
        first = await c.post(CREDIT, json={"amount": 1}, headers=key("k"))
        again = await c.post(CREDIT, json={"amount": 1}, headers=key("k"))
    assert first.status_code == 201, first.text
    assert again.headers.get("idempotent-replayed") == "true"


async def test_a_policy_that_does_not_apply_to_the_stores_role_is_no_refusal(
    role_database: Setup,  # noqa: F811 - the fixture
) -> None:
    """A role exempt from the policies (BYPASSRLS) opens as before: only row-level security in
    force for the store's own role is refused."""
    dsn, _ = await role_database(
        APP_GRANTS, TENANT_POLICY.format(table="idem_requests"), "ALTER ROLE {role} BYPASSRLS"
    )
    async with PostgresStore(dsn=dsn, listen=False) as store:
        assert store.is_open


#: Each way a claim is made: transactional on the fast path and the ordinary one, and lease mode.
EVERY_CLAIM_PATH = pytest.mark.parametrize(
    ("mode", "fast_path"),
    [(Mode.TRANSACTIONAL, True), (Mode.TRANSACTIONAL, False), (Mode.LEASE, True)],
    ids=["transactional-fast", "transactional-ordinary", "lease"],
)
#: An audit trigger on the store's table that fails with a data exception (22003).
FAILING_TRIGGER = (
    "CREATE FUNCTION audit_overflow() RETURNS trigger LANGUAGE plpgsql AS"
    " $f$ BEGIN RAISE EXCEPTION 'audit overflow' USING ERRCODE = '22003'; END $f$;"
    "CREATE TRIGGER audit BEFORE INSERT ON idem_requests"
    " FOR EACH ROW EXECUTE FUNCTION audit_overflow()"
)


@EVERY_CLAIM_PATH
async def test_a_trigger_failing_with_a_data_exception_is_no_503_to_retry(
    role_database: Setup,  # noqa: F811 - the fixture
    mode: Mode,
    fast_path: bool,
) -> None:
    """A data exception (SQLSTATE class 22) from a trigger on the store's table fails every
    request alike: `500 server-misconfigured`, never a 503 asking the client to retry (found by
    review: translated with the connection errors, it was one)."""
    dsn, _ = await role_database(APP_GRANTS, FAILING_TRIGGER)
    async with PostgresStore(dsn=dsn, listen=False, fast_path=fast_path) as store:
        app = build_app(store, default_policy=Policy(mode=mode))
        async with client(app) as c:
            refused = await c.post(CREDIT, json={"amount": 1}, headers=key("k"))
    assert_problem(refused, 500, "server-misconfigured")


@EVERY_CLAIM_PATH
async def test_a_claim_the_database_refuses_for_good_is_a_problem_document(
    role_database: Setup,  # noqa: F811 - the fixture
    mode: Mode,
    fast_path: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dsn, role = await role_database(APP_GRANTS)
    policy = Policy(mode=mode)
    async with PostgresStore(dsn=dsn, listen=False, fast_path=fast_path) as store:
        app = build_app(store, default_policy=policy)
        async with client(app) as c:
            await _owner_runs(dsn, f"REVOKE ALL ON idem_requests FROM {role}")
            with caplog.at_level(logging.ERROR, logger="idem_middleware"):
                refused = await c.post(CREDIT, json={"amount": 1}, headers=key("k"))
            assert app.state.probe.calls == 0
            await _owner_runs(
                dsn, f"GRANT SELECT, INSERT, UPDATE, DELETE ON idem_requests TO {role}"
            )
            # Nothing was claimed: the same key runs once the grant is back.
            ran = await c.post(CREDIT, json={"amount": 1}, headers=key("k"))
    problem = assert_problem(refused, 500, "server-misconfigured")
    assert "refused its claim" in problem["detail"]
    assert "refused the claim" in caplog.text
    assert "InsufficientPrivilegeError" in caplog.text
    assert ran.status_code == 201, ran.text
    assert app.state.probe.calls == 1


async def test_a_publisher_whose_role_cannot_see_the_whole_outbox_is_refused_not_idle(
    role_database: Setup,  # noqa: F811 - the fixture
) -> None:
    """Found by probing: with a tenant policy on `idem_outbox`, handlers added their events (in
    their tenant's setting) and every publisher saw none: nothing sent, nothing logged. Its
    first batch now says so (ConfigurationError), and `run` ends with it rather than retrying."""
    import asyncpg

    from idem_middleware.outbox import OutboxEvent, Publisher, add

    dsn, role = await role_database(APP_GRANTS, TENANT_POLICY.format(table="idem_outbox"))
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("SELECT set_config('app.tenant', 'tenant-a', true)")
            await add(conn, "t", {"n": 1}, event_id="e1", tenant="tenant-a")
    finally:
        await conn.close()
    sent: list[str] = []

    async def sender(event: OutboxEvent) -> bool:
        sent.append(event.event_id)
        return True

    async with PostgresStore(dsn=dsn, listen=False) as store:
        publisher = Publisher(store, sender)
        with pytest.raises(ConfigurationError, match="row-level security is active on idem_outbox"):
            await publisher.publish_batch()
        with pytest.raises(ConfigurationError, match=f"ALTER ROLE {role} BYPASSRLS"):
            await asyncio.wait_for(publisher.run(idle_seconds=0.01), BOUND)
    await _owner_runs(dsn, f"ALTER ROLE {role} BYPASSRLS")
    async with PostgresStore(dsn=dsn, listen=False) as store:
        report = await Publisher(store, sender).publish_batch()
    assert (report.sent, sent) == (1, ["e1"])
