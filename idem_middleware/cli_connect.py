"""How `idem-middleware` commands reach the database: the first connection's errors, each
command's store (the parser is in cli.py, the commands in cli_commands.py)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

import asyncpg

from .errors import ConfigurationError, RetryableConflict, StatementRefused, StoreClosed, StoreError
from .store.postgres import PostgresStore
from .store.postgres.convert import (
    ACQUIRE_ERRORS,
    CANCELLED,
    LOCK_NOT_AVAILABLE,
    READ_ONLY,
    RETRYABLE,
)

Handler = Callable[[PostgresStore, argparse.Namespace], Awaitable[int]]


class UsageError(Exception):
    """An argument argparse could not check alone (it depends on another, or on an import):
    exit 2 with the message, like any other bad argument."""


# No named prepared statements: the DSN may be PgBouncer's in transaction pooling mode, where
# a server connection keeps an earlier process's `__asyncpg_stmt_1__` and the next command's
# fails with "already exists". An operator's command runs a few statements; the cache saves
# nothing there.
NO_STATEMENT_CACHE = 0


#: What a failed attempt to connect raises besides the store's own connection errors: the
#: server refusing the role, its password or the database.
_REFUSED: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
    asyncpg.exceptions.InvalidCatalogNameError,
)


def shown_dsn(dsn: str) -> str:
    """The DSN as a message shows it: without a password, in its user part or its query."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "the database"
    user, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{user.partition(':')[0]}@{hosts}" if at else parts.netloc
    query = "&".join(
        f"{unquote(item.partition('=')[0])}=***"
        if unquote(item.partition("=")[0]).lower() in ("password", "sslpassword")
        else item
        for item in parts.query.split("&")
        if item
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


@contextlib.contextmanager
def connecting(dsn: str) -> Iterator[None]:
    """Around a command's first connection.

    A DSN asyncpg cannot parse (`nonsense`, a port that is not a number, an unknown
    `sslmode`) is a bad argument, exit 2, not a traceback. asyncpg reports it as a ValueError
    (`ClientConfigurationError` is one too), which the store wraps in ConfigurationError; a port
    out of range only when connecting, as the socket's OverflowError.

    A database that cannot be reached, or that refuses the role or does not exist, is one line
    for every command alike, naming the DSN tried (its password left out): `migrate` connects
    without the store and said only "[Errno 2] No such file or directory".
    """
    named = getattr(dsn, "env", "--dsn")  # (the variable it came from: cli_values._FromEnv)
    try:
        yield
    except (StoreError, ConfigurationError) as exc:
        cause = exc.__cause__
        if isinstance(cause, ValueError | OverflowError):
            raise UsageError(f"{named}: {cause}") from None
        if isinstance(cause, ACQUIRE_ERRORS):
            raise _cannot_connect(dsn, cause) from None
        raise
    except (ValueError, OverflowError) as exc:
        raise UsageError(f"{named}: {exc}") from None
    except (*ACQUIRE_ERRORS, *_REFUSED) as exc:
        raise _cannot_connect(dsn, exc) from None


#: What a command that stopped partway may meet again and get past by running once more.
_PASSING = (*ACQUIRE_ERRORS, *RETRYABLE, RetryableConflict, CANCELLED, LOCK_NOT_AVAILABLE)


def run_again(exc: BaseException) -> str:
    """What to do about a command the database stopped partway: run it again (a connection
    lost, a lock or statement timeout, a conflict), or first fix what the error names (a
    privilege the role lacks, a table missing: the same run fails the same way), or run it where
    the database takes writes (a standby, or a role whose sessions are read-only, fails alike)."""
    if isinstance(exc, READ_ONLY) or isinstance(exc.__cause__, READ_ONLY):
        return "run it again where the database takes writes (the primary, a role that may write)"
    passing = isinstance(exc, _PASSING) or (
        isinstance(exc, StoreError) and not isinstance(exc, StatementRefused | StoreClosed)
    )
    return "run it again" if passing else "fix what failed (below), then run it again"


def _cannot_connect(dsn: str, exc: BaseException) -> StoreError:
    return StoreError(f"cannot connect to {shown_dsn(dsn)}: {str(exc) or type(exc).__name__}")


async def with_store(args: argparse.Namespace, handler: Handler) -> int:
    # No LISTEN: a command never waits for a notification (and the DSN may be PgBouncer's).
    store = PostgresStore(
        dsn=args.dsn,
        min_size=1,
        max_size=2,
        statement_cache_size=NO_STATEMENT_CACHE,
        listen=False,
    )
    # `stats`, `list` and `show` work on a standby or as a read-only role; a command that
    # writes there fails with the server's own message.
    store._needs_writes = False
    with connecting(args.dsn):
        await store.open()
    try:
        return await handler(store, args)
    finally:
        await store.close()
