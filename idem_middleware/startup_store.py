"""What the middleware's startup checks of its store: that it is open, in the event loop that
serves the app, and, for a store given a pool of the app's own and never opened, what its
`open()` would have checked."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from starlette.types import Message, Receive, Scope, Send

from .errors import OPEN_IN_LIFESPAN, OTHER_LOOP, ConfigurationError
from .routing import app_below

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware

logger = logging.getLogger("idem_middleware")


def unopened_store(mw: IdempotencyMiddleware) -> ConfigurationError | None:
    """When the app's lifespan startup completes: a store still not open, or open in another
    event loop than the one serving the app (`asyncio.run(store.open())` before the server
    starts, a test fixture's store), would answer every guarded request 503 (logged; None when
    it is open here, or the middleware is switched off)."""
    if not mw.enabled:
        return None
    if not getattr(mw.store, "is_open", True):
        error = ConfigurationError(
            f"the app's lifespan startup completed without opening the store: {OPEN_IN_LIFESPAN}"
        )
    elif getattr(mw.store, "in_another_loop", False):
        error = ConfigurationError(f"the app's lifespan startup completed, but {OTHER_LOOP}")
    else:
        return None
    logger.error("idempotency: %s", error)
    return error


async def store_startup_error(mw: IdempotencyMiddleware) -> ConfigurationError | None:
    """What the app's lifespan startup fails with, once the app's own startup completed:
    `unopened_store`, then `given_pool_error`."""
    error = unopened_store(mw) or await given_pool_error(mw, lifespan=True)
    if error is None:
        _warn_tenant_cap(mw)
    return error


def _warn_tenant_cap(mw: IdempotencyMiddleware) -> None:
    """A `max_tenant_connections` not below the store's pool size bounds nothing: one tenant
    can still hold every connection, which the option exists to prevent (said nowhere)."""
    limit = mw.tenant_slots.limit
    if limit is None or not mw.enabled:
        return
    try:
        size = mw.store.pool.get_max_size()  # type: ignore[attr-defined]
    except Exception:  # (no pool: a MemoryStore, a store of the app's own)
        return
    if isinstance(size, int) and limit >= size:
        logger.warning(
            "idempotency: max_tenant_connections=%d is not below the store's pool size "
            "(max_size=%d): one tenant can still hold every connection. Set it below %d, or "
            "give the pool more connections",
            limit,
            size,
            size,
        )


async def given_pool_error(
    mw: IdempotencyMiddleware, lifespan: bool = False
) -> ConfigurationError | None:
    """For a store given a pool and never opened (`PostgresStore(pool=...)`, which counts as
    open), the checks its `open()` runs, once: a database never migrated, a role that may not
    write, a pooler that breaks prepared statements, each failed every guarded request (a 500)
    while the app started. Their ConfigurationError, as `open()` raises it (logged); the pool
    stays the app's, open. A server that cannot be reached or answer now is no reason to
    refuse (as for `open()`): logged, and the checks are skipped. (None for any other store.)"""
    check = getattr(mw.store, "check_given_pool", None)
    if not mw.enabled or check is None:
        return None
    try:
        await check(lifespan=lifespan)
    except ConfigurationError as exc:
        logger.error("idempotency: %s", exc)
        return exc
    except Exception as exc:
        # (Any other error too, a driver's own, a lock past the role's `lock_timeout`, say: a
        # check that cannot run now is no verdict, and a request that waited for it is not
        # failed for it. `open()` checks again if it is called.)
        logger.warning("idempotency: cannot check the store's pool now: %r", exc)
    return None


async def checked_first(
    mw: IdempotencyMiddleware, scope: Scope, receive: Receive, send: Send
) -> None:
    """The check of a first request (no lifespan ran it) whose coroutine was made outside a
    running loop (`asyncio.run(app(...))`, a sync bridge's thread), in the loop that runs it:
    made then, the check found no asyncio loop, and failed every request."""
    if not mw._checked:
        mw._check(app_below(mw, scope.get("app")), scope)
    await type(mw).__call__(mw, scope, receive, send)


async def checked_lifespan(
    mw: IdempotencyMiddleware, scope: Scope, receive: Receive, send: Send
) -> None:
    """The app's lifespan, with the middleware's checks: the app's (`startup.check_app`) when the
    server starts it, the store's (`store_startup_error`) once the app's own startup completed.
    A failed check fails the startup."""
    failed = False

    async def checked_receive() -> Message:
        nonlocal failed
        message = await receive()
        if message["type"] == "lifespan.startup":
            if not mw._checked:
                mw._check(app_below(mw, scope.get("app")))
            if mw._check_error is not None:  # (a second lifespan too: still misconfigured)
                failed = True
                await send(
                    {
                        "type": "lifespan.startup.failed",
                        "message": f"idem_middleware: {mw._check_error}",
                    }
                )
                raise mw._failed_check()
        elif message["type"] == "lifespan.shutdown":
            await _unwound(mw)
        return message

    async def quiet_send(message: Message) -> None:
        nonlocal failed
        if message["type"] == "lifespan.startup.complete":
            error = await store_startup_error(mw)
            if error is not None:
                failed = True  # the app's lifespan did not open the store, or its checks failed
                await send(
                    {"type": "lifespan.startup.failed", "message": f"idem_middleware: {error}"}
                )
                raise error
            mw._store_check = True
        elif message["type"].startswith("lifespan.shutdown"):  # (the app's own shutdown is over)
            await _released(mw)
        # After our startup.failed, the app's own report of the same failure is not sent.
        if not (failed and message["type"].startswith("lifespan.startup")):
            await send(message)

    await mw.app(scope, checked_receive, quiet_send)


async def _unwound(mw: IdempotencyMiddleware) -> None:
    """At the app's lifespan shutdown, before the app's own (which may close the pool a store
    was given): the store's cancelled lease-mode executions settle first. Never raised."""
    unwind = getattr(mw.store, "let_cancelled_unwind", None)
    if unwind is None or not mw.enabled:
        return
    try:
        await unwind()
    except Exception:
        logger.warning("idempotency: cancelled executions did not settle", exc_info=True)


async def _released(mw: IdempotencyMiddleware) -> None:
    """At the app's lifespan shutdown: a given pool's store lets its own connections go (see
    `release_given_pool`), and a request served without a lifespan after it checks it again.
    Never raised: the server gets the shutdown's own message whatever happens here."""
    release = getattr(mw.store, "release_given_pool", None)
    if release is None or not mw.enabled:
        return
    try:
        await release()
    except Exception:
        logger.warning("idempotency: the store's own connections did not close", exc_info=True)
    mw._store_check = None


async def store_checked(
    mw: IdempotencyMiddleware, scope: Scope, receive: Receive, send: Send
) -> None:
    """No lifespan startup checked the store (`given_pool_error`): the first requests wait for
    its check (one, shared), and a failed one fails every request, as a failed startup check
    does; then the request goes on through the middleware."""
    check = mw._store_check
    if check is None or (check is not True and check.done() and not _verdict(check)):
        # (Never started, or it ended without a verdict: cancelled with the loop that ran it,
        # say. Awaited again, that one would fail every request after it for good.)
        check = mw._store_check = asyncio.ensure_future(given_pool_error(mw))
    if check is not True:
        error = await asyncio.shield(check)
        mw._store_check = True
        if error is not None and mw._check_error is None:
            mw._check_error = error
    await mw(scope, receive, send)


def _verdict(check: asyncio.Future[ConfigurationError | None]) -> bool:
    """Whether a finished check came to a verdict (None or an error), not cancelled or raised."""
    return not check.cancelled() and check.exception() is None
