"""What each `idem-middleware` command does and prints (the parser is in cli.py).

Each command prints for a person by default and one JSON object (lists: one per line) with
`--json`. A UsageError is a bad argument (exit 2, with the usage); IdempotencyError, OSError and
database errors exit 1. Any other exception is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from . import app_lifespan
from . import outbox as outbox_ops
from .errors import StoreError
from .keys import parse_idempotency_key
from .ops import (
    Move,
    Resolution,
    collect_policies,
    operator_response,
    reconcile_unknown,
)
from .ops import reopen as reopen_record
from .ops import resolve as resolve_record
from .policy import LeaseExpiry, Mode
from .routing import routes_of
from .store.base import RecordKey, RecordSummary, State
from .store.migrations import migrate as apply_migrations
from .store.migrations import pending_versions
from .store.postgres import PostgresStore

Handler = Callable[[PostgresStore, argparse.Namespace], Awaitable[int]]


class UsageError(Exception):
    """An argument argparse could not check alone (it depends on another, or on an import):
    exit 2 with the message, like any other bad argument."""


def emit(args: argparse.Namespace, data: Mapping[str, Any], text: str) -> None:
    print(json.dumps(data, default=str, sort_keys=True) if args.json else text)


# No named prepared statements: the DSN may be PgBouncer's in transaction pooling mode, where
# a server connection keeps an earlier process's `__asyncpg_stmt_1__` and the next command's
# fails with "already exists". An operator's command runs a few statements; the cache saves
# nothing there.
_NO_STATEMENT_CACHE = 0


@contextlib.contextmanager
def _checked_dsn() -> Iterator[None]:
    """A DSN asyncpg cannot parse (`nonsense`, a port that is not a number, an unknown
    `sslmode`) is a bad argument, exit 2, not a traceback. asyncpg reports it as a ValueError
    (`ClientConfigurationError` is one too), which the store wraps in StoreError; a port out of
    range only when connecting, as the socket's OverflowError."""
    try:
        yield
    except StoreError as exc:
        if isinstance(exc.__cause__, ValueError | OverflowError):
            raise UsageError(f"--dsn: {exc.__cause__}") from None
        raise
    except (ValueError, OverflowError) as exc:
        raise UsageError(f"--dsn: {exc}") from None


async def with_store(args: argparse.Namespace, handler: Handler) -> int:
    store = PostgresStore(
        dsn=args.dsn, min_size=1, max_size=2, statement_cache_size=_NO_STATEMENT_CACHE
    )
    # `stats`, `list` and `show` work on a standby or as a read-only role; a command that
    # writes there fails with the server's own message.
    store._needs_writes = False
    with _checked_dsn():
        await store.open()
    try:
        return await handler(store, args)
    finally:
        await store.close()


async def migrate(args: argparse.Namespace) -> int:
    with _checked_dsn():
        conn = await asyncpg.connect(args.dsn, statement_cache_size=_NO_STATEMENT_CACHE)
    try:
        if args.check:
            pending = await pending_versions(conn)
            text = f"pending migrations: {pending}" if pending else "schema is up to date"
            emit(args, {"pending": pending}, text)
            return 1 if pending else 0
        applied = await apply_migrations(conn, lock_timeout=args.lock_timeout)
        text = f"applied migrations: {applied}" if applied else "schema is up to date"
        emit(args, {"applied": applied}, text)
        return 0
    finally:
        await conn.close()


async def purge(store: PostgresStore, args: argparse.Namespace) -> int:
    deleted = await store.purge(batch_size=args.batch_size, max_batches=args.max_batches)
    # Every batch was full: it stopped at its limit, and expired records may be left. Said
    # aloud, since a purge that deletes less each run than expires meanwhile never catches up.
    limited = deleted >= args.batch_size * args.max_batches
    emit(
        args, {"purged": deleted, "stopped_at_limit": limited}, f"purged {deleted} expired records"
    )
    if limited:
        print(
            f"purge stopped at --max-batches ({args.max_batches} batches of {args.batch_size}):"
            " expired records may be left. Run it again now, run it more often, or raise"
            " --max-batches (IDEM_PURGE_MAX_BATCHES): a purge that deletes less each run than"
            " expires between runs falls further behind every time.",
            file=sys.stderr,
        )
    return 0


