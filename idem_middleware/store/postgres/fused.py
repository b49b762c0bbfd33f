r"""The transactional fast path: one round trip for BEGIN + claim and for completion + COMMIT.

asyncpg sends parameterised statements one at a time (extended protocol), and its BEGIN and
COMMIT are statements of their own. On the transactional fast path the claim is therefore sent
with its BEGIN, and the completion with its COMMIT, each as one simple-query message with the
values inlined as literals: the business transaction then costs the same round trips as the
bare handler's. Everything else (and every case `fusable` refuses) takes the ordinary path.

The values are written as literals no value can end, whatever the session's settings (see
`literals.py`, the only module that writes them). This module is the only one that knows the
server-side PREPAREs, the generations drawn ahead and the fallback to inlined text when prepared
statements do not stay with a pool's connections (PgBouncer). Each entry point returns None or
False for "use the ordinary path".
"""

from __future__ import annotations

import functools
import hashlib
import logging
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

import asyncpg

from ...errors import ClaimBusy, NotFusable, StoreError
from ..base import Claimed, RecordKey
from . import compat
from .convert import (
    _Q,
    CONNECTION_ERRORS,
    LOCK_NOT_AVAILABLE,
    RETRYABLE,
    SERVER_ERROR,
    STALE_STATEMENT,
    scrub,
)
from .generations import Generations
from .literals import _inline, _literals
from .refusing import skipped

logger = logging.getLogger("idem_middleware.store")

#: A response body up to this size is inlined into the completion (hex doubles it).
FUSE_MAX_BODY = 64 * 1024


def _utf8(conn: Any) -> bool:
    """Whether the connection's client encoding is UTF-8 (the message's text is sent in it). The
    server reports it as `UTF8`; PgBouncer passes on the client's own spelling (asyncpg's
    `'utf-8'`), which the server reads as PostgreSQL does any encoding name: letters and digits
    only, in any case (`utf8`, or its alias `unicode`)."""
    try:
        encoding = getattr(conn.get_settings(), "client_encoding", None)
    except Exception:
        return False
    if encoding == "UTF8":
        return True
    return isinstance(encoding, str) and _utf8_name(encoding)


@functools.lru_cache(maxsize=64)
def _utf8_name(encoding: str) -> bool:
    """`encoding` names UTF-8 as PostgreSQL reads the name. Kept per spelling: behind PgBouncer
    the same `'utf-8'` comes with every claim and every completion."""
    return "".join(c for c in encoding.lower() if c.isalnum()) in ("utf8", "unicode")


def fusable(conn: Any) -> bool:
    """Whether the fast path may run on this connection: the BEGIN we send ourselves must be
    registered with asyncpg so a handler's `conn.transaction()` still nests as a savepoint
    (`compat.adopt`), and the client encoding must be UTF-8. Dollar-quoted text is sent in the
    client encoding, and the ordinary path (asyncpg's parameters) too, which cannot send every
    character another encoding lacks: one rule for both keeps a tenant or key that only one of
    them could write from being claimed one way and looked up the other."""
    return compat.supported(conn) and _utf8(conn) and not conn.is_in_transaction()


def _prepared_name(base: str, query: str) -> str:
    # The text's digest is in the name, so a session prepared by another version of this library
    # (PgBouncer keeps server sessions across app restarts) never runs a different query.
    return f"idem_{base}_{hashlib.sha256(query.encode()).hexdigest()[:12]}"


