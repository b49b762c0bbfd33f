"""The key's claim lock, computed by the store as the database's `idem_key_lock` computes it.

A transactional claim takes a transaction-scoped advisory lock whose value is the first 64 bits
of HMAC-SHA256(the installation's secret, the tuple): each part's UTF-8 bytes after their 4-byte
big-endian length, tenant, operation, key. The secret lives in the one-row table
`idem_lock_secret` as HMAC's two padded keys. Computed in SQL, the function's query is parsed
and planned again in every transaction (about a fifth of the claim's server time); here it is
two SHA-256 states read once and copied per claim. Both give the same value bit for bit (tested
against the server), so a process of an older version, claiming through the SQL function, still
excludes this one.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

from ...errors import StoreError
from ...hashing import sha256
from ..base import RecordKey
from .convert import _Q

logger = logging.getLogger("idem_middleware.store")

#: A part's length, 4 bytes big-endian.
_LENGTH = struct.Struct(">I").pack


class ClaimLocks:
    """The secret's two SHA-256 states, read from the database once (`load`)."""

    __slots__ = ("_inner", "_outer", "readable")

    def __init__(self) -> None:
        self._inner: Any = None
        self._outer: Any = None
        #: Whether the store's role may read pg_catalog.pg_locks, where the status resource
        #: sees a claim lock held (hardened servers revoke it from PUBLIC): see `unreadable`.
        self.readable = True

    def unreadable(self, role: str) -> None:
        """The role may not read pg_locks: said once, and the status resource reads records
        alone from now on (a transactional request still running is not seen)."""
        if self.readable:
            self.readable = False
            logger.warning(
                "idempotency: the role %s may not read pg_catalog.pg_locks, so the status "
                "resource cannot see a transactional request that has not committed yet (it "
                "answers 404 until the commit, saying the request may still run); to see them, "
                "run as a superuser: GRANT SELECT ON pg_catalog.pg_locks TO %s",
                role,
                role,
            )

    @property
    def loaded(self) -> bool:
        return self._outer is not None

    async def load(self, conn: Any) -> None:
        """Read the secret (once per store: it never changes after the migration made it)."""
        row = await conn.fetchrow(_Q["lock_secret"])
        if row is None:
            raise StoreError(  # (migrate makes it once, with the table: it would not again)
                "idem_lock_secret has no row (deleted by hand, or left out of a restore?): "
                "insert one as the migration that made the table does (the INSERT INTO "
                "idem_lock_secret in idem_middleware/sql/migrations/0004_keyed_claim_lock.sql), "
                "then restart every process that uses the store (each keeps the secret it read)"
            )
        self._inner = sha256(row["inner_key"])
        self._outer = sha256(row["outer_key"])

    def of(self, key: RecordKey) -> int:
        """`idem_key_lock(key.tenant, key.operation, key.key)`, as a signed 64-bit integer."""
        # Each part's UTF-8 after its length, written out (a call per part cost more). The
        # `surrogatepass` never fails: a text PostgreSQL cannot hold fails at its statement.
        tenant = key.tenant.encode("utf-8", "surrogatepass")
        operation = key.operation.encode("utf-8", "surrogatepass")
        name = key.key.encode("utf-8", "surrogatepass")
        # (CPython's SHA-256, see hashing: the parts are short, a key at most MAX_KEY_LENGTH.)
        inner = self._inner.copy()
        inner.update(
            b"".join(
                (
                    _LENGTH(len(tenant)),
                    tenant,
                    _LENGTH(len(operation)),
                    operation,
                    _LENGTH(len(name)),
                    name,
                )
            )
        )
        outer = self._outer.copy()
        outer.update(inner.digest())
        return int.from_bytes(outer.digest()[:8], "big", signed=True)
