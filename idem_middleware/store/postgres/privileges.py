"""What the store's role must be allowed to do, checked when a store opens.

A role that cannot write `idem_requests`, draw from `idem_generation_seq`, call `idem_claim_key`
or take an advisory lock opened a store without complaint, then failed every guarded request
with a 500. So does a schema whose migrations are recorded but one of whose objects is gone
(dropped by hand, left out of a restore), and a server that takes no writes at all (a standby,
read-only sessions). Each is found here, once, and named with the fix.
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg

from ...errors import ConfigurationError
from .claim_lock import ClaimLocks
from .convert import _Q

logger = logging.getLogger("idem_middleware.store")

#: (kind, name as the store's statements name it, privilege): what a request may use, in
#: either mode. The claim names idem_tokens even for a key that is not a token; release
#: deletes a record; the fence locks one (UPDATE); a lease-mode wait registers in idem_waiters;
#: a settlement notifies waiters; a transactional claim takes an advisory lock.
NEEDED: tuple[tuple[str, str, str], ...] = (
    *(("table", "idem_requests", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    ("table", "idem_tokens", "SELECT"),
    ("table", "idem_tokens", "UPDATE"),
    ("table", "idem_lock_secret", "SELECT"),
    *(("table", "idem_waiters", p) for p in ("SELECT", "INSERT", "DELETE")),
    ("sequence", "idem_generation_seq", "USAGE"),
    ("function", "idem_claim_key(text, text, text, bigint)", "EXECUTE"),
    ("function", "pg_catalog.pg_try_advisory_xact_lock(bigint)", "EXECUTE"),
    ("function", "pg_catalog.pg_notify(text, text)", "EXECUTE"),
)

#: Read by the status resource alone, to see a transactional claim that has not committed
#: (its claim lock): a role without it is warned, and the status resource does without.
LOCKS = ("table", "pg_catalog.pg_locks", "SELECT")

_GRANT_ON = {"table": "", "sequence": "SEQUENCE ", "function": "FUNCTION "}


async def require_privileges(conn: Any, locks: ClaimLocks) -> None:
    """ConfigurationError, naming what is missing and the statements that fix it, unless the
    session's role holds every privilege in NEEDED on objects that are all there. Without
    LOCKS, a warning (`locks.unreadable`), in the same statement."""
    kinds, names, privileges = zip(*NEEDED, LOCKS, strict=True)
    found = await conn.fetch(_Q["privileges"], list(kinds), list(names), list(privileges))
    rows = [r for r in found if r["name"] != LOCKS[1]]
    if any(r["held"] is False for r in found if r["name"] == LOCKS[1]):
        locks.unreadable(found[0]["role"])
    absent = sorted({r["name"] for r in rows if r["object"] is None})
    if absent:
        raise ConfigurationError(
            f"the idempotency schema lacks {', '.join(absent)} although its migrations are "
            "recorded as applied (dropped by hand, or left out of a restore?): restore them "
            "(the numbered migrations in idem_middleware/sql/migrations create them), or check "
            "the store's search_path"
        )
    grants: dict[str, list[str]] = {}
    role = ""
    for r in rows:
        role = r["role"]
        if not r["held"]:
            grants.setdefault(_GRANT_ON[r["kind"]] + r["object"], []).append(r["privilege"])
    if grants:
        fix = "; ".join(f"GRANT {', '.join(p)} ON {on} TO {role}" for on, p in grants.items())
        raise ConfigurationError(
            f"the role {role} lacks privileges every guarded request needs: run, as the "
            f"objects' owner, {fix}"
        )
    # A policy (a DBA's blanket `USING (tenant = current_setting('app.tenant'))`, say) hides
    # records from the claims that must find them: a key committed under one setting was never
    # replayed (409 for ever, its handler run and rolled back at each retry), or the lock's
    # secret looked missing. The store must see every row of its tables.
    if filtered := sorted({r["object"] for r in rows if r["row_security"]}):
        tables = ", ".join(filtered)
        raise ConfigurationError(
            f"row-level security is active on {tables} for the role {role}: the idempotency "
            "store must see every tenant's records (it scopes them by tenant itself), or keys "
            f"are claimed again and never replayed. Exempt the role (ALTER ROLE {role} "
            "BYPASSRLS), or turn it off on those tables (ALTER TABLE ... DISABLE ROW LEVEL "
            "SECURITY)"
        )
    await require_key_arbiter(conn)


async def require_key_arbiter(conn: Any) -> None:
    """ConfigurationError when the claims' `ON CONFLICT (tenant, operation, idem_key)` cannot
    run on `idem_requests`: its primary key is gone (dropped by hand, left out of a restore),
    or a rule on the table refuses ON CONFLICT, or the key was made DEFERRABLE (by hand). The
    store opened, then every lease-mode claim failed (a 500), and every claim read the whole
    table for its key (deferrable: every claim but the transactional fast path's failed)."""
    try:
        await conn.fetch(_Q["key_arbiter"])
    except asyncpg.InvalidColumnReferenceError as exc:
        raise ConfigurationError(
            "idem_requests has no primary key (or unique index) on (tenant, operation, "
            f"idem_key) although its migrations are recorded as applied ({exc}; dropped by "
            "hand, or left out of a restore?): every lease-mode claim would fail. Restore it, "
            "as the table's owner: ALTER TABLE idem_requests ADD CONSTRAINT idem_requests_pkey "
            "PRIMARY KEY (tenant, operation, idem_key)"
        ) from exc
    except asyncpg.FeatureNotSupportedError as exc:
        raise ConfigurationError(
            f"the store's claims cannot insert into idem_requests ({exc}): drop the rule on "
            "the table (DROP RULE ... ON idem_requests); a trigger does what a rule would"
        ) from exc
    # EXPLAIN infers a DEFERRABLE key as the arbiter; only running the claim refuses it.
    if deferrable := await conn.fetch(_Q["key_deferrable"]):
        fix = "; ".join(
            f"ALTER TABLE idem_requests DROP CONSTRAINT {c['name']}, ADD CONSTRAINT "
            f"{c['name']} {c['definition']}"
            for c in deferrable
        )
        raise ConfigurationError(
            f"idem_requests' key on (tenant, operation, idem_key) is DEFERRABLE "
            f"({', '.join(c['name'] for c in deferrable)}): the store's claims use it with ON "
            "CONFLICT, which refuses a deferrable constraint, so every claim would fail with "
            f"a 500. Make it NOT DEFERRABLE, as the table's owner: {fix}"
        )


#: How many of the records that expire last `require_generations_ahead` reads.
_NEWEST = 1000


async def require_generations_ahead(conn: Any) -> None:
    """ConfigurationError when `idem_generation_seq` is behind the generations its records hold
    (`generations_ahead`): it would hand them out again, a takeover's generation equal to a
    late executor's (fencing, which compares them for equality, let both commit) and a key
    reused after its retention given an old epoch (the same downstream key: the other system
    took the new request for the old one). The records read are those fencing compares with
    (pending and unknown) and the 1,000 that expire last: a bounded read, which may miss newer
    records of a shorter retention than those (docs/failure-windows.md)."""
    row = await conn.fetchrow(_Q["generations_ahead"], _NEWEST)
    held = row["held"]
    if held is not None and row["drawn"] <= held:
        raise ConfigurationError(
            f"idem_generation_seq is behind the records' generations (it drew {row['drawn']}; a "
            f"record holds {held}): set back by hand, or not carried over by a failover or a "
            "restore, it would hand generations out again, and fencing fails with them. Run, "
            "as its owner, SELECT setval('idem_generation_seq', (SELECT max(generation) FROM "
            "idem_requests))"
        )


#: Server encodings into which PostgreSQL converts two Unicode characters alike (found by
#: converting every code point to each encoding the server offers), and which.
_MERGING_ENCODINGS = {"EUC_JP": "U+00A6 and U+FFE4"}


async def require_writable(conn: Any) -> float:
    """ConfigurationError on a server that takes no writes: a standby, or sessions that default
    to read-only (`ALTER ROLE ... SET default_transaction_read_only = on`), where every guarded
    request would fail when it records its outcome; or on a database whose encoding stores two
    characters alike (`_MERGING_ENCODINGS`). Logs a `transaction_timeout`. Returns the sessions'
    `idle_in_transaction_session_timeout` in seconds (0: none), logged: a transactional handler
    idle in its transaction longer than that loses its connection."""
    row = await conn.fetchrow(_Q["writable"])
    if row["standby"]:
        raise ConfigurationError(
            "the idempotency store's database is a standby (in recovery): it takes no writes; "
            "give the store the primary's address"
        )
    if row["read_only"]:
        raise ConfigurationError(
            "the idempotency store's sessions are read-only (default_transaction_read_only is "
            "on for this role or database): the store writes every request's record; turn it "
            "off for the store's role, or pass connect_kwargs={'server_settings': "
            "{'default_transaction_read_only': 'off'}}"
        )
    if (merged := _MERGING_ENCODINGS.get(row["server_encoding"])) is not None:
        raise ConfigurationError(
            f"the idempotency store's database is encoded {row['server_encoding']}, which "
            f"stores two characters alike ({merged}): two tenants or keys differing only there "
            "would share records. Put the store's table in a UTF8 database"
        )
    if transaction := float(row["transaction_ms"] or 0) / 1000:
        logger.info(
            "transaction_timeout is %g s for the idempotency store's sessions: a transactional "
            "request whose handler runs longer loses its connection, and is answered 503 with "
            "nothing committed",
            transaction,
        )
    idle = float(row["idle_ms"] or 0) / 1000
    if idle:
        logger.info(
            "idle_in_transaction_session_timeout is %g s for the idempotency store's sessions: "
            "a transactional handler that waits longer than that between two statements (an "
            "HTTP call, say) loses its connection, and its request is answered 503 with nothing "
            "committed",
            idle,
        )
    return idle


async def require_outbox_visible(conn: Any) -> None:
    """ConfigurationError when a row-level security policy filters the outbox for this role: a
    blanket tenant policy (`USING (tenant = current_setting('app.tenant'))`) let handlers add
    their events and left every publisher seeing none, idle, the webhooks never sent."""
    row = await conn.fetchrow(_Q["outbox_row_security"])
    if row["filtered"]:
        raise ConfigurationError(
            f"row-level security is active on idem_outbox for the role {row['role']}: a "
            "publisher must see every tenant's events, or it sends none of those it cannot see. "
            f"Exempt the role (ALTER ROLE {row['role']} BYPASSRLS), or turn it off on the table "
            "(ALTER TABLE idem_outbox DISABLE ROW LEVEL SECURITY)"
        )
