"""What each `idem-middleware` command does and prints (the parser is in cli.py).

Each command prints for a person by default and one JSON object (lists: one per line) with
`--json`. A UsageError is a bad argument (exit 2, with the usage); IdempotencyError, OSError and
database errors exit 1. Any other exception is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import asyncpg

from . import cli_migrate
from . import outbox as outbox_ops
from .cli_connect import NO_STATEMENT_CACHE, connecting, run_again
from .cli_connect import UsageError as UsageError
from .cli_connect import with_store as with_store
from .cli_list import printable
from .cli_list import row as record_row
from .cli_values import json_line, operation_hint, shown_age, webhook_httpx
from .context import derive_downstream_key
from .errors import IdempotencyError, ResolveError
from .inbox import purge_inbox
from .keys import parse_idempotency_key
from .ops import NOT_FOUND, RUNNING, Move, Resolution, operator_response, running
from .ops import reopen as reopen_record
from .ops import resolve as resolve_record
from .store.base import RecordKey, State
from .store.migrations import migrate as apply_migrations
from .store.postgres import PostgresStore


def emit(args: argparse.Namespace, data: Mapping[str, Any], text: str) -> None:
    print(json_line(data) if args.json else text)


class Interrupted(Exception):
    """The database failed a command partway: the message says what was done (exit 1)."""


#: What the database (or the way to it) fails a command with besides IdempotencyError: a
#: statement the server refuses (a privilege the role lacks), a connection lost. A command that
#: commits as it goes says what it did first (`stopped`), whichever it was.
DATABASE_ERRORS = (asyncpg.PostgresError, OSError)


async def migrate(args: argparse.Namespace) -> int:
    if args.check:  # (exit 0 up to date, 1 pending, 2 when it cannot tell)
        return await cli_migrate.check(args)
    with connecting(args.dsn):
        conn = await asyncpg.connect(args.dsn, statement_cache_size=NO_STATEMENT_CACHE)
    try:
        applied = await apply_migrations(conn, lock_timeout=args.lock_timeout)
        text = f"applied migrations: {applied}" if applied else "schema is up to date"
        emit(args, {"applied": applied}, text)
        return 0
    finally:
        await conn.close()


def stopped(
    args: argparse.Namespace, data: dict[str, Any], done: str, exc: Exception, name: str = ""
) -> NoReturn:
    """A command (`name`, else the command's) the database failed partway: its report so far
    (stdout, with --json), and one line saying what was done and what failed (stderr, through
    main). Exit 1."""
    if args.json:
        print(json_line({**data, "error": str(exc)}))
    raise Interrupted(f"{name or args.command} stopped after {done}: {exc}") from exc


async def purge(store: PostgresStore, args: argparse.Namespace) -> int:
    left: list[str] = []  # (the tokens or waiters whose batches stopped at --max-batches)

    def purging(progress: Callable[[int], None]) -> Awaitable[int]:
        size, most, limited = args.batch_size, args.max_batches, left.append
        return store.purge(batch_size=size, max_batches=most, progress=progress, on_limit=limited)

    return await _batches(
        args, "purge", "expired records", purging, " (IDEM_PURGE_MAX_BATCHES)", "expires", left
    )


async def inbox(store: PostgresStore, args: argparse.Namespace) -> int:
    return await _aged(store, args, purge_inbox, "inbox purge", "inbox rows", "is recorded")


async def _aged(
    store: PostgresStore,
    args: argparse.Namespace,
    purge: Callable[..., Awaitable[int]],
    name: str,
    what: str,
    grows: str,
) -> int:
    """`outbox purge` and `inbox purge`: `purge` (`purge_sent`, `purge_inbox`) of the rows older
    than --older-than, in batches, reported as `purge`'s."""

    def purging(progress: Callable[[int], None]) -> Awaitable[int]:
        age, size, most = args.older_than, args.batch_size, args.max_batches
        return purge(
            store, older_than_seconds=age, batch_size=size, max_batches=most, progress=progress
        )

    return await _batches(args, name, what, purging, "", grows)


#: What else `purge` deletes in batches, named as its stderr names it.
_OTHERS = {"tokens": "expired tokens", "waiters": "waits of dead processes"}


async def _batches(
    args: argparse.Namespace,
    name: str,
    what: str,
    purging: Callable[[Callable[[int], None]], Awaitable[int]],
    env: str,
    grows: str,
    left: Sequence[str] = (),
) -> int:
    """A purge in batches, each committed on its own: how many `what` it deleted, and whether
    it stopped at --max-batches (said on stderr too; `left`: what else stopped there, filled
    by `purging`). Failed partway, what it did first."""
    progress = [0]

    def committed(deleted: int) -> None:
        progress[0] = deleted

    try:
        deleted = await purging(committed)
    except (IdempotencyError, *DATABASE_ERRORS) as exc:
        # Each batch committed on its own: what was deleted stays deleted, the rest is for the
        # next run.
        done = f"deleting {progress[0]} {what} (each batch is committed; {run_again(exc)})"
        stopped(args, {"purged": progress[0], "stopped_at_limit": False}, done, exc, name)
    # Every batch was full: it stopped at its limit, and rows may be left. Said aloud, since a
    # purge that deletes less each run than expires meanwhile never catches up.
    at_limit = [what] if deleted >= args.batch_size * args.max_batches else []
    at_limit += [_OTHERS[other] for other in left]
    limited = bool(at_limit)
    emit(args, {"purged": deleted, "stopped_at_limit": limited}, f"purged {deleted} {what}")
    if limited:
        print(
            f"{name} stopped at --max-batches ({args.max_batches} batches of {args.batch_size}):"
            f" {' and '.join(at_limit)} may be left. Run it again now, run it more often, or raise"
            f" --max-batches{env}: a purge that deletes less each run than {grows} between"
            " runs falls further behind every time.",
            file=sys.stderr,
        )
    return 0


async def stats(store: PostgresStore, args: argparse.Namespace) -> int:
    counts = await store.stats(unresolved_only=args.unresolved)
    # (the outbox's counts read it whole too: not in the cheap mode)
    events = None if args.unresolved else await outbox_ops.outbox_stats(store.pool)
    if args.json:  # (or IDEM_STATS_JSON, read by the parser)
        data = {
            "counts": counts.counts,
            "oldest_age_seconds": counts.oldest_age_seconds,
            "oldest_unresolved_age_seconds": counts.oldest_unresolved_age_seconds,
            "lapsed_leases": counts.lapsed_leases,
        }
        print(json_line(data if events is None else {**data, "outbox": events}))
        return 0
    for state, count in counts.counts.items():
        print(f"{state:<14}{count:>10}   oldest {shown_age(counts.oldest_age_seconds[state])}")
    print(f"{'lapsed leases':<14}{counts.lapsed_leases:>10}")
    if events is not None:
        print(
            f"outbox        unsent {events['unsent']}  parked {events['parked']}  "
            f"sent {events['sent']}"
        )
    return 0


def _key(args: argparse.Namespace) -> RecordKey:
    """The key bare, or quoted as the client sent it (an sf-string: `"payout-1"`)."""
    # (Bare, as the header's value: the spaces and tabs around it are not the key's, and a
    # header never gives a key that starts or ends with one.)
    text = args.key.strip(" \t")
    if text.startswith('"'):
        try:
            parsed = parse_idempotency_key([(b"idempotency-key", text.encode("latin-1"))])
        except Exception as exc:
            raise UsageError(f"--key {text}: {exc}") from None
        assert parsed is not None
        text = parsed
    return RecordKey(args.tenant, args.operation, text)


async def show(store: PostgresStore, args: argparse.Namespace) -> int:
    rec = await store.describe(key := _key(args))
    if rec is None:  # (or not yet: a transactional request running it has none until it commits)
        busy = await running(store, key)
        text = (RUNNING if busy else NOT_FOUND) + operation_hint(args.operation)
        emit(args, {"found": False, "running": busy}, text)
        return 1
    row = record_row(rec)
    row.update(
        created_at=str(rec.created_at),
        expires_at=None if rec.expires_at is None else str(rec.expires_at),
        lease_expires_at=None if rec.lease_expires_at is None else str(rec.lease_expires_at),
        epoch=rec.epoch,  # (and the key a reconciler, or an operator, asks downstream about)
        downstream_key=derive_downstream_key(*rec.key, rec.epoch),
    )
    trail = [] if rec.note is None else rec.note.splitlines()
    if args.json:
        print(json_line({**row, "audit": trail}))
        return 0
    del row["note"]
    for name, value in row.items():
        if value is not None:
            print(f"{name:<16}{printable(str(value))}")
    print("audit trail" + ("" if trail else "     (empty)"))
    for line in trail:
        print(f"  {printable(line)}")
    return 0


_AFTER = {
    State.SUCCEEDED: "No business write was made: retries now get the stored response, but "
    "nothing ran. If the effect is missing, make it outside this command.",
    State.FAILED_FINAL: "No business write was made: retries now get the stored refusal.",
    State.PENDING: "The client's next retry with the same key and body runs the request again.",
    State.UNKNOWN: "Retries get 409 outcome-unknown until the record is resolved by hand (a "
    "reopened record is never reconciled: writes may have committed with its outcome).",
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


_RESPONSE_OPTIONS = {"--status": "status", "--body": "body", "--content-type": "content_type"}


async def resolve(store: PostgresStore, args: argparse.Namespace) -> int:
    to = Resolution(args.to)
    key = _key(args)
    response = None
    given = [opt for opt, value in _RESPONSE_OPTIONS.items() if getattr(args, value) is not None]
    if to is Resolution.RETRY and given:
        # Else they were dropped without a word: the record released for a re-run, not settled.
        raise UsageError(f"--to retry stores no response: {', '.join(given)} cannot go with it")
    if to is not Resolution.RETRY:
        if args.status is None:
            raise UsageError("--status is required to resolve to succeeded or failed_final")
        if args.content_type is not None and args.body is None:  # (else dropped, unchecked)
            raise UsageError("--content-type names the type of --body: give the body too")
        body = b"" if args.body is None else args.body.encode()
        content_type = "application/json" if args.content_type is None else args.content_type
        try:  # what retries would be served is checked before the record is read
            response = operator_response(to, args.status, body, content_type)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    with _hinted(args):
        move = await resolve_record(
            store, key, to, note=args.note, response=response, again=args.again
        )
    _report(args, "resolved", move)
    return 0


async def reopen(store: PostgresStore, args: argparse.Namespace) -> int:
    with _hinted(args):
        move = await reopen_record(store, _key(args), note=args.note)
    _report(args, "reopened", move)
    return 0


@contextlib.contextmanager
def _hinted(args: argparse.Namespace) -> Iterator[None]:
    """A record not found under an operation not named as operations are: the message says how
    they are named (`post /refunds` said only "no record holds this key")."""
    try:
        yield
    except ResolveError as exc:
        hint = operation_hint(args.operation)
        if not hint:
            raise
        raise ResolveError(f"{exc}{hint}") from exc


_EMPTY = '""'  # an empty id, shown
_NOT_REQUEUED = {"unknown": "no such event", "unsent": "not parked", "sent": "already sent"}


async def _requeue(store: PostgresStore, args: argparse.Namespace) -> int:
    """Exit 1 unless every id named was a parked event now requeued: a mistyped id, or an event
    sent meanwhile, was counted as nothing ("requeued 0 parked events", exit 0)."""
    outcomes = await outbox_ops.requeue_each(store.pool, args.event_ids)
    requeued = [event_id for event_id, outcome in outcomes.items() if outcome == "requeued"]
    refused = {event_id: o for event_id, o in outcomes.items() if o != "requeued"}
    lines = [f"requeued {len(requeued)} parked events"] + [
        f"not requeued: {printable(event_id) or _EMPTY} ({_NOT_REQUEUED[outcome]})"
        for event_id, outcome in refused.items()
    ]
    data = {"requeued": len(requeued), "requeued_ids": requeued, "not_requeued": refused}
    emit(args, data, "\n".join(lines))
    return 1 if refused else 0


async def outbox(store: PostgresStore, args: argparse.Namespace) -> int:
    if args.outbox_command == "list":
        events = await outbox_ops.list_events(store.pool, parked_only=args.parked, limit=args.limit)
        for event in events:
            print(json_line(event))
        if not events and not args.json:
            print("no parked events" if args.parked else "no unsent events")
        return 0
    if args.outbox_command == "requeue":
        return await _requeue(store, args)
    if args.outbox_command == "purge":
        purge = outbox_ops.purge_sent
        return await _aged(store, args, purge, "outbox purge", "sent events", "is sent")
    if not args.url:
        raise UsageError("outbox publish needs --url (or IDEM_OUTBOX_URL)")
    httpx = webhook_httpx(args.url)  # (the extra `httpx`, and a URL it can send to)

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
        report = outbox_ops.PublishReport()  # (filled in as it goes: a failed batch reports it)
        once = 1 if args.once else None
        running = asyncio.ensure_future(
            publisher.run(stop=stop, batches=once, idle_seconds=args.idle_seconds, report=report)
        )
        forced: list[int] = []

        def signalled(signum: int) -> None:
            # The first stops after the batch under way; a second (Ctrl-C twice) at once: a
            # send to a webhook that never answers held the first for all of --send-timeout.
            if stop.is_set():
                forced.append(signum)
                running.cancel()
            stop.set()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, signalled, signum)
        try:
            await running
        except (IdempotencyError, *DATABASE_ERRORS) as exc:
            # `--once` whose batch the database failed (a run without it retries): exit 1, not
            # a report of nothing due. What it sent is marked; an event being sent when it
            # failed stays reserved and is sent again once that lapses.
            print(json.dumps({**_counts(report), "error": str(exc)}))
            done = f"sending {report.sent} events (failed {report.failed}, parked {report.parked})"
            again = run_again(exc)
            raise Interrupted(f"outbox publish stopped after {done}; {again}: {exc}") from exc
        except asyncio.CancelledError:
            if not forced:
                raise
            print(
                "idem-middleware: stopped at once (signalled twice); an event being sent stays "
                "reserved, and is sent again once --send-timeout plus --reservation-margin lapse",
                file=sys.stderr,
            )
            return 143 if forced[-1] == signal.SIGTERM else 130
    # Always one JSON line: scripts read the publisher's report.
    print(json.dumps(_counts(report)))
    return 0


def _counts(report: outbox_ops.PublishReport) -> dict[str, int]:
    return {"sent": report.sent, "failed": report.failed, "parked": report.parked}