#: The statements the fast path prepares on a connection (all at once): SQL and parameter types.
_FAST: dict[str, tuple[str, str]] = {
    "claim_key": (_Q["claim_key"], "text, text, text, bigint"),
    "insert_final_checked": (
        _Q["insert_final_checked"],
        "text, text, text, bytea, bigint, float8, text, integer, bytea, bytea, text",
    ),
    "complete_checked": (
        _Q["complete_checked"],
        "text, text, text, bigint, text, integer, bytea, bytea, text",
    ),
    "fence": (_Q["fence"], "text, text, text, bigint, text"),
    "settle_checked": (
        _Q["settle_checked"],
        "text, text, text, bigint, text, text, integer, bytea, bytea, text, text, text",
    ),
}
NAMES = {name: _prepared_name(name, sql) for name, (sql, _) in _FAST.items()}
_PREPARE = "".join(
    f"PREPARE {NAMES[name]} ({types}) AS {sql};\n" for name, (sql, types) in _FAST.items()
)
#: The fused completion of each ordinary completing statement.
_CHECKED = {"complete": "complete_checked", "insert_final": "insert_final_checked"}
#: `claim_key`'s answer when another transaction is claiming the key (it returns two rows).
_KEY_BUSY = "SELECT 2"
_PREPARED_MISMATCH: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.InvalidSQLStatementNameError,
    asyncpg.exceptions.DuplicatePreparedStatementError,
)
#: How the `_checked` statements say they matched nothing (see queries.sql).
_MISSED = asyncpg.exceptions.DivisionByZeroError
#: What each completing statement wrote, by its arguments' positions: (generation, state, the
#: state it replaced or None). `_recorded` reads the record back to see whether it holds them.
_WRITES: dict[str, tuple[int, int, int | None]] = {
    "insert_final_checked": (4, 6, None),
    "complete_checked": (3, 4, None),
    "settle_checked": (3, 5, 4),
}


def _execute(name: str, args: Sequence[Any], utf8: bool = True) -> str:
    """`EXECUTE name (literals)`: what `_inline` would make of `EXECUTE name ($1, ...)`, without
    the regular expression (this runs twice per request)."""
    return f"EXECUTE {name} (" + ", ".join(_literals(args, utf8)) + ")"


