"""The PostgreSQL store (asyncpg). It runs named queries and translates driver errors; the
protocol's decisions live in the middleware."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import orjson
from asyncpg.transaction import TransactionState

from .. import sql
from ..errors import StaleGeneration, StoreError
from .base import (
    Claim,
    ClaimBusy,
    ClaimTimeout,
    EventWatch,
    Record,
    RecordKey,
    RecordSummary,
    RetryableConflict,
    Settlement,
    State,
    StoredResponse,
    StoreStats,
)
from .migrations import require_migrated

logger = logging.getLogger("idem_middleware.store")

_Q = sql.queries()
# How often a claim re-reads a record that vanished between the INSERT and the SELECT (a
# concurrent claim rolled back, or a purge ran). Each pass makes progress, so a few suffice.
_CLAIM_ATTEMPTS = 4
# A claim told not to wait still needs time to run; asyncpg's timeout covers the whole statement.
_MIN_STATEMENT_TIMEOUT = 0.05
# The LISTEN connection: how long one attempt may take (waiters poll meanwhile), and the pause
# after a failed one.
_LISTEN_CONNECT_SECONDS = 5.0
_LISTEN_RETRY_SECONDS = 5.0

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    # A connection killed mid-operation can leave asyncpg's protocol in a state it reports this
    # way ("cannot switch to state ..."): the connection is gone all the same.
    asyncpg.exceptions.InternalClientError,
)
_ACQUIRE_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *_CONNECTION_ERRORS)
_RETRYABLE: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
)
_LISTEN_ERRORS: tuple[type[BaseException], ...] = (
    *_CONNECTION_ERRORS,
    asyncpg.PostgresError,
    StoreError,
)
_LISTEN_CONNECT_ERRORS: tuple[type[BaseException], ...] = (*_LISTEN_ERRORS, TimeoutError)
#: `claim_key`'s answer when another transaction is claiming the key (it returns two rows).
_KEY_BUSY = "SELECT 2"
_WAIT_EXCEEDED: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.exceptions.QueryCanceledError,
)


def encode_headers(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    # latin-1 maps every byte to one code point, so any header value survives the round trip.
    return orjson.dumps([(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers])


def decode_headers(blob: bytes | None) -> list[tuple[bytes, bytes]]:
    if not blob:
        return []
    return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in orjson.loads(blob)]


def _record(key: RecordKey, row: asyncpg.Record) -> Record:
    status = row["response_status"]
    response = None
    if status is not None:
        response = StoredResponse(
            status=status,
            headers=decode_headers(row["response_headers"]),
            body=row["response_body"] or b"",
            body_omitted=row["body_omitted"],
        )
    return Record(
        key=key,
        fingerprint=row["fingerprint"],
        state=State(row["state"]),
        generation=row["generation"],
        response=response,
        expired=bool(row["expired"]),
        lease_expired=bool(row["lease_expired"]),
        retry_allowed=bool(row["retry_allowed"]),
        epoch=row["epoch"],
    )


def _translate(exc: BaseException) -> BaseException:
    if isinstance(exc, _RETRYABLE):
        return RetryableConflict(str(exc))
    if isinstance(exc, _CONNECTION_ERRORS):
        return StoreError(f"{type(exc).__name__}: {exc}")
    return exc


#: The one channel lease-mode settlements notify on; the payload says which record.
NOTIFY_CHANNEL = "idem_middleware"


def notify_token(key: RecordKey) -> str:
    """The NOTIFY payload for a record: short, fixed-length, and no raw key on the wire."""
    raw = "\x00".join((key.tenant, key.operation, key.key)).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def _settle_args(
    key: RecordKey, generation: int, expected: State, s: Settlement
) -> tuple[Any, ...]:
    r = s.response
    return (
        key.tenant,
        key.operation,
        key.key,
        generation,
        expected.value,
        s.state.value,
        None if r is None else r.status,
        None if r is None else encode_headers(r.headers),
        None if r is None else r.body,
        None if r is None else r.body_omitted,
        s.note,
        notify_token(key),
    )


def _summary(r: Any) -> RecordSummary:
    return RecordSummary(
        key=RecordKey(r["tenant"], r["operation"], r["idem_key"]),
        state=State(r["state"]),
        generation=r["generation"],
        mode=r["mode"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        lease_expires_at=r["lease_expires_at"],
        expires_at=r["expires_at"],
        response_status=r["response_status"],
        note=r["note"],
        lease_expired=bool(r["lease_expired"]),
        epoch=r["epoch"],
    )


async def _claim(
    executor: Any,
    key: RecordKey,
    args: tuple[Any, ...],
    token_hash: bytes | None,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
) -> Claim:
    """Claim, or return the record holding the key (see queries.sql `claim`).

    `executor` is the claim's connection (transactional mode) or the pool (lease mode: each
    statement commits on its own). With `token_hash`, only a live issued token may be claimed;
    `Claim(False, 0, None)` means the token was refused.
    """
    for _ in range(_CLAIM_ATTEMPTS):
        rows = await executor.fetch(_Q["claim"], *args, token_hash, timeout=timeout)
        if rows:
            row = rows[0]
            if row["claimed"]:
                return Claim(True, row["generation"], None, row["epoch"])
        else:
            # The conflicting claim committed after our snapshot: read it afresh.
            row = await executor.fetchrow(_Q["get"], *args[:3], timeout=timeout)
            if row is None:
                # Gone again (released, or purged). A token claim finds out whether the token
                # itself was refused, or only met that claim, and then claims again.
                if token_hash is not None and await _token_refused(
                    executor, key, token_hash, args[3], timeout
                ):
                    return Claim(False, 0, None)
                continue
        record = _record(key, row)
        if not record.expired:
            return Claim(False, record.generation, record)
        if token_hash is not None and await _token_refused(
            executor, key, token_hash, args[3], timeout
        ):
            return Claim(False, 0, None)
        reclaimed = await executor.fetchrow(
            _Q["reclaim_expired"], *args, token_hash, timeout=timeout
        )
        if reclaimed is not None:
            return Claim(True, reclaimed["generation"], None, reclaimed["epoch"])
    raise ClaimTimeout("the record kept changing under the claim")


async def _token_refused(
    executor: Any,
    key: RecordKey,
    token_hash: bytes,
    fingerprint: bytes,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
) -> bool:
    status = await executor.fetchrow(
        _Q["token_status"], key.tenant, token_hash, key.operation, fingerprint, timeout=timeout
    )
    return bool(_token_problem(status))


# -- one round trip for BEGIN + claim and for completion + COMMIT ---------------------------------
#
# asyncpg sends parameterised statements one at a time (extended protocol), and its BEGIN and
# COMMIT are statements of their own. On the transactional fast path the claim is therefore sent
# with its BEGIN, and the completion with its COMMIT, each as one simple-query message with the
# values inlined as literals: the business transaction then costs the same round trips as the
# bare handler's. Everything else (and every case `_fusable` refuses) takes the ordinary path.
#
# The literals are built so that only `[0-9a-f]` of any value reaches the message: text and
# bytes are hex, decoded by the server. A string literal's meaning depends on session settings
# a handler may change between the claim and the completion (`standard_conforming_strings`
# makes `\` an escape; `client_encoding` decides which characters the message's bytes are);
# hex digits mean the same under all of them, so no value can end its literal or change tenant.

#: A response body up to this size is inlined into the completion (hex doubles it).
FUSE_MAX_BODY = 64 * 1024
_PLACEHOLDER = re.compile(r"\$(\d+)")


class _NotFusable(Exception):
    """A value that cannot be written as a literal (NUL, a non-finite float, another type)."""


def _literal(value: Any) -> str:
    """`value` as an SQL expression whose text is the same whatever the session's settings:
    text as `convert_from(decode('<utf-8 hex>', 'hex'), 'UTF8')`, bytes as `decode(...)`,
    numbers as digits (in parentheses when negative). NUL and lone surrogates are refused."""
    kind = type(value)
    if kind is str:
        text: str = value
        if "\x00" in text:
            raise _NotFusable("a NUL character")  # PostgreSQL text cannot hold one
        try:
            raw = text.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate: the ordinary path reports it
            raise _NotFusable("not encodable as UTF-8") from exc
        return "convert_from(decode('" + raw.hex() + "', 'hex'), 'UTF8')"
    if kind is bytes:
        data: bytes = value
        return "decode('" + data.hex() + "', 'hex')"
    if value is None:
        return "NULL"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        number = str(value)
    elif kind is float:
        if not math.isfinite(value):
            raise _NotFusable("a non-finite number")
        number = repr(value)  # digits, `.`, `e`, a sign: the shortest text of exactly this value
    else:
        # Anything else (a str subclass a tenant resolver returned, say) takes the ordinary path.
        raise _NotFusable(f"no literal for {kind.__name__}")
    # A leading minus in parentheses: glued to an operator's `-` it would start a comment.
    return f"({number})" if number.startswith("-") else number


def _inline(query: str, args: Sequence[Any]) -> str:
    """`query` with each `$n` replaced by the literal of `args[n-1]` (our own queries only: they
    have no `$` inside string literals or comments)."""
    literals = [_literal(a) for a in args]
    return _PLACEHOLDER.sub(lambda m: literals[int(m.group(1)) - 1], query)


def _fusable(conn: Any) -> bool:
    """Whether the fast path may run on this connection: the BEGIN we send ourselves must be
    registered with asyncpg so a handler's `conn.transaction()` still nests as a savepoint
    (`_adopt`), and the client encoding must be UTF-8. The literals mean the same under any
    encoding, but the ordinary path (asyncpg's parameters, in the client encoding) cannot send
    every character another encoding lacks: one path for both keeps a tenant or key that only
    one of them could write from being claimed one way and looked up the other."""
    try:
        encoding = getattr(conn.get_settings(), "client_encoding", None)
    except Exception:
        return False
    return (
        hasattr(conn, "_top_xact")  # a proxy of a pool's connection forwards it
        and getattr(TransactionState, "STARTED", None) is not None
        and encoding == "UTF8"
        and not conn.is_in_transaction()
    )


def _adopt(conn: Any) -> Any:
    """An asyncpg Transaction standing for a BEGIN we send ourselves (in the fused claim).

    asyncpg keeps no public way to say "this connection's transaction is yours": without this a
    handler's `conn.transaction()` would refuse to run inside a manually started transaction.
    Uses asyncpg's private `_top_xact` and `_state`; `_fusable` checks they exist, and
    tests/integration/test_fused.py fails if a new asyncpg changes them."""
    tx = conn.transaction()  # on a pool's proxy, bound to the connection behind it
    tx._state = TransactionState.STARTED
    tx._connection._top_xact = tx
    return tx


def _committed(tx: Any) -> None:
    """Record with asyncpg that the adopted transaction was committed by our own COMMIT."""
    tx._state = TransactionState.COMMITTED
    if tx._connection._top_xact is tx:
        tx._connection._top_xact = None


class _Generations:
    """Generations drawn from `idem_generation_seq` ahead of use, for the fused claim (a simple
    query returns no rows, so the claim cannot RETURNING its generation).

    Each drawn value is handed out at most once, so generations are still never reused; values
    older than `max_age` are dropped, so generations keep roughly the order of the claims.
    """

    def __init__(self, batch: int = 32, max_age: float = 1.0) -> None:
        self._batch = batch
        self._max_age = max_age
        self._values: deque[int] = deque()
        self._drawn_at = 0.0

    def take_ready(self) -> int | None:
        """A drawn generation, or None: then `draw` (inside the claim's transaction)."""
        if self._values and time.monotonic() - self._drawn_at <= self._max_age:
            return self._values.popleft()
        return None

    async def draw(self, conn: Any) -> int:
        """Draw a batch (in the caller's transaction, so it costs no commit of its own) and
        take one. A concurrent draw may replace the batch; each value is still taken once."""
        rows = await conn.fetch(_Q["draw_generations"], self._batch)
        values = self._values = deque(row[0] for row in rows)
        self._drawn_at = time.monotonic()
        return values.popleft()


def _prepared_name(base: str, query: str) -> str:
    # The text's digest is in the name, so a session prepared by another version of this library
    # (PgBouncer keeps server sessions across app restarts) never runs a different query.
    return f"idem_{base}_{hashlib.sha256(query.encode()).hexdigest()[:12]}"


#: The statements the fast paths prepare on a connection (all at once): SQL and parameter types.
_FAST: dict[str, tuple[str, str]] = {
    "claim_key": (_Q["claim_key"], "text, text, text"),
    "insert_final": (
        _Q["insert_final"],
        "text, text, text, bytea, bigint, float8, text, integer, bytea, bytea, text",
    ),
    "claim_fresh": (_Q["claim_fresh"], "text, text, text, bytea, bigint, float8"),
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
_NAMES = {name: _prepared_name(name, sql) for name, (sql, _) in _FAST.items()}
#: The PREPAREs for a schema with `idem_claim_key` (migration 0003), and for one without it:
#: each prepares the fresh claim it uses, not the other.
_UNUSED = {True: "claim_fresh", False: "claim_key"}
_PREPARE = {
    write_once: "".join(
        f"PREPARE {_NAMES[name]} ({types}) AS {sql};\n"
        for name, (sql, types) in _FAST.items()
        if name != _UNUSED[write_once]
    )
    for write_once in (True, False)
}


def _execute(name: str, args: Sequence[Any]) -> str:
    """`EXECUTE name (literals)`: what `_inline` would make of `EXECUTE name ($1, ...)`, without
    the regular expression (this runs twice per request)."""
    return f"EXECUTE {name} (" + ", ".join(map(_literal, args)) + ")"


def _fast_message(
    fast: _FastPath, conn: Any, query: str, args: Sequence[Any], *, begin: bool, tail: str = ""
) -> str:
    """One simple-query message running the named query with `args` as literals: [the PREPAREs,
    on a connection's first use] [BEGIN] the statement [tail, e.g. COMMIT]."""
    begin_sql = "BEGIN;\n" if begin else ""
    if not fast.use_prepared:
        return begin_sql + _inline(_FAST[query][0], args) + tail
    statement = _execute(_NAMES[query], args) + tail
    raw = getattr(conn, "_con", conn)  # the connection behind a pool's proxy
    if raw is None:
        raise _NotFusable("the connection is gone")  # the ordinary path reports it
    if raw in fast.prepared:
        return begin_sql + statement
    fast.prepared.add(raw)  # prepared by this very message (it fails as a whole if not)
    return _PREPARE[fast.write_once is True] + begin_sql + statement


_PREPARED_MISMATCH: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.InvalidSQLStatementNameError,
    asyncpg.exceptions.DuplicatePreparedStatementError,
)


class _FastPath:
    """A store's state for the transactional fast path.

    The fused messages run the claim and the completion as server-side prepared statements
    (SQL `PREPARE`, once per connection, in the same message as the first use), so the server
    plans them once instead of on every request. Which connections have them is tracked by the
    connection object; if the server says a statement is missing (a pool `reset` that runs
    DISCARD ALL, or PgBouncer moving the session between server connections), the store stops
    preparing and inlines the statements' text instead, for good.
    """

    def __init__(self) -> None:
        self.generations = _Generations()
        self.prepared: weakref.WeakSet[Any] = weakref.WeakSet()
        self.use_prepared = True
        # Whether the schema has `idem_claim_key` (migration 0003): then a fresh claim takes
        # the key's advisory lock and the record is written once, at commit. None: not known
        # yet (`know_schema` asks, once per store, before the first fast message).
        self.write_once: bool | None = None

    async def know_schema(self, conn: Any) -> None:
        """Find out `write_once` before any fast message: the first one on a connection prepares
        the statements, and which claim it prepares depends on it."""
        if self.write_once is not None:
            return
        self.write_once = bool(await conn.fetchval(_Q["claim_key_available"]))
        if not self.write_once:
            logger.warning(
                "the idempotency schema predates migration 0003 (run `idem-middleware "
                "migrate`): transactional claims write their record twice"
            )


def _token_problem(row: Any) -> str:
    """Why a token cannot be claimed, or "" if it can."""
    if row is None:
        return "This key is not a token issued to you for this operation."
    if not row["same_operation"]:
        return "This token was issued for another operation."
    if not row["unused"]:
        return "This token was already used; ask for a new one."
    if not row["live"]:
        return "This token has expired; ask for a new one."
    if not row["same_request"]:
        return "This token was issued for a different request."
    return ""


class _Listener:
    """One LISTEN connection per store, fanning notifications out to the waiters in-process.

    Notifications are hints: a waiter always re-reads the record, and polls when none come (a
    lost notification, or PgBouncer in transaction mode, where LISTEN cannot work).

    The connection is made by one background attempt at a time, bounded by
    `_LISTEN_CONNECT_SECONDS`. No waiter ever waits for it: a waiter that finds no connection
    starts the attempt (if none is running) and polls; once the connection is up, it is woken by
    notifications like every later waiter (its event is registered either way).
    """

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self._conn: Any = None
        self._pooled = False
        self._connecting: asyncio.Task[None] | None = None
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._retry_at = 0.0

    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    def ensure(self) -> bool:
        """Whether a LISTEN connection is up now; if not, start connecting (in the background)."""
        if not self._store._listen:
            return False
        if self.connected():
            return True
        loop = asyncio.get_running_loop()
        if self._connecting is None and loop.time() >= self._retry_at:
            self._connecting = loop.create_task(self._connect())
        return False

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        conn: Any = None
        try:
            async with asyncio.timeout(_LISTEN_CONNECT_SECONDS):
                conn, self._pooled = await self._store._listen_connection()
                await conn.add_listener(NOTIFY_CHANNEL, self._notified)
            conn.add_termination_listener(self._lost)
            self._conn, conn = conn, None
        except _LISTEN_CONNECT_ERRORS as exc:
            logger.warning("LISTEN unavailable, polling instead: %r", exc)
            self._retry_at = loop.time() + _LISTEN_RETRY_SECONDS
        finally:
            self._connecting = None
            if conn is not None:  # it never became the listener (a timeout, or closing)
                self._give_back(conn)

    def _give_back(self, conn: Any) -> None:
        if self._pooled:
            task = asyncio.get_running_loop().create_task(self._store.pool.release(conn))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        else:
            conn.terminate()

    def _notified(self, conn: object, pid: int, channel: str, payload: object) -> None:
        for event in self._waiters.get(str(payload), ()):
            event.set()

    def _lost(self, conn: Any) -> None:
        self._conn = None
        if self._pooled:
            # A pooled connection that died still holds its pool slot until it is released.
            self._give_back(conn)
        # Wake everyone: they re-read the record, then poll until a new listener is up.
        for events in self._waiters.values():
            for event in events:
                event.set()

    @asynccontextmanager
    async def watch(self, key: RecordKey) -> AsyncIterator[EventWatch]:
        token = notify_token(key)
        event = asyncio.Event()
        self.ensure()
        self._waiters.setdefault(token, set()).add(event)
        try:
            yield EventWatch(event, self.connected)
        finally:
            waiters = self._waiters.get(token)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[token]

    async def close(self) -> None:
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
        conn, self._conn = self._conn, None
        if conn is None or conn.is_closed():
            return
        conn.remove_termination_listener(self._lost)
        if self._pooled:
            # Back to the pool without our callback. asyncpg warns about a listener left on a
            # released connection; where warnings are errors that aborts the release, and the
            # connection stays acquired forever (`pool.close()` then never returns).
            try:
                await conn.remove_listener(NOTIFY_CHANNEL, self._notified)
            except _LISTEN_ERRORS:
                logger.debug("UNLISTEN failed; the pool's reset will drop it", exc_info=True)
            await self._store.pool.release(conn)
        else:
            await conn.close()


class _PgFenced:
    __slots__ = ("_conn", "_fast", "_tx", "committed")

    def __init__(self, conn: Any, tx: Any, fast: _FastPath | None) -> None:
        self._conn = conn
        self._tx = tx
        self._fast = fast  # set when the fence was opened the fast way (an adopted BEGIN)
        self.committed = False

    @property
    def connection(self) -> Any:
        return self._conn

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        try:
            row = await self._conn.fetchrow(
                _Q["settle"], *_settle_args(key, generation, expected, s)
            )
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc
        return bool(row["settled"])

    async def settle_and_commit(
        self, key: RecordKey, generation: int, expected: State, s: Settlement
    ) -> bool:
        fast = self._fast
        body = b"" if s.response is None else s.response.body
        query = None
        if fast is not None and len(body) <= FUSE_MAX_BODY:
            args = _settle_args(key, generation, expected, s)
            try:
                query = _fast_message(
                    fast, self._conn, "settle_checked", args, begin=False, tail=";\nCOMMIT"
                )
            except _NotFusable:
                query = None
        if query is None:
            return await self.settle(key, generation, expected, s)  # the exit commits
        try:
            await self._conn.execute(query)
        except asyncpg.exceptions.DivisionByZeroError as exc:
            raise StoreError("the fenced settlement matched nothing under its own lock") from exc
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc
        _committed(self._tx)
        self.committed = True
        return True


class _PgTransaction:
    """One pooled connection in one transaction (see TransactionSession).

    Opened with `begin=False`, the transaction starts with the claim: BEGIN and the claim then
    travel in one message, as do the completion and COMMIT (see `_inline`).

    On a schema with `idem_claim_key` (migration 0003) the fast claim writes nothing: it takes
    the key's advisory lock and checks that no record holds the key, and the record is written
    once, with its outcome, at commit (`insert_final`). A pending transactional record is never
    visible to anyone else anyway, so writing it early only cost an UPDATE, a dead row version and
    its index entries."""

    __slots__ = ("_conn", "_deferred", "_fast", "_fused", "_give_back", "_tx", "lent")

    def __init__(self, conn: Any, fast: _FastPath | None) -> None:
        self._conn = conn
        # Set by the store: ends the session and returns the connection to the pool (once).
        self._give_back: Callable[[_PgTransaction, Any], Awaitable[None]] | None = None
        self._fast = fast  # None: the fast path is off
        self._tx: Any = None
        # Whether the claim went the fast way (the connection passed `_fusable`), so the
        # completion may travel with the COMMIT too.
        self._fused = False
        # (fingerprint, retention seconds) of a claim whose record is written at completion.
        self._deferred: tuple[bytes, float] | None = None
        # Whether the connection was handed out (to the handler): then the pool resets it.
        self.lent = False

    @property
    def connection(self) -> Any:
        self.lent = True
        return self._conn

    @property
    def active(self) -> bool:
        return self._tx is not None

    async def begin(self) -> None:
        tx = self._conn.transaction()
        try:
            await tx.start()
        except _CONNECTION_ERRORS as exc:
            raise StoreError(str(exc)) from exc
        self._tx = tx
        self._fused = False
        self._deferred = None

    async def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            await give_back(self, self._conn)

    async def commit(self) -> None:
        tx, self._tx = self._tx, None
        try:
            await tx.commit()
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc

    async def rollback(self) -> None:
        tx, self._tx = self._tx, None
        self._deferred = None
        if tx is not None:
            try:
                await tx.rollback()
            except _CONNECTION_ERRORS:
                # The connection is gone, and the server rolled the transaction back with it.
                logger.debug("rollback on a lost connection", exc_info=True)

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        args = (
            key.tenant,
            key.operation,
            key.key,
            fingerprint,
            "transactional",
            retention_seconds,
            None,
        )
        timeout = max(wait_seconds, _MIN_STATEMENT_TIMEOUT)
        try:
            if self._tx is None:
                if self._fast is not None and token_hash is None and _fusable(self._conn):
                    claimed = await self._begin_and_claim(
                        key, fingerprint, retention_seconds, timeout
                    )
                    if claimed is not None:
                        return claimed
                    # The key is taken (a replay, most likely): read the record. `_claim`
                    # decides the rarer cases (it expired, or vanished since).
                    row = await self._conn.fetchrow(_Q["get"], *args[:3], timeout=timeout)
                    if row is not None:
                        record = _record(key, row)
                        if not record.expired:
                            return Claim(False, record.generation, record)
                else:
                    await self.begin()
            await self._lock_key(key, timeout)
            return await _claim(self._conn, key, args, token_hash, timeout)
        except ClaimBusy:
            await self.rollback()
            raise
        except _WAIT_EXCEEDED as exc:
            raise ClaimTimeout("waited too long for a concurrent claim") from exc
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc

    async def _lock_key(
        self,
        key: RecordKey,
        timeout: float,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
    ) -> None:
        """The ordinary path's claim takes the key's advisory lock too (without waiting), so
        its INSERT never queues behind another transaction's uncommitted claim of the key. (A
        lock this transaction holds already is taken again: advisory locks nest.)"""
        fast = self._fast
        if fast is not None and fast.write_once is False:
            return  # a schema without idem_claim_key: the INSERT arbitrates, as before
        found = await self._conn.fetchval(
            _Q["claim_key_count"], key.tenant, key.operation, key.key, timeout=timeout
        )
        if found == 2:
            raise ClaimBusy("another transaction is claiming this key")

    async def _begin_and_claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        retention_seconds: float,
        timeout: float,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
    ) -> Claim | None:
        """BEGIN and claim in one round trip. None: the key is taken (or a value cannot be
        inlined), and the caller claims the ordinary way in the transaction open now.

        A claim that meets another transaction's uncommitted claim of the key waits for it, as
        the ordinary claim does, and for as long (`timeout`: then the message is cancelled)."""
        fast = self._fast
        assert fast is not None
        await fast.know_schema(self._conn)
        generation = fast.generations.take_ready()
        for _ in range(2):
            in_message = generation is not None  # BEGIN travels with the claim
            if generation is None:
                # 1 claim in 32: BEGIN first and draw a batch inside the transaction.
                await self.begin()
                generation = await fast.generations.draw(self._conn)
            args: tuple[Any, ...]
            if fast.write_once:
                query_name, args = "claim_key", (key.tenant, key.operation, key.key)
            else:
                query_name = "claim_fresh"
                args = (
                    key.tenant,
                    key.operation,
                    key.key,
                    fingerprint,
                    generation,
                    retention_seconds,
                )
            try:
                query = _fast_message(fast, self._conn, query_name, args, begin=in_message)
            except _NotFusable:
                if in_message:
                    await self.begin()
                return None
            if in_message:
                self._tx = _adopt(self._conn)
            self._fused = True
            try:
                status = await self._conn.execute(query, timeout=timeout)
            except _PREPARED_MISMATCH:
                _stop_preparing(fast)
                await self.rollback()
                continue
            if status == "SELECT 0":  # claim_key: no record holds the key
                self._deferred = (fingerprint, retention_seconds)
                return Claim(True, generation, None)
            if status == _KEY_BUSY:
                raise ClaimBusy("another transaction is claiming this key")
            if status == "INSERT 0 1":  # claim_fresh: the pending record is ours
                return Claim(True, generation, None)
            return None
        raise StoreError("the fast claim failed twice")  # inlined the second time: unreachable

    async def complete(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        name, args = self._completion(key, generation, state, response)
        query = _Q["insert_final"] if name == "insert_final" else _Q["complete"]
        try:
            status = await self._conn.execute(query, *args)
        except asyncpg.exceptions.UniqueViolationError as exc:
            raise await self._lost_the_key(exc) from exc
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc
        self._deferred = None
        if status not in ("UPDATE 1", "INSERT 0 1"):
            # Our own uncommitted row: only a bug (or a hand edit) makes this miss.
            raise StoreError(f"completion matched no pending record ({status})")

    async def complete_and_commit(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        name, args = self._completion(key, generation, state, response)
        query = None
        fast = self._fast
        if self._fused and fast is not None and len(response.body) <= FUSE_MAX_BODY:
            try:
                query = _fast_message(fast, self._conn, name, args, begin=False, tail=";\nCOMMIT")
            except _NotFusable:
                query = None
        if query is None:
            await self.complete(key, generation, state, response)
            await self.commit()
            return
        try:
            await self._conn.execute(query)
        except asyncpg.exceptions.DivisionByZeroError as exc:
            raise StoreError("completion matched no pending record") from exc
        except asyncpg.exceptions.UniqueViolationError as exc:
            raise await self._lost_the_key(exc) from exc
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc
        self._deferred = None
        _committed(self._tx)
        self._tx = None

    def _completion(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> tuple[str, tuple[Any, ...]]:
        """The fast path's completing statement and its arguments: the pending record's UPDATE
        (`complete_checked`), or, for a claim that wrote nothing yet, the record's one INSERT."""
        headers = encode_headers(response.headers)
        if self._deferred is None:
            return "complete_checked", (
                key.tenant,
                key.operation,
                key.key,
                generation,
                state.value,
                response.status,
                headers,
                response.body,
                response.body_omitted,
            )
        fingerprint, retention_seconds = self._deferred
        return "insert_final", (
            key.tenant,
            key.operation,
            key.key,
            fingerprint,
            generation,
            retention_seconds,
            state.value,
            response.status,
            headers,
            response.body,
            response.body_omitted,
        )

    async def _lost_the_key(self, exc: BaseException) -> RetryableConflict:
        """A record for the key appeared while the handler ran: a claim that took no advisory
        lock (the ordinary path, a token claim, or a lease-mode claim of the same operation)
        committed it first. Nothing of ours is committed; the attempt runs again, and its
        claim finds that record."""
        logger.debug("the key was recorded by another claim first", exc_info=exc)
        await self.rollback()
        return RetryableConflict("the key was recorded by a concurrent claim")


def _stop_preparing(fast: _FastPath) -> None:
    # A statement missing where we prepared it, or present where we did not: server sessions do
    # not follow our connections (PgBouncer, a DISCARD ALL reset). Inline from now on.
    if fast.use_prepared:
        logger.info("prepared statements do not stay with this pool's connections; inlining")
    fast.use_prepared = False


class PostgresStore:
    """The PostgreSQL store. Borrows the caller's asyncpg pool, or creates (and closes) its own.

    For PgBouncer in transaction pooling mode pass `statement_cache_size=0`.

    `fast_path=False` sends the transactional claim and completion as parameterised statements
    of their own, with BEGIN and COMMIT apart (two round trips more per fresh request, and no
    reliance on asyncpg's private transaction attributes; see `_adopt`).
    """

    def __init__(
        self,
        *,
        pool: asyncpg.Pool[Any] | None = None,
        dsn: str | None = None,
        min_size: int = 2,
        max_size: int = 10,
        statement_cache_size: int = 100,
        application_name: str = "idem_middleware",
        connect_kwargs: dict[str, Any] | None = None,
        listen: bool = True,
        listen_dsn: str | None = None,
        fast_path: bool = True,
    ) -> None:
        if (pool is None) == (dsn is None):
            raise ValueError("pass exactly one of pool= or dsn=")
        self._pool = pool
        self._owns_pool = pool is None
        self._dsn = dsn
        self._listen = listen
        self._listen_dsn = listen_dsn or dsn
        self._listener = _Listener(self)
        self._fast = _FastPath() if fast_path else None
        self._pool_kwargs: dict[str, Any] = {
            "min_size": min_size,
            "max_size": max_size,
            "statement_cache_size": statement_cache_size,
            "server_settings": {"application_name": application_name},
            **(connect_kwargs or {}),
        }
        # Connections that ran only the store's own statements since they were acquired: they
        # carry no session state (ours is all transaction-scoped), so the pool of our own skips
        # their reset query, a round trip per release. Any other connection is reset as usual.
        self._clean: weakref.WeakSet[Any] = weakref.WeakSet()
        self._pool_kwargs.setdefault("reset", self._reset_connection)

    async def _reset_connection(self, conn: Any) -> None:
        """The reset of our own pool (asyncpg has already rolled back any open transaction and
        dropped client-side listeners): the server-side reset, unless `conn` is clean."""
        if conn in self._clean:
            self._clean.discard(conn)
            return
        query = conn.get_reset_query()
        if query:
            await conn.execute(query)

    def _mark_clean(self, conn: Any) -> None:
        """`conn` (a pool's proxy) ran only our statements and is not in a transaction."""
        raw = getattr(conn, "_con", None)  # the connection behind the proxy
        if raw is not None and not raw.is_closed() and not raw.is_in_transaction():
            self._clean.add(raw)

    @asynccontextmanager
    async def _internal(self) -> AsyncIterator[Any]:
        """A pooled connection for the store's own statements: released without a reset."""
        conn = await self.pool.acquire()
        try:
            yield conn
            self._mark_clean(conn)
        finally:
            await self.pool.release(conn)

    @property
    def pool(self) -> asyncpg.Pool[Any]:
        if self._pool is None:
            raise StoreError("the store is not open: call `await store.open()` first")
        return self._pool

    async def open(self) -> PostgresStore:
        """Create the pool (unless one was given), and check that the database has every
        migration this version needs: ConfigurationError, naming the command, if not. A server
        that cannot be reached yet is no reason to refuse (requests answer 503 until it is):
        the check is then skipped, with a warning."""
        created = self._pool is None
        if self._pool is None:
            try:
                self._pool = await asyncpg.create_pool(self._dsn, **self._pool_kwargs)
            except _CONNECTION_ERRORS as exc:
                raise StoreError(f"cannot connect: {exc}") from exc
        try:
            async with self._internal() as conn:
                await require_migrated(conn)
        except _ACQUIRE_ERRORS as exc:
            logger.warning("cannot check the idempotency schema now: %s", exc)
        except BaseException:
            if created and self._pool is not None:
                pool, self._pool = self._pool, None
                await pool.close()
            raise
        return self

    async def close(self) -> None:
        await self._listener.close()
        if self._owns_pool and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    async def __aenter__(self) -> PostgresStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def transaction(
        self, *, acquire_timeout: float, begin: bool = True
    ) -> AsyncIterator[_PgTransaction]:
        try:
            conn = await self.pool.acquire(timeout=acquire_timeout)
        except _ACQUIRE_ERRORS as exc:
            raise StoreError(f"no database connection: {type(exc).__name__}") from exc
        session = _PgTransaction(conn, self._fast)
        session._give_back = self._give_back
        try:
            if begin:
                await session.begin()
            yield session
        finally:
            await session.release()

    async def _give_back(self, session: _PgTransaction, conn: Any) -> None:
        """The end of a `transaction()` session, early (`release`) or at the block's end."""
        try:
            if session.active:
                await session.rollback()
            if not session.lent:
                self._mark_clean(conn)  # a replay, say: the handler never had the connection
        finally:
            await self.pool.release(conn)

    async def get(self, key: RecordKey) -> Record | None:
        try:
            async with self._internal() as conn:
                row = await conn.fetchrow(_Q["get"], key.tenant, key.operation, key.key)
        except _CONNECTION_ERRORS as exc:
            raise StoreError(str(exc)) from exc
        return None if row is None else _record(key, row)

    # -- lease mode ------------------------------------------------------------------------------

    async def claim_lease(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        lease_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        args = (
            key.tenant,
            key.operation,
            key.key,
            fingerprint,
            "lease",
            retention_seconds,
            lease_seconds,
        )
        try:
            async with self._internal() as conn:
                return await _claim(conn, key, args, token_hash, None)
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc

    async def token_problem(self, key: RecordKey, token_hash: bytes, fingerprint: bytes) -> str:
        row = await self._run(
            "fetchrow", _Q["token_status"], key.tenant, token_hash, key.operation, fingerprint
        )
        return _token_problem(row)

    async def _run(self, method: str, query: str, *args: Any) -> Any:
        try:
            async with self._internal() as conn:
                return await getattr(conn, method)(query, *args)
        except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
            raise _translate(exc) from exc

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        status = await self._run(
            "execute",
            _Q["heartbeat"],
            key.tenant,
            key.operation,
            key.key,
            generation,
            lease_seconds,
        )
        return bool(status == "UPDATE 1")

    async def expire_lease(self, key: RecordKey, generation: int) -> bool:
        moved = await self._run(
            "fetchval",
            _Q["expire_lease"],
            key.tenant,
            key.operation,
            key.key,
            generation,
            notify_token(key),
        )
        return bool(moved)

    async def takeover(
        self, key: RecordKey, generation: int, expected: State, lease_seconds: float
    ) -> int | None:
        if expected not in (State.PENDING, State.UNKNOWN):
            # A finished outcome is replayed, never run again (PROTOCOL §2).
            raise ValueError(f"only a pending or unknown record can be taken over, not {expected}")
        new: int | None = await self._run(
            "fetchval",
            _Q["takeover"],
            key.tenant,
            key.operation,
            key.key,
            generation,
            expected.value,
            lease_seconds,
        )
        return new

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        row = await self._run("fetchrow", _Q["settle"], *_settle_args(key, generation, expected, s))
        return bool(row["settled"])

    async def release(self, key: RecordKey, generation: int) -> bool:
        row = await self._run(
            "fetchrow",
            _Q["release"],
            key.tenant,
            key.operation,
            key.key,
            generation,
            notify_token(key),
        )
        return bool(row["released"])

    async def allow_retry(self, key: RecordKey, generation: int, note: str) -> bool:
        row = await self._run(
            "fetchrow",
            _Q["allow_retry"],
            key.tenant,
            key.operation,
            key.key,
            generation,
            note,
            notify_token(key),
        )
        return bool(row["moved"])

    async def amend(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        row = await self._run("fetchrow", _Q["amend"], *_settle_args(key, generation, expected, s))
        return bool(row["amended"])

    async def describe(self, key: RecordKey) -> RecordSummary | None:
        row = await self._run("fetchrow", _Q["describe"], key.tenant, key.operation, key.key)
        return None if row is None else _summary(row)

    @asynccontextmanager
    async def fenced(
        self, key: RecordKey, generation: int, expected: State = State.PENDING
    ) -> AsyncIterator[_PgFenced]:
        try:
            conn = await self.pool.acquire()
        except _ACQUIRE_ERRORS as exc:
            raise StoreError(f"no database connection: {type(exc).__name__}") from exc
        try:
            try:
                tx, held, fast = await self._open_fence(conn, key, generation, expected)
            except _CONNECTION_ERRORS as exc:
                raise StoreError(str(exc)) from exc
            if not held:
                await tx.rollback()
                raise StaleGeneration(
                    f"generation {generation} no longer holds the record; its writes are refused"
                )
            session = _PgFenced(conn, tx, fast)
            try:
                yield session
            except BaseException:
                if not session.committed:
                    await tx.rollback()
                raise
            if not session.committed:
                try:
                    await tx.commit()
                except (*_CONNECTION_ERRORS, *_RETRYABLE) as exc:
                    raise _translate(exc) from exc
        finally:
            await self.pool.release(conn)

    async def _open_fence(
        self, conn: Any, key: RecordKey, generation: int, expected: State
    ) -> tuple[Any, bool, _FastPath | None]:
        """BEGIN and lock the record under the generation: (transaction, held, fast). The fast
        way sends both in one message; its status line says whether the row was locked."""
        args = (key.tenant, key.operation, key.key, generation, expected.value)
        fast = self._fast
        if fast is not None and _fusable(conn):
            await fast.know_schema(conn)
            for _ in range(2):
                try:
                    query = _fast_message(fast, conn, "fence", args, begin=True)
                except _NotFusable:
                    break
                tx = _adopt(conn)
                try:
                    status = await conn.execute(query)
                except _PREPARED_MISMATCH:
                    _stop_preparing(fast)
                    await tx.rollback()
                    continue
                return tx, status == "SELECT 1", fast
        tx = conn.transaction()
        await tx.start()
        held = await conn.fetchval(_Q["fence"], *args)
        return tx, held is not None, None

    async def _listen_connection(self) -> tuple[Any, bool]:
        """A connection for LISTEN: a dedicated one when we know the DSN, else one from the pool."""
        if not self._listen:
            raise StoreError("LISTEN is disabled for this store")
        if self._listen_dsn is not None:
            conn = await asyncpg.connect(
                self._listen_dsn, server_settings={"application_name": "idem_middleware.listen"}
            )
            return conn, False
        return await self.pool.acquire(), True

    def watch(self, key: RecordKey) -> Any:
        return self._listener.watch(key)

    async def list_records(
        self,
        *,
        states: Sequence[State],
        tenant: str | None = None,
        operation: str | None = None,
        limit: int = 100,
        stale_only: bool = False,
    ) -> list[RecordSummary]:
        rows = await self._run(
            "fetch",
            _Q["list_records"],
            [s.value for s in states],
            tenant,
            operation,
            limit,
            stale_only,
        )
        return [_summary(r) for r in rows]

    async def purge(self, *, batch_size: int = 1000, max_batches: int = 1000) -> int:
        """Delete finished records past their retention, one short transaction per batch, and
        then expired one-time tokens the same way.

        Never touches pending or unknown records. Returns how many records were deleted.
        """
        if batch_size < 1 or max_batches < 1:
            raise ValueError("batch_size and max_batches must be positive")
        deleted = await self._purge_batches(_Q["purge_batch"], batch_size, max_batches)
        await self._purge_batches(_Q["purge_tokens"], batch_size, max_batches)
        return deleted

    async def _purge_batches(self, query: str, batch_size: int, max_batches: int) -> int:
        deleted = 0
        for _ in range(max_batches):
            status = await self._run("execute", query, batch_size)
            count = int(status.rsplit(" ", 1)[-1])
            deleted += count
            if count < batch_size:
                break
        return deleted

    async def stats(self) -> StoreStats:
        try:
            rows = await self.pool.fetch(_Q["stats"])
        except _CONNECTION_ERRORS as exc:
            raise StoreError(str(exc)) from exc
        counts = {state.value: 0 for state in State}
        oldest: dict[str, float | None] = {state.value: None for state in State}
        for row in rows:
            counts[row["state"]] = row["count"]
            oldest[row["state"]] = row["oldest_age_seconds"]
        return StoreStats(counts=counts, oldest_age_seconds=oldest)
