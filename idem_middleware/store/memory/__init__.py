"""An in-memory twin of the PostgreSQL store, for unit tests and for trying the middleware out.

It copies the database's semantics, not just its API: a claim is invisible to others until its
transaction commits, a concurrent claim on the same key (a transaction's or a lease claim) is
busy at once (`ClaimBusy`, as PostgreSQL's claim finds the key's advisory lock or its row held),
generations come from one counter and are never reused, and expiry is judged by the store's
clock. The same contract suite runs on both stores.
It holds nothing across processes and loses everything on exit: never use it in production.

- store.py: `MemoryStore`, its lifecycle and the operations that commit on their own (lease mode)
- sessions.py: the transaction and fenced sessions it hands out
- edges.py: tokens, and the operators' listing, amendments and purge
- tables.py: the rows and tokens it holds, and the row-level primitives the others build on
"""

from .sessions import _MemoryFenced, _MemoryTransaction
from .store import MemoryStore
from .tables import _Row, _summary, _Token

__all__ = [
    "MemoryStore",
    "_MemoryFenced",
    "_MemoryTransaction",
    "_Row",
    "_Token",
    "_summary",
]