class FusingSession(Protocol):
    """What the fast claim needs of a transaction session."""

    @property
    def driver(self) -> Any:
        """The session's connection, for the store's own statements."""

    async def begin(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 - a bound
        """BEGIN the ordinary way (within `timeout` seconds)."""

    async def rollback(self) -> None: ...

    def fusing(self, conn: Any, *, begins: bool) -> None:
        """A fused message is about to be sent on `conn` (its `driver`); `begins`: it carries
        the BEGIN."""


class FastPath:
    """A store's state for the transactional fast path.

    The fused messages run the claim and the completion as server-side prepared statements
    (SQL `PREPARE`, once per connection, in the same message as the first use), so the server
    plans them once instead of on every request. Which connections have them is tracked by the
    connection object; if the server says a statement is missing (a pool `reset` that runs
    DISCARD ALL, or PgBouncer moving the session between server connections), the store stops
    preparing and inlines the statements' text instead, for good.
    """

    def __init__(self, clean: weakref.WeakSet[Any] | None = None) -> None:
        self.generations = Generations()
        self.prepared: weakref.WeakSet[Any] = weakref.WeakSet()
        self.doubtful: weakref.WeakSet[Any] = weakref.WeakSet()  # see `unsure`
        self.use_prepared = True
        #: The store's clean connections, when the store's pool resets connections by the
        #: store's own hook: the message that commits then carries the connection's reset query
        #: too, after the COMMIT, and the connection joins them, so its release sends none (a
        #: round trip fewer). None: the pool's reset is someone else's (a pool passed in, a
        #: `reset` given).
        self.clean = clean

    def message(
        self,
        conn: Any,
        query: str,
        args: Sequence[Any],
        *,
        begin: bool,
        tail: str = "",
        utf8: bool = True,
    ) -> str:
        """One simple-query message running the named query with `args` as literals: [the
        PREPAREs, on a connection's first use] [BEGIN] the statement [tail, e.g. COMMIT].
        `conn`: the connection itself, not a pool's proxy (the statements are kept per
        connection). `utf8`: whether the client encoding is UTF-8 (else only hex literals, see
        `_literal`)."""
        begin_sql = "BEGIN;\n" if begin else ""
        if self.use_prepared and conn in self.prepared:
            # (`_execute`, written out with the rest: one string built, not three)
            return f"{begin_sql}EXECUTE {NAMES[query]} ({', '.join(_literals(args, utf8))}){tail}"
        if not self.use_prepared or conn in self.doubtful:
            return begin_sql + _inline(_FAST[query][0], args, utf8) + tail
        self.prepared.add(conn)  # prepared by this very message (`unsure` if it fails)
        return _PREPARE + begin_sql + _execute(NAMES[query], args, utf8) + tail

    def unsure(self, conn: Any, message: str, error: BaseException) -> None:
        """The message failed. A PREPARE is not undone with the message's transaction: if it
        carried them, some may be there and some not (cancelled half-way), so this connection's
        statements are inlined from now on; the store's others keep theirs. (A serialization
        failure or deadlock comes from the statement after them: all were made.)"""
        if message.startswith("PREPARE") and not isinstance(error, RETRYABLE):
            self.prepared.discard(conn)  # (`conn`: the connection itself, as for `message`)
            self.doubtful.add(conn)

    def stop_preparing(self) -> None:
        # A statement missing where we prepared it, or present where we did not: server
        # sessions do not follow our connections (PgBouncer, a DISCARD ALL reset). Inline from
        # now on.
        if self.use_prepared:
            logger.info("prepared statements do not stay with this pool's connections; inlining")
        self.use_prepared = False

    async def begin_and_claim(
        self,
        session: FusingSession,
        key: RecordKey,
        lock: int,
        timeout: float,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
    ) -> Claimed | None:
        """BEGIN and `claim_key` in one round trip: the key's advisory lock is taken and
        nothing is written (the record is written once, with its outcome, at commit).

        None: the ordinary path. The session's transaction is then open if a fast claim was
        tried (the key is taken, or a value cannot be inlined), and not if the connection does
        not allow one. Raises ClaimBusy when another transaction is claiming the key."""
        conn = session.driver
        if not fusable(conn):
            return None
        generation = self.generations.take_ready()
        for _ in range(2):
            in_message = generation is not None  # BEGIN travels with the claim
            if generation is None:
                # 1 claim in 32: BEGIN first and draw a batch inside the transaction (each
                # bounded as the claim is: a server that stops answering held the request).
                await session.begin(timeout)
                generation = await self.generations.draw(conn, timeout)
            args = (key.tenant, key.operation, key.key, lock)
            try:
                query = self.message(conn, "claim_key", args, begin=in_message)
            except NotFusable:
                if in_message:
                    await session.begin(timeout)
                return None
            session.fusing(conn, begins=in_message)
            try:
                status = await conn.execute(query, timeout=timeout)
            except _PREPARED_MISMATCH:
                self.stop_preparing()
                compat.forget_statements(conn)  # (asyncpg's are as gone as ours)
                await session.rollback()
                continue
            except BaseException as exc:
                self.unsure(conn, query, exc)
                raise
            if status == "SELECT 0":  # no record holds the key
                return Claimed(generation, generation)  # a fresh record's epoch
            if status == _KEY_BUSY:
                raise ClaimBusy("another transaction is claiming this key")
            return None
        raise StoreError("the fast claim failed twice")  # inlined the second time: unreachable

    def complete_and_commit(
        self, conn: Any, tx: Any, name: str, args: Sequence[Any], body_size: int
    ) -> Awaitable[bool]:
        """The completing statement `name` ("complete" or "insert_final") and COMMIT in one
        message. False: the ordinary path (nothing was sent). A unique violation (the key was
        recorded by a claim that took no advisory lock) aborts the message before its COMMIT.
        (The message's own coroutine, returned: no second one wraps it.)"""
        return self._with_commit(
            conn, tx, _CHECKED[name], args, body_size, "completion matched no pending record"
        )

    def settle_and_commit(
        self, conn: Any, tx: Any, args: Sequence[Any], body_size: int
    ) -> Awaitable[bool]:
        """A fenced settlement (`settle` arguments) and COMMIT in one message; False: the
        ordinary path (nothing was sent)."""
        return self._with_commit(
            conn,
            tx,
            "settle_checked",
            args,
            body_size,
            "the fenced settlement matched nothing under its own lock",
        )

    async def _with_commit(
        self, conn: Any, tx: Any, query: str, args: Sequence[Any], body_size: int, missed: str
    ) -> bool:
        """`query` (a checked statement: it divides by zero when it matches nothing) and COMMIT
        in one message on the adopted transaction `tx`; False when it cannot be fused."""
        if body_size > FUSE_MAX_BODY:
            return False
        clean = self.clean
        reset = "" if clean is None else _reset_query(conn)
        try:
            # A handler may have changed the client encoding since the claim: then hex only.
            message = self.message(
                conn, query, args, begin=False, tail=";\nCOMMIT" + reset, utf8=_utf8(conn)
            )
        except NotFusable:
            return False
        try:
            await conn.execute(message)
        except SERVER_ERROR as exc:
            scrub(exc)  # (a constraint, a trigger: its DETAIL quotes the row)
            # With the reset after the COMMIT, an error no longer means that the COMMIT did not
            # run. Unless the transaction is still open (aborted before its COMMIT), the record
            # tells: it holds what the completion wrote only if the COMMIT went through.
            if (
                reset
                and not isinstance(exc, CONNECTION_ERRORS)
                and not conn.is_in_transaction()
                and await _recorded(conn, query, args, exc)
            ):
                logger.warning(
                    "a connection's reset failed after its commit; the pool resets it again",
                    exc_info=True,
                )
                compat.committed(tx)
                return True
            if isinstance(exc, _MISSED) and conn.is_in_transaction():  # (else at the COMMIT:
                # a deferred trigger of the handler's that divided by zero, say)
                raise skipped(missed, fenced=query == "settle_checked") from exc
            if isinstance(exc, STALE_STATEMENT):
                # Gone since the claim used them: the handler dropped them (DEALLOCATE ALL),
                # and asyncpg's with them. Nothing committed; inlined from now on, as when a
                # pool's reset drops them.
                self.stop_preparing()
                compat.forget_statements(conn)
            raise
        compat.committed(tx)
        if reset and clean is not None:
            # Reset already, open (it just answered) and out of its transaction (the message
            # ended with its COMMIT and the reset): its release sends nothing.
            clean.add(conn)
        return True

    async def open_fence(self, conn: Any, args: Sequence[Any]) -> tuple[Any, bool] | None:
        """BEGIN and `fence` in one message: (the adopted transaction, whether the record was
        locked under the generation). None: the ordinary path (nothing is open)."""
        if not fusable(conn):
            return None
        for _ in range(2):
            try:
                query = self.message(conn, "fence", args, begin=True)
            except NotFusable:
                return None
            tx = compat.adopt(conn)
            try:
                status = await conn.execute(query)
            except _PREPARED_MISMATCH:
                self.stop_preparing()
                compat.forget_statements(conn)  # (asyncpg's are as gone as ours)
                await tx.rollback()
                continue
            except (*RETRYABLE, LOCK_NOT_AVAILABLE):
                # Nothing is open when it raises (the caller opens again, or answers the lock
                # wait the server's `lock_timeout` cancelled).
                await tx.rollback()
                raise
            except BaseException as exc:
                self.unsure(conn, query, exc)
                raise
            return tx, status == "SELECT 1"
        return None


def _reset_query(conn: Any) -> str:
    """The connection's reset query, to follow a COMMIT in its message: what the pool would
    otherwise send on release, as a round trip of its own."""
    query = compat.reset_query(conn)
    return ";\n" + query if query else ""


async def _recorded(conn: Any, query: str, args: Sequence[Any], error: BaseException) -> bool:
    """After the message of a completion, its COMMIT and the connection's reset failed with the
    transaction over: whether the COMMIT went through, so the error came from the reset after
    it. The record holds what the completion wrote (its generation and state) only if it did.
    StoreError when that cannot be told: the outcome is then unknown, as after a lost
    connection."""
    generation_at, state_at, replaced_at = _WRITES[query]
    if replaced_at is not None and args[replaced_at] == args[state_at]:
        raise StoreError("the outcome of the commit is not known") from error
    try:
        row = await conn.fetchrow(_Q["get"], args[0], args[1], args[2])
    except SERVER_ERROR as exc:
        raise StoreError("the outcome of the commit is not known") from exc
    return (
        row is not None
        and row["generation"] == args[generation_at]
        and row["state"] == args[state_at]
    )