async def stats(store: PostgresStore, args: argparse.Namespace) -> int:
    counts = await store.stats()
    events = await outbox_ops.outbox_stats(store.pool)
    if args.json:  # (or IDEM_STATS_JSON, read by the parser)
        data = {
            "counts": counts.counts,
            "oldest_age_seconds": counts.oldest_age_seconds,
            "oldest_unresolved_age_seconds": counts.oldest_unresolved_age_seconds,
            "outbox": events,
        }
        print(json.dumps(data, sort_keys=True))
        return 0
    for state, count in counts.counts.items():
        age = counts.oldest_age_seconds[state]
        shown = "-" if age is None else f"{age:.0f}s"
        print(f"{state:<14}{count:>10}   oldest {shown}")
    print(
        f"outbox        unsent {events['unsent']}  parked {events['parked']}  sent {events['sent']}"
    )
    return 0


def _row(rec: RecordSummary) -> dict[str, Any]:
    return {
        "tenant": rec.key.tenant,
        "operation": rec.key.operation,
        "key": rec.key.key,
        "state": rec.state.value,
        "generation": rec.generation,
        "mode": rec.mode,
        "updated_at": str(rec.updated_at),
        "lease_expired": rec.lease_expired,
        "response_status": rec.response_status,
        # The audit trail: one line per operator move (and the store's own notes), oldest first.
        "note": rec.note,
    }


async def list_records(store: PostgresStore, args: argparse.Namespace) -> int:
    states = args.state or ["pending", "unknown"]
    records = await store.list_records(
        states=[State(v) for v in states],
        tenant=args.tenant,
        operation=args.operation,
        limit=args.limit,
        stale_only=args.stale,
    )
    for rec in records:
        row = _row(rec)
        if args.json:
            print(json.dumps(row, sort_keys=True))
        else:
            # The audit trail's lines are joined so that one record stays one line.
            row["note"] = None if rec.note is None else " | ".join(rec.note.splitlines())
            print("  ".join(f"{k}={v}" for k, v in row.items() if v is not None))
    if not records and not args.json:
        where = "".join(
            f", {name} {value}"
            for name, value in (("tenant", args.tenant), ("operation", args.operation))
            if value
        )
        stale = "stale " if args.stale else ""
        print(f"no {stale}records in state {' or '.join(states)}{where}")
    return 0


def _key(args: argparse.Namespace) -> RecordKey:
    """The key bare, or quoted as the client sent it (an sf-string: `"payout-1"`)."""
    text = args.key
    if text.strip().startswith('"'):
        try:
            parsed = parse_idempotency_key([(b"idempotency-key", text.encode("latin-1"))])
        except Exception as exc:
            raise UsageError(f"--key {text}: {exc}") from None
        assert parsed is not None
        text = parsed
    return RecordKey(args.tenant, args.operation, text)


async def show(store: PostgresStore, args: argparse.Namespace) -> int:
    rec = await store.describe(_key(args))
    if rec is None:
        emit(args, {"found": False}, "no record holds this key")
        return 1
    row = _row(rec)
    row.update(
        created_at=str(rec.created_at),
        expires_at=None if rec.expires_at is None else str(rec.expires_at),
        lease_expires_at=None if rec.lease_expires_at is None else str(rec.lease_expires_at),
    )
    trail = [] if rec.note is None else rec.note.splitlines()
    if args.json:
        print(json.dumps({**row, "audit": trail}, sort_keys=True))
        return 0
    del row["note"]
    for name, value in row.items():
        if value is not None:
            print(f"{name:<16}{value}")
    print("audit trail" + ("" if trail else "     (empty)"))
    for line in trail:
        print(f"  {line}")
    return 0


_AFTER = {
    State.SUCCEEDED: "No business write was made: retries now get the stored response, but "
    "nothing ran. If the effect is missing, make it outside this command.",
    State.FAILED_FINAL: "No business write was made: retries now get the stored refusal.",
    State.PENDING: "The client's next retry with the same key and body runs the request again.",
    State.UNKNOWN: "Retries get 409 outcome-unknown until the record is resolved or reconciled.",
}


def _report(args: argparse.Namespace, verb: str, move: Move) -> None:
    status = "" if move.status is None else f" ({move.status})"
    emit(
        args,
        {
            "before": move.before.value,
            "after": move.after.value,
            "status": move.status,
            "business_write": False,
            "message": _AFTER[move.after],
        },
        f"{verb}: {move.before.value} -> {move.after.value}{status}\n{_AFTER[move.after]}",
    )


async def resolve(store: PostgresStore, args: argparse.Namespace) -> int:
    to = Resolution(args.to)
    key = _key(args)
    response = None
    if to is not Resolution.RETRY:
        if args.status is None:
            raise UsageError("--status is required to resolve to succeeded or failed_final")
        try:  # what retries would be served is checked before the record is read
            response = operator_response(to, args.status, args.body.encode(), args.content_type)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    move = await resolve_record(store, key, to, note=args.note, response=response, again=args.again)
    _report(args, "resolved", move)
    return 0


