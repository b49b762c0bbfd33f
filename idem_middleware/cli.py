"""`idem-middleware`: the operator's command line. A thin adapter over the store's functions.

Every option can also come from the environment variable shown in `--help`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg

from . import outbox
from .errors import IdempotencyError
from .ops import Resolution, collect_reconcilers, reconcile_unknown, resolve
from .store.base import RecordKey, State, StoredResponse
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
    ls = commands.add_parser("list", help="list records, unresolved ones by default")
    ls.add_argument(
        "--state",
        action="append",
        choices=[state.value for state in State],
        help="repeatable (default: pending and unknown)",
    )
    ls.add_argument("--tenant", default=_env_default("IDEM_TENANT"), help="env IDEM_TENANT")
    ls.add_argument(
        "--operation", default=_env_default("IDEM_OPERATION"), help="env IDEM_OPERATION"
    )
    ls.add_argument(
        "--stale", action="store_true", help="pending records only if their lease lapsed"
    )
    ls.add_argument("--limit", type=_positive_int, default=100)
    ls.add_argument("--json", action="store_true", help="one JSON object per line")

    r = commands.add_parser("resolve", help="move an unknown record by hand, with an audit note")
    r.add_argument("--tenant", required=True)
    r.add_argument("--operation", required=True, help='for example "POST /payouts"')
    r.add_argument("--key", required=True, help="the Idempotency-Key as the client sent it")
    r.add_argument("--to", required=True, choices=[res.value for res in Resolution])
    r.add_argument("--note", required=True, help="why: kept on the record for the audit")
    r.add_argument("--status", type=int, help="succeeded/failed_final: the status to replay")
    r.add_argument("--body", default="", help="succeeded/failed_final: the body to replay")
    r.add_argument("--content-type", default="application/json")

    o = commands.add_parser("outbox", help="publish, list and requeue outbox events")
    outbox_commands = o.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    pub = outbox_commands.add_parser(
        "publish", help="send due events to a webhook until stopped (SIGTERM/SIGINT)"
    )
    pub.add_argument(
        "--url", default=_env_default("IDEM_OUTBOX_URL"), help="webhook URL (env IDEM_OUTBOX_URL)"
    )
    pub.add_argument("--batch-size", type=_positive_int, default=50)
    pub.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=int(_env_default("IDEM_OUTBOX_MAX_ATTEMPTS", "8") or 8),
        help="park an event after this many failed sends (env IDEM_OUTBOX_MAX_ATTEMPTS)",
    )
    pub.add_argument("--send-timeout", type=float, default=10.0)
    pub.add_argument(
        "--reservation-margin",
        type=float,
        default=5.0,
        help="an event being sent is reserved for --send-timeout plus this; a publisher killed "
        "mid-send leaves it to be sent again after that",
    )
    pub.add_argument("--idle-seconds", type=float, default=1.0)
    pub.add_argument("--once", action="store_true", help="publish one batch and exit")
    ol = outbox_commands.add_parser("list", help="unsent events, oldest first")
    ol.add_argument("--parked", action="store_true", help="parked events only")
    ol.add_argument("--limit", type=_positive_int, default=100)
    rq = outbox_commands.add_parser("requeue", help="send parked events again")
    rq.add_argument("event_ids", nargs="+")

    c = commands.add_parser(
        "reconcile", help="run the reconcilers on unknown and lapsed records nobody retries"
    )
    c.add_argument(
        "--app",
        default=_env_default("IDEM_APP"),
        help="module:attribute of the Starlette/FastAPI app (or a factory) whose route "
        "policies name the reconcilers (env IDEM_APP)",
    )
    c.add_argument("--tenant", default=None)
    c.add_argument("--operation", default=None)
    c.add_argument("--limit", type=_positive_int, default=100)
    c.add_argument("--seconds", type=float, default=10.0, help="bound on each reconciler call")
    return parser


def _load_app(spec: str) -> Any:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not attribute:
        raise ValueError(f"--app {spec!r} is not module:attribute")
    target = getattr(importlib.import_module(module_name), attribute)
    return target() if callable(target) and not hasattr(target, "router") else target


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
    events = await outbox.outbox_stats(store.pool)
    if args.json:
        print(
            json.dumps(
                {
                    "counts": stats.counts,
                    "oldest_age_seconds": stats.oldest_age_seconds,
                    "oldest_unresolved_age_seconds": stats.oldest_unresolved_age_seconds,
                    "outbox": events,
                },
                sort_keys=True,
            )
        )
        return 0
    for state, count in stats.counts.items():
        age = stats.oldest_age_seconds[state]
        shown = "-" if age is None else f"{age:.0f}s"
        print(f"{state:<14}{count:>10}   oldest {shown}")
    print(
        f"outbox        unsent {events['unsent']}  parked {events['parked']}  sent {events['sent']}"
    )
    return 0


async def _outbox(store: PostgresStore, args: argparse.Namespace) -> int:
    if args.outbox_command == "list":
        for event in await outbox.list_events(
            store.pool, parked_only=args.parked, limit=args.limit
        ):
            print(json.dumps(event, default=str, sort_keys=True))
        return 0
    if args.outbox_command == "requeue":
        print(f"requeued {await outbox.requeue(store.pool, args.event_ids)} parked events")
        return 0
    if not args.url:
        raise ValueError("outbox publish needs --url (or IDEM_OUTBOX_URL)")
    import httpx  # the extra `httpx`; only the webhook publisher needs it

    async with httpx.AsyncClient(timeout=args.send_timeout) as client:
        publisher = outbox.Publisher(
            store.pool,
            outbox.webhook_sender(client, args.url),
            batch_size=args.batch_size,
            max_attempts=args.max_attempts,
            send_timeout_seconds=args.send_timeout,
            reservation_margin_seconds=args.reservation_margin,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        report = await publisher.run(
            stop=stop, batches=1 if args.once else None, idle_seconds=args.idle_seconds
        )
    print(json.dumps({"sent": report.sent, "failed": report.failed, "parked": report.parked}))
    return 0


async def _list(store: PostgresStore, args: argparse.Namespace) -> int:
    states = [State(v) for v in (args.state or ["pending", "unknown"])]
    records = await store.list_records(
        states=states,
        tenant=args.tenant,
        operation=args.operation,
        limit=args.limit,
        stale_only=args.stale,
    )
    for rec in records:
        row = {
            "tenant": rec.key.tenant,
            "operation": rec.key.operation,
            "key": rec.key.key,
            "state": rec.state.value,
            "generation": rec.generation,
            "mode": rec.mode,
            "updated_at": str(rec.updated_at),
            "lease_expired": rec.lease_expired,
            "response_status": rec.response_status,
            "note": rec.note,
        }
        if args.json:
            print(json.dumps(row, sort_keys=True))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items() if v is not None))
    return 0


async def _resolve(store: PostgresStore, args: argparse.Namespace) -> int:
    to = Resolution(args.to)
    response = None
    if to is not Resolution.RETRY:
        if args.status is None:
            raise ValueError("--status is required to resolve to succeeded or failed_final")
        headers = [(b"content-type", args.content_type.encode())] if args.body else []
        response = StoredResponse(args.status, headers, args.body.encode())
    key = RecordKey(args.tenant, args.operation, args.key)
    await resolve(store, key, to, note=args.note, response=response)
    print(f"resolved to {to.value}")
    return 0


async def _reconcile(store: PostgresStore, args: argparse.Namespace) -> int:
    if not args.app:
        raise ValueError("reconcile needs --app (or IDEM_APP) to find the reconcilers")
    reconcilers = collect_reconcilers(_load_app(args.app))
    report = await reconcile_unknown(
        store,
        reconcilers,
        tenant=args.tenant,
        operation=args.operation,
        limit=args.limit,
        seconds=args.seconds,
    )
    print(
        json.dumps(
            {
                "examined": report.examined,
                "expired_leases": report.expired_leases,
                "verdicts": report.verdicts,
                "unreconcilable": report.unreconcilable,
            },
            sort_keys=True,
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error(f"no database: pass --dsn or set {_DSN_ENV}")
    try:
        if args.command == "migrate":
            return asyncio.run(_migrate(args.dsn, args.check))
        handler = {
            "purge": _purge,
            "stats": _stats,
            "list": _list,
            "resolve": _resolve,
            "reconcile": _reconcile,
            "outbox": _outbox,
        }[args.command]
        return asyncio.run(_with_store(args.dsn, lambda store: handler(store, args)))
    except ValueError as exc:
        parser.error(str(exc))  # exits 2, like any other bad argument
    except (IdempotencyError, OSError, asyncpg.PostgresError, ImportError) as exc:
        print(f"idem-middleware: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
