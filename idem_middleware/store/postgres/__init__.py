"""The PostgreSQL store (asyncpg).

- store.py: `PostgresStore`, its lifecycle and the operations that commit on their own
- sessions.py: the transaction and fenced sessions it hands out
- claim.py: the ordinary claim
- fused.py: the fast path (PREPARE, generations drawn ahead, the PgBouncer fallback)
- literals.py: the fast path's literals, where a client's bytes meet SQL
- compat.py: everything that touches asyncpg's private attributes
- listener.py: the LISTEN connection
- edges.py: the statements of tokens.py and outbox.py
- convert.py, runner.py: rows, arguments and errors; the store's own connections
"""

from ...errors import NotFusable as _NotFusable
from .claim import claim as _claim
from .convert import _Q
from .fused import FUSE_MAX_BODY
from .fused import NAMES as _NAMES
from .fused import fusable as _fusable
from .literals import _inline, _literal
from .rows import (
    NOTIFY_CHANNEL,
    decode_headers,
    encode_headers,
    notify_token,
)
from .store import PostgresStore

__all__ = [
    "FUSE_MAX_BODY",
    "NOTIFY_CHANNEL",
    "_NAMES",
    "_Q",
    "PostgresStore",
    "_NotFusable",
    "_claim",
    "_fusable",
    "_inline",
    "_literal",
    "decode_headers",
    "encode_headers",
    "notify_token",
]
