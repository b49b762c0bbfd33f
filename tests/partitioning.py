"""`idem_requests` hash-partitioned on `tenant`, and which partitions a statement touches.

`partition_by_tenant` rebuilds the table the migrations made as a partitioned one, reading its
columns, constraints, indexes and triggers from the catalog (so a column or index a later
migration adds comes along), and checks that the rebuilt table describes the same as the old one.

`Touched` answers, for one statement and its arguments, which partitions of `idem_requests` it
reads or writes, two ways: the partitions its plan scans (a custom plan and a generic one, as
asyncpg's prepared statements get after five runs: pruned at executor start), and the partitions
whose counters move when it runs (in a transaction rolled back afterwards). The counters see
inside functions (`idem_claim_key`) and see where an INSERT's row was routed, which a plan does not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

TABLE = "idem_requests"
PARTITIONS = 4
_OLD = TABLE + "_unpartitioned"


async def describe(conn: Any, table: str = TABLE) -> dict[str, list[tuple[Any, ...]]]:
    """What must survive the rebuild: columns, constraints, indexes, triggers (by name)."""
    oid = await conn.fetchval("SELECT $1::regclass::oid", table)
    columns = await conn.fetch(
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull,"
        " pg_get_expr(d.adbin, d.adrelid), attidentity, attgenerated"
        " FROM pg_attribute a"
        " LEFT JOIN pg_attrdef d ON (d.adrelid, d.adnum) = (a.attrelid, a.attnum)"
        " WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        oid,
    )
    constraints = await conn.fetch(
        "SELECT conname, contype, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = $1 AND contype <> 'n' ORDER BY conname",
        oid,
    )
    indexes = await conn.fetch(
        "SELECT c.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i"
        " JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = $1 ORDER BY c.relname",
        oid,
    )
    triggers = await conn.fetch(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
        " WHERE tgrelid = $1 AND NOT tgisinternal ORDER BY tgname",
        oid,
    )
    # A partitioned table's index is defined "ON ONLY" the parent; the index is the same.
    return {
        "columns": [tuple(r) for r in columns],
        "constraints": [tuple(r) for r in constraints],
        "indexes": [(n, d.replace(" ON ONLY ", " ON ")) for n, d in indexes],
        "triggers": [tuple(r) for r in triggers],
    }


async def partition_by_tenant(conn: Any, partitions: int = PARTITIONS) -> None:
    """Rebuild `idem_requests` as `PARTITION BY HASH (tenant)` with `partitions` partitions."""
    before = await describe(conn)
    async with conn.transaction():
        oid = await conn.fetchval("SELECT $1::regclass::oid", TABLE)
        # Recreated by definition, under their own names, once the new table has the old name.
        keyed = await conn.fetch(
            "SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint"
            " WHERE conrelid = $1 AND contype IN ('p', 'u', 'x', 'f') ORDER BY conname",
            oid,
        )
        indexes = await conn.fetch(
            "SELECT pg_get_indexdef(i.indexrelid) AS def FROM pg_index i WHERE i.indrelid = $1"
            " AND NOT EXISTS (SELECT FROM pg_constraint c WHERE c.conindid = i.indexrelid)",
            oid,
        )
        triggers = await conn.fetch(
            "SELECT pg_get_triggerdef(oid) AS def FROM pg_trigger"
            " WHERE tgrelid = $1 AND NOT tgisinternal",
            oid,
        )
        owned = await conn.fetch(  # sequences OWNED BY a column would go with the old table
            "SELECT d.objid::regclass::text AS seq, a.attname FROM pg_depend d"
            " JOIN pg_attribute a ON (a.attrelid, a.attnum) = (d.refobjid, d.refobjsubid)"
            " WHERE d.refobjid = $1 AND d.classid = 'pg_class'::regclass AND d.deptype = 'a'"
            " AND (SELECT relkind FROM pg_class WHERE oid = d.objid) = 'S'",
            oid,
        )
        await conn.execute(f"ALTER TABLE {TABLE} RENAME TO {_OLD}")
        # LIKE brings columns, NOT NULLs, defaults, CHECKs (with their names), identity,
        # generated columns, storage, compression and comments; not keys, indexes or triggers.
        await conn.execute(
            f"CREATE TABLE {TABLE} (LIKE {_OLD} INCLUDING ALL EXCLUDING INDEXES)"
            " PARTITION BY HASH (tenant)"
        )
        for i in range(partitions):
            await conn.execute(
                f"CREATE TABLE {TABLE}_h{i} PARTITION OF {TABLE}"
                f" FOR VALUES WITH (MODULUS {partitions}, REMAINDER {i})"
            )
        await conn.execute(f"INSERT INTO {TABLE} SELECT * FROM {_OLD}")
        for row in owned:
            await conn.execute(f'ALTER SEQUENCE {row["seq"]} OWNED BY {TABLE}."{row["attname"]}"')
        await conn.execute(f"DROP TABLE {_OLD}")  # RESTRICT: a view on it would fail here
        for row in keyed:
            await conn.execute(
                f'ALTER TABLE {TABLE} ADD CONSTRAINT "{row["conname"]}" {row["def"]}'
            )
        for row in (*indexes, *triggers):
            await conn.execute(row["def"])
    after = await describe(conn)
    assert after == before, "the partitioned table differs from the one the migrations made"


async def partitions(conn: Any) -> list[str]:
    """The partitions' names, as `pg_stat_xact_user_tables.relname` spells them."""
    rows = await conn.fetch(
        "SELECT inhrelid::regclass::text AS name FROM pg_inherits"
        " WHERE inhparent = $1::regclass ORDER BY 1",
        TABLE,
    )
    return [r["name"] for r in rows]


