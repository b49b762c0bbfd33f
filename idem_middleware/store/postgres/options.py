"""PostgresStore's options, checked when the store is made: one that would be ignored, or read
as what it does not say, is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import ConfigurationError

#: The pool options of a store that makes its own pool (in `PostgresStore`'s order), and their
#: defaults.
_POOL_OPTIONS = (
    ("min_size", 2),
    ("max_size", 10),
    ("statement_cache_size", 100),
    ("application_name", "idem_middleware"),
    ("connect_kwargs", None),
)


def check_dsn(dsn: Any, option: str = "dsn") -> None:
    """A DSN is a non-blank string: `""` connected to libpq's defaults (localhost, the PG*
    variables) without a word, and a number failed only at `open()`, naming no option. What
    it is instead is named by its type alone: a URL object's repr holds its password."""
    if dsn is None or (isinstance(dsn, str) and dsn.strip()):
        return
    what = repr(dsn) if isinstance(dsn, str) else f"a {type(dsn).__name__}"
    hint = "" if isinstance(dsn, str) else " (a settings library's URL: pass str(url))"
    raise ConfigurationError(f"PostgresStore({option}=...) is a PostgreSQL URL, not {what}{hint}")


def check_pool(pool: Any, opening: bool = False) -> None:
    """A pool is an asyncpg pool (a connection or a DSN given as one failed at `open()` with an
    AttributeError), and by the store's `open()` an awaited one: one never awaited
    (`asyncpg.create_pool(...)` without `await`) passed the startup, and every guarded request
    was a 503 ("pool is not initialized")."""
    if pool is None:
        return
    if not callable(getattr(pool, "acquire", None)):
        raise ConfigurationError(
            f"PostgresStore(pool=...) is an asyncpg pool, not a {type(pool).__name__} (for a "
            "DSN, pass dsn=...)"
        )
    if opening and getattr(pool, "_initialized", True) is False:
        raise ConfigurationError(
            "PostgresStore(pool=...) was given a pool never awaited, and opened: "
            "pool = await asyncpg.create_pool(...)"
        )


def check_store_options(pool: Any, listen: Any, fast_path: Any, made: tuple[Any, ...]) -> None:
    """`listen` and `fast_path` are booleans ("false", a str, was true); a store given a pool
    takes none of the options that make one (its size, statement cache, name and connect
    arguments were dropped without a word: `statement_cache_size=0`, which PgBouncer needs,
    among them): the pool is made with them instead."""
    for name, value in (("listen", listen), ("fast_path", fast_path)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"PostgresStore({name}=...) is True or False, not {value!r}")
    if pool is None:
        _check_sizes(*made[:3])
        if made[4] is not None and not isinstance(made[4], Mapping):  # (a bare TypeError, else)
            raise ConfigurationError(
                f"PostgresStore(connect_kwargs=...) is a dict of asyncpg's options, not a "
                f"{type(made[4]).__name__}"
            )
        return
    given = [
        name for (name, default), value in zip(_POOL_OPTIONS, made, strict=True) if value != default
    ]
    if given:
        raise ConfigurationError(
            f"PostgresStore(pool=...) takes no {', '.join(given)}: they make a pool, and this "
            "one is made already (pass them to asyncpg.create_pool, or give the store a dsn)"
        )


def _check_sizes(min_size: Any, max_size: Any, statement_cache_size: Any) -> None:
    """The pool's sizes are whole numbers asyncpg takes (`max_size=2.5` was a bare TypeError,
    `min_size > max_size` or `max_size=0` a ValueError, each only at `open()`)."""
    for name, value, least in (
        ("min_size", min_size, 0),
        ("max_size", max_size, 1),
        ("statement_cache_size", statement_cache_size, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigurationError(
                f"PostgresStore({name}=...) is a whole number of at least {least}, not {value!r}"
            )
    if min_size > max_size:
        raise ConfigurationError(
            f"PostgresStore(min_size={min_size}) is more than max_size={max_size}: the pool "
            "opens min_size connections and never holds more than max_size"
        )
