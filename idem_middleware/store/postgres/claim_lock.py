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

import struct
from typing import Any

from ...errors import StoreError
from ...hashing import sha256
from ..base import RecordKey
from .convert import _Q

#: A part's length, 4 bytes big-endian.
_LENGTH = struct.Struct(">I").pack


class ClaimLocks:
    """The secret's two SHA-256 states, read from the database once (`load`)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self) -> None:
        self._inner: Any = None
        self._outer: Any = None

    @property
    def loaded(self) -> bool:
        return self._outer is not None

    async def load(self, conn: Any) -> None:
        """Read the secret (once per store: it never changes after the migration made it)."""
        row = await conn.fetchrow(_Q["lock_secret"])
        if row is None:
            raise StoreError("idem_lock_secret has no row: run `idem-middleware migrate`")
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