async def reopen(store: PostgresStore, args: argparse.Namespace) -> int:
    _report(args, "reopened", await reopen_record(store, _key(args), note=args.note))
    return 0


def load_app(spec: str) -> Any:
    """Import `module:attribute` as uvicorn does: from the current directory first."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"--app {spec!r} is not module:attribute")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(
            f"--app {spec}: cannot import {module_name!r} (from {os.getcwd()}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    target = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"--app {spec}: module {module_name!r} has no {attribute!r}") from None
    if routes_of(target) is None and callable(target):  # a factory (not an app behind wrappers)
        try:
            target = target()
        except Exception as exc:
            raise UsageError(
                f"--app {spec}: calling {attribute!r} failed: {type(exc).__name__}: {exc}"
            ) from None
    if routes_of(target) is None:  # nothing to find reconcilers in: not a silent no-op
        raise UsageError(
            f"--app {spec}: {type(target).__name__} is not a Starlette or FastAPI app "
            "(nor a factory of one)"
        )
    return target


async def reconcile(store: PostgresStore, args: argparse.Namespace) -> int:
    if not args.app:
        raise UsageError("reconcile needs --app (or IDEM_APP) to find the reconcilers")
    app = load_app(args.app)
    policies = collect_policies(app)
    try:
        # Its reconcilers use what its lifespan opens (a client, a pool), as they do when served.
        async with app_lifespan.running(app) if args.lifespan else contextlib.nullcontext():
            report = await reconcile_unknown(
                store,
                {name: p.reconciler for name, p in policies.items() if p.reconciler is not None},
                tenant=args.tenant,
                operation=args.operation,
                limit=args.limit,
                seconds=args.seconds,
                takeover=[
                    name
                    for name, p in policies.items()
                    if p.mode is Mode.LEASE and p.on_lease_expiry is LeaseExpiry.TAKEOVER
                ],
            )
    except app_lifespan.LifespanFailed as exc:
        raise UsageError(f"--app {args.app}: {exc}") from None
    data = {
        "examined": report.examined,
        "expired_leases": report.expired_leases,
        "verdicts": report.verdicts,
        "unreconcilable": report.unreconcilable,
        "by_hand": report.by_hand,
        "held": report.held,
    }
    lines = [
        f"examined {report.examined} unknown records; "
        f"{report.expired_leases} lapsed leases turned unknown"
    ]
    lines += [f"  {verdict}: {n}" for verdict, n in sorted(report.verdicts.items())]
    if report.held:
        lines.append(f"  held by another session, passed over (run again later): {report.held}")
    lines += [f"  no reconciler for {op}: {n}" for op, n in sorted(report.unreconcilable.items())]
    lines += [
        f"  transactional, not reconciled (settle with resolve) for {op}: {n}"
        for op, n in sorted(report.by_hand.items())
    ]
    emit(args, data, "\n".join(lines))
    return 0


async def outbox(store: PostgresStore, args: argparse.Namespace) -> int:
    if args.outbox_command == "list":
        events = await outbox_ops.list_events(store.pool, parked_only=args.parked, limit=args.limit)
        for event in events:
            print(json.dumps(event, default=str, sort_keys=True))
        if not events and not args.json:
            print("no parked events" if args.parked else "no unsent events")
        return 0
    if args.outbox_command == "requeue":
        requeued = await outbox_ops.requeue(store.pool, args.event_ids)
        emit(args, {"requeued": requeued}, f"requeued {requeued} parked events")
        return 0
    if not args.url:
        raise UsageError("outbox publish needs --url (or IDEM_OUTBOX_URL)")
    url = urlsplit(args.url)
    if url.scheme not in ("http", "https") or not url.hostname:
        # Else every send fails, each a counted attempt, until every due event is parked.
        raise UsageError(f"--url {args.url!r} is not an http:// or https:// URL with a host")
    import httpx  # the extra `httpx`; only the webhook publisher needs it

    async with httpx.AsyncClient(timeout=args.send_timeout) as client:
        publisher = outbox_ops.Publisher(
            store.pool,
            outbox_ops.webhook_sender(client, args.url),
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
    # Always one JSON line: scripts read the publisher's report.
    print(json.dumps({"sent": report.sent, "failed": report.failed, "parked": report.parked}))
    return 0