async def partition_of(conn: Any, tenant: str) -> str:
    """The partition a tenant's rows go to (PostgreSQL's hash, not one computed here)."""
    for i in range(PARTITIONS):
        if await conn.fetchval(
            "SELECT satisfies_hash_partition($1::regclass, $2, $3, $4::text)",
            TABLE,
            PARTITIONS,
            i,
            tenant,
        ):
            return f"{TABLE}_h{i}"
    raise AssertionError(f"no partition takes tenant {tenant!r}")


# -- statements of a simple-query message ---------------------------------------------------------


def split_statements(message: str) -> list[str]:
    """The statements of a simple-query message, split at semicolons outside quoted literals
    (the store's messages hold no dollar quoting, comments or quoted identifiers with `;`)."""
    out, start, quoted = [], 0, False
    for i, ch in enumerate(message):
        if ch == "'":
            quoted = not quoted  # a doubled quote toggles twice
        elif ch == ";" and not quoted:
            out.append(message[start:i])
            start = i + 1
    out.append(message[start:])
    return [s.strip() for s in out if s.strip()]


_PREPARE = re.compile(r"PREPARE\s+(\w+)\s*\(([^)]*)\)\s+AS\s+(.*)", re.S | re.I)


@dataclass(frozen=True)
class Sent:
    """One statement the store sent: its text, its arguments (extended protocol) and, for an
    `EXECUTE name (...)` of a message, the prepared statement's text."""

    text: str
    args: tuple[Any, ...] = ()
    prepared: str | None = None

    @property
    def body(self) -> str:
        return self.prepared if self.prepared is not None else self.text


