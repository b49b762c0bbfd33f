"""SQLAlchemy 2.0 `AsyncSession`s that run inside the claim's transaction.

A session made here writes on the connection that holds the request's claim (transactional
mode) or its fenced transaction (lease mode): its writes commit with the outcome and roll back
with it. The session's own transaction is a savepoint inside that transaction (asyncpg nests a
`connection.transaction()` opened inside another as a SAVEPOINT), so

- `session.commit()` flushes and releases the savepoint: nothing reaches the database for good
  until the outcome commits, and a later failure still rolls it back;
- `session.rollback()` undoes the session's writes since its last commit, and the claim stays;
- `session.close()` never closes the connection: the store owns it.

The engine is made once per `ClaimSessions` (`sqla_engine.py`: its pool lends the claim's
connection). Install with the `[sqlalchemy]` extra.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any

import asyncpg

try:
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "sqlalchemy", exc) from exc
from starlette.requests import Request

from .context import IdempotencyContext, current_context, get_context
from .errors import NO_CLAIM_HINT, ConfigurationError
from .sqla_engine import ClaimPool, create_claim_engine, refuse_characteristics

__all__ = [
    "ClaimSession",
    "ClaimSessions",
    "claim_engine",
    "claim_session",
    "create_claim_engine",
    "open_claim_session",
]


class ClaimSessions:
    """Sessions in the claim's transaction: one engine, a session class, session options.

    `session_class` may be SQLModel's `AsyncSession`. `expire_on_commit` is off by default: a
    "commit" here only releases a savepoint, and reloading would cost a query for nothing.
    """

    def __init__(
        self,
        *,
        engine: AsyncEngine | None = None,
        session_class: type[AsyncSession] = AsyncSession,
        expire_on_commit: bool = False,
        **session_options: Any,
    ) -> None:
        if engine is not None and not isinstance(engine, AsyncEngine):  # (a sync Engine, a URL)
            raise ConfigurationError(
                "ClaimSessions(engine=...) is an AsyncEngine made by create_claim_engine(), "
                f"not {type(engine).__name__}"
            )
        if not (isinstance(session_class, type) and issubclass(session_class, AsyncSession)):
            raise ConfigurationError(  # (SQLModel's sync Session: every request a 500)
                "ClaimSessions(session_class=...) is an AsyncSession class (sqlmodel.ext."
                f"asyncio.session.AsyncSession for SQLModel), not {session_class!r:.80}"
            )
        if engine is not None and not isinstance(engine.sync_engine.pool, ClaimPool):
            # Its sessions would write outside the claim: committed even when the claim is
            # released, and again by the retry.
            raise ConfigurationError(
                "ClaimSessions(engine=...) needs an engine made by create_claim_engine(): "
                f"{engine.url.render_as_string()} opens connections of its own, outside the claim"
            )
        if engine is not None:  # (`engine.execution_options(...)`: a copy with its own)
            refuse_characteristics(engine.get_execution_options())
        if session_options.get("twophase"):
            raise ConfigurationError(
                "ClaimSessions() does not take twophase=True: its transaction is a savepoint in "
                "the claim's, which commits with the outcome"
            )
        _refuse_routing(session_class, session_options)
        self.engine = engine if engine is not None else create_claim_engine()
        self.factory: async_sessionmaker[Any] = async_sessionmaker(
            self.engine,
            class_=session_class,
            expire_on_commit=expire_on_commit,
            **session_options,
        )

    @asynccontextmanager
    async def session(self, request: Request | None = None) -> AsyncIterator[Any]:
        """A session for the claim of `request` (or of the current task).

        A clean exit commits what the session holds into the claim's transaction (it is written
        for good with the outcome); an exception rolls the session back and propagates.
        """
        if request is not None:
            try:
                context = get_context(request)
            except LookupError:
                raise RuntimeError(
                    "this endpoint uses a claim session, but no idempotency claim is active: "
                    + NO_CLAIM_HINT
                ) from None
        else:
            running = current_context()
            if running is None:
                raise RuntimeError("no idempotency claim is running in this task")
            context = running
        session = self.factory()
        # A FastAPI dependency ends after the response was sent: one that cannot be held (a
        # stream, or over the size cap) is settled before its first byte, so what the session
        # still holds is flushed then, or it would be lost while the outcome says it succeeded.
        forget = context.hold_writes(functools.partial(_flushed_or_spoiled, session, context))
        failed = False
        try:
            yield session
            transaction = session.get_transaction()
            if transaction is not None:
                # Inactive: a flush failed (SQLAlchemy rolled its writes back already) and the
                # handler went on without `session.rollback()`.
                failed = not transaction.is_active or not await _committed(session)
        finally:
            forget()
            await session.close()
        if failed:
            await spoil(context)

    async def dependency(self, request: Request) -> AsyncIterator[Any]:
        """The FastAPI dependency: `Depends(sessions.dependency)`."""
        async with self.session(request) as session:
            yield session


def _refuse_routing(session_class: type[AsyncSession], options: dict[str, Any]) -> None:
    """What would route a session's statements to an engine of its own, outside the claim: a
    `binds` entry that is not a claim engine, or a session class that picks engines itself."""
    if "bind" in options:
        raise ConfigurationError(
            "ClaimSessions() does not take bind=: pass a claim engine as engine=..."
        )
    for key, bind in (options.get("binds") or {}).items():
        if isinstance(bind, AsyncEngine) and isinstance(bind.sync_engine.pool, ClaimPool):
            continue
        url = getattr(getattr(bind, "sync_engine", None), "url", None)
        what = url.render_as_string() if url is not None else type(bind).__name__
        raise ConfigurationError(
            "ClaimSessions(binds=...) takes only engines made by create_claim_engine(): "
            f"{getattr(key, '__name__', key)!s} is bound to {what}, which would write outside "
            "the claim"
        )
    sync_class: Any = options.get("sync_session_class") or getattr(
        session_class, "sync_session_class", Session
    )
    if sync_class.get_bind is not Session.get_bind:
        raise ConfigurationError(
            f"ClaimSessions() cannot use {sync_class.__qualname__}: it overrides get_bind(), and "
            "the engines it chooses would write outside the claim (a claim session has one "
            "connection, the claim's)"
        )


async def _flushed_or_spoiled(session: Any, context: IdempotencyContext) -> None:
    """Before a response that cannot be held is settled (its first byte): what the session
    holds is written into the claim's transaction; or, when a flush of the handler's failed and
    it went on without `session.rollback()` (SQLAlchemy rolled the writes back), the claim's
    transaction is spoilt, as at the session's end: the settlement is refused, and the client
    gets `500 server-misconfigured`, not a stored answer claiming writes that were undone."""
    transaction = session.get_transaction()
    if transaction is not None and not transaction.is_active:
        await spoil(context)
        return
    await session.flush()


async def _committed(session: Any) -> bool:
    """Commit the session into the claim's transaction; False if a statement of the handler's
    failed there before (it caught the error and answered): the transaction is aborted."""
    try:
        await session.commit()
    except DBAPIError as exc:
        if not aborted(exc):
            raise
        return False
    return True


#: Aborts the claim's transaction on purpose (see `spoil`), saying why in the server's log.
_SPOIL = (
    "DO $$BEGIN RAISE EXCEPTION 'idem_middleware: the handler answered after a statement of its "
    "claim session failed; its outcome is not recorded'; END$$"
)


async def spoil(context: IdempotencyContext) -> None:
    """The handler answered after a statement of its session failed, and went on without
    `session.rollback()`. Its writes since its last `commit()` are gone (SQLAlchemy rolled them
    back, or the savepoint's end does), so an answer that is stored would claim what did not
    happen: the claim's transaction is aborted, as a failed statement on the claim's connection
    leaves it. A status that releases the key (409, 422) still reaches the client; one that is
    stored is refused (`SettlementRefused`: `500 server-misconfigured`, nothing committed)."""
    connection = await context.fenced_connection()
    if connection is None:
        return
    with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError):
        await connection.execute(_SPOIL)  # (InterfaceError: a stream's, given back already)


def aborted(exc: BaseException) -> bool:
    """Whether `exc` (SQLAlchemy's, raised from asyncpg's) says the transaction is aborted."""
    cause: BaseException | None = exc
    for _ in range(8):
        if cause is None:
            return False
        if isinstance(cause, asyncpg.exceptions.InFailedSQLTransactionError):
            return True
        cause = cause.__cause__ or getattr(cause, "orig", None)
    return False


_default: ClaimSessions | None = None


def _sessions() -> ClaimSessions:
    global _default
    if _default is None:
        _default = ClaimSessions()
    return _default


def claim_engine() -> AsyncEngine:
    """The shared claim engine (for `async_sessionmaker(claim_engine(), ...)` of your own)."""
    return _sessions().engine


def open_claim_session(
    request: Request | None = None,
) -> contextlib.AbstractAsyncContextManager[AsyncSession]:
    """`async with open_claim_session(request) as session:` (Starlette, jobs)."""
    return _sessions().session(request)


async def claim_session(request: Request) -> AsyncIterator[AsyncSession]:
    """FastAPI dependency: the request's AsyncSession in the claim's transaction."""
    async with open_claim_session(request) as session:
        yield session


try:
    from fastapi import Depends
except ImportError:  # Starlette without FastAPI: `open_claim_session` serves
    if not TYPE_CHECKING:  # (seen by a type checker, it made every name the module lacks `Any`)

        def __getattr__(name: str) -> Any:
            if name == "ClaimSession":  # `from idem_middleware.sqla import ClaimSession`
                raise ImportError(
                    "idem_middleware.sqla.ClaimSession is a FastAPI dependency and FastAPI is not"
                    " installed: pip install 'idem-middleware[fastapi,sqlalchemy]' (Starlette "
                    "alone: `async with open_claim_session(request) as session`)",
                    name="fastapi",
                )
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    #: `session: ClaimSession` in a FastAPI endpoint.
    ClaimSession = Annotated[AsyncSession, Depends(claim_session)]
