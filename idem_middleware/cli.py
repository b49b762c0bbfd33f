"""`idem-middleware`: the operator's command line. A thin adapter over the store's functions.

Every option can also come from the environment variable shown in `--help`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence

import asyncpg

from .errors import StoreError
from .store.migrations import migrate, pending_versions
from .store.postgres import PostgresStore

_DSN_ENV = "IDEM_DATABASE_URL"


def _env_default(name: str, fallback: str | None = None) -> str | None:
    return os.environ.get(name, fallback)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="idem-middleware", description=__doc__)
    parser.add_argument(
        "--dsn",
        default=_env_default(_DSN_ENV, os.environ.get("DATABASE_URL")),
        help=f"PostgreSQL URL (env {_DSN_ENV}, then DATABASE_URL)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = commands.add_parser("migrate", help="apply the numbered schema migrations")
    m.add_argument(
        "--check",
        action="store_true",
        help="apply nothing; exit 1 if migrations are pending",
    )

    p = commands.add_parser(
        "purge", help="delete finished records past their retention (never pending/unknown)"
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=int(_env_default("IDEM_PURGE_BATCH_SIZE", "1000") or 1000),
        help="rows per delete transaction (env IDEM_PURGE_BATCH_SIZE, default 1000)",
    )
    p.add_argument(
        "--max-batches",
        type=_positive_int,
        default=int(_env_default("IDEM_PURGE_MAX_BATCHES", "1000") or 1000),
        help="stop after this many batches (env IDEM_PURGE_MAX_BATCHES, default 1000)",
    )

    s = commands.add_parser("stats", help="counts per state and the oldest unresolved record")
    s.add_argument(
        "--json",
        action="store_true",
        default=_env_default("IDEM_STATS_JSON", "") in {"1", "true", "yes"},
        help="machine-readable output for monitoring (env IDEM_STATS_JSON=1)",
    )
    return parser


async def _with_store(dsn: str, action: Callable[[PostgresStore], Awaitable[int]]) -> int:
    async with PostgresStore(dsn=dsn, min_size=1, max_size=2) as store:
        return await action(store)


async def _migrate(dsn: str, check: bool) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        if check:
            pending = await pending_versions(conn)
            print(f"pending migrations: {pending}" if pending else "schema is up to date")
            return 1 if pending else 0
        applied = await migrate(conn)
        print(f"applied migrations: {applied}" if applied else "schema is up to date")
        return 0
    finally:
        await conn.close()


async def _purge(store: PostgresStore, args: argparse.Namespace) -> int:
    deleted = await store.purge(batch_size=args.batch_size, max_batches=args.max_batches)
    print(f"purged {deleted} expired records")
    return 0


async def _stats(store: PostgresStore, args: argparse.Namespace) -> int:
    stats = await store.stats()
    if args.json:
        print(
            json.dumps(
                {
                    "counts": stats.counts,
                    "oldest_age_seconds": stats.oldest_age_seconds,
                    "oldest_unresolved_age_seconds": stats.oldest_unresolved_age_seconds,
                },
                sort_keys=True,
            )
        )
        return 0
    for state, count in stats.counts.items():
        age = stats.oldest_age_seconds[state]
        shown = "-" if age is None else f"{age:.0f}s"
        print(f"{state:<14}{count:>10}   oldest {shown}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error(f"no database: pass --dsn or set {_DSN_ENV}")
    try:
        if args.command == "migrate":
            return asyncio.run(_migrate(args.dsn, args.check))
        handler = {"purge": _purge, "stats": _stats}[args.command]
        return asyncio.run(_with_store(args.dsn, lambda store: handler(store, args)))
    except (StoreError, OSError, asyncpg.PostgresError) as exc:
        print(f"idem-middleware: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