class SentLog:
    """asyncpg's query logger: every message with its arguments, split into statements."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, tuple[Any, ...]]] = []

    def __call__(self, record: Any) -> None:
        self.messages.append((record.query, tuple(record.args or ())))

    async def attach(self, conn: Any) -> None:
        conn.add_query_logger(self)

    def statements(self) -> Iterator[tuple[Sent, list[str]]]:
        """Each data statement, with the PREPAREs it needs run first (for an EXECUTE)."""
        prepared: dict[str, str] = {}
        for text, args in self.messages:
            if args:
                yield Sent(text, args), []
                continue
            for statement in split_statements(text):
                head = statement.split(None, 1)[0].upper()
                if head == "PREPARE":
                    match = _PREPARE.match(statement)
                    assert match is not None, statement
                    prepared[match.group(1)] = statement
                elif head == "EXECUTE":
                    name = statement.split()[1]
                    body = _PREPARE.match(prepared[name])
                    assert body is not None
                    yield Sent(statement, (), body.group(3)), [prepared[name]]
                elif head not in {"BEGIN", "COMMIT", "ROLLBACK", "SET", "RESET", "LISTEN"}:
                    yield Sent(statement), []


# -- which partitions a statement touches ----------------------------------------------------------


def _relations(plan: dict[str, Any]) -> Iterator[str]:
    if "Relation Name" in plan:
        yield plan["Relation Name"]
    for child in plan.get("Plans", ()):
        yield from _relations(child)


class Touched:
    """Runs EXPLAINs and counted executions on `conn` (a connection of its own, not logged)."""

    def __init__(self, conn: Any, names: Sequence[str]) -> None:
        self.conn = conn
        self.names = set(names)

    async def in_plans(self, sent: Sent, prepares: list[str]) -> dict[str, set[str]]:
        """The partitions each plan (custom, generic) of the statement scans."""
        out = {}
        for mode in ("force_custom_plan", "force_generic_plan"):
            async with self.conn.transaction():
                await self.conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
                for prepare in prepares:
                    await self.conn.execute(prepare)
                if sent.args:
                    # A prepared statement of our own, so the generic plan is the one planned.
                    # EXPLAIN EXECUTE takes no bind parameters: the values go in as literals,
                    # quoted by the server.
                    types = await self._prepare(sent)
                    literals = [
                        await self.conn.fetchval(f"SELECT quote_nullable($1::{t}) || '::{t}'", a)
                        for t, a in zip(types, sent.args, strict=True)
                    ]
                    explain = (
                        f"EXPLAIN (FORMAT JSON) EXECUTE idem_explained ({', '.join(literals)})"
                    )
                    plan = await self.conn.fetchval(explain)
                else:
                    plan = await self.conn.fetchval(f"EXPLAIN (FORMAT JSON) {sent.text}")
                await self._deallocate(prepares, "idem_explained" if sent.args else None)
            out[mode] = set(_relations(json.loads(plan)[0]["Plan"])) & self.names
        return out

    async def _prepare(self, sent: Sent) -> list[str]:
        statement = await self.conn.prepare(sent.text)
        types = [f"{t.schema}.{t.name}" for t in statement.get_parameters()]
        await self.conn.execute(f"PREPARE idem_explained ({', '.join(types)}) AS {sent.text}")
        return types

    async def by_counters(self, sent: Sent, prepares: list[str]) -> set[str]:
        """The partitions whose scan or write counters moved when the statement ran (rolled
        back afterwards; an error, a unique violation say, counts what ran until it)."""
        tx = self.conn.transaction()
        await tx.start()
        try:
            for prepare in prepares:
                await self.conn.execute(prepare)
            before = await self._counters()
            try:
                async with self.conn.transaction():  # a savepoint
                    await self.conn.execute("SET LOCAL lock_timeout = '2s'")
                    await self.conn.execute(sent.text, *sent.args)
            except Exception:
                pass
            after = await self._counters()
        finally:
            await tx.rollback()
            await self._deallocate(prepares)
        return {name for name, n in after.items() if n != before.get(name)}

    async def _deallocate(self, prepares: list[str], *more: str | None) -> None:
        # PREPARE is not transactional: a rollback keeps the statement, so it is dropped here.
        names = [m.group(1) for m in map(_PREPARE.match, prepares) if m is not None]
        for name in [*names, *(n for n in more if n is not None)]:
            await self.conn.execute(f"DEALLOCATE {name}")

    async def _counters(self) -> dict[str, int]:
        rows = await self.conn.fetch(
            "SELECT relname, coalesce(seq_scan, 0) + coalesce(idx_scan, 0) + n_tup_ins"
            " + n_tup_upd + n_tup_del AS n FROM pg_stat_xact_user_tables"
            " WHERE relid::regclass::text = ANY($1::text[])",
            sorted(self.names),
        )
        return {r["relname"]: r["n"] for r in rows}
