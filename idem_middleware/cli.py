"""`idem-middleware`: the operator's command line. A thin adapter over the store's functions.

Options go before or after the command; an option with an environment variable names it in its
help. `--json` makes any command's output machine-readable.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import asyncpg

from . import cli_commands as run
from . import cli_list, cli_reconcile
from .cli_values import (
    DSN_ENVS,
    StoreOnce,
    audit_note,
    checked_flag,
    common_options,
    env_default,
    env_flag,
    env_typed,
    lock_timeout_seconds,
    margin_seconds,
    positive_int,
    positive_seconds,
    terminate_as_interrupt,
    terminated,
    utf8_text,
)
from .errors import IdempotencyError
from .ops import Resolution
from .store.base import State
from .store.migrations import LOCK_TIMEOUT_SECONDS


def _version() -> str:
    try:
        return metadata.version("idem-middleware")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idem-middleware", description=__doc__, parents=[common_options(top=True)]
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version"
    )
    sub = common_options(top=False)
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="COMMAND --help for its options"
    )

    def command(name: str, help: str) -> argparse.ArgumentParser:
        cmd = commands.add_parser(name, help=help, description=help, parents=[sub])
        cmd.set_defaults(usage_parser=cmd)  # a UsageError shows this command's usage
        return cmd

    m = command("migrate", "apply the numbered schema migrations")
    m.add_argument(
        "--check",
        action="store_true",
        help="apply nothing; exit 0 if the schema is up to date, 1 if migrations are pending, "
        "2 if the check failed (cannot connect, a privilege missing ...)",
    )
    m.add_argument(
        "--lock-timeout",
        type=lock_timeout_seconds,
        default=env_typed("IDEM_MIGRATE_LOCK_TIMEOUT", LOCK_TIMEOUT_SECONDS),
        metavar="SECONDS",
        help="the longest a migration waits for a table that open transactions use, requests "
        "queueing behind it meanwhile; then nothing is applied and it exits 1 "
        f"(env IDEM_MIGRATE_LOCK_TIMEOUT, default {LOCK_TIMEOUT_SECONDS:g})",
    )

    p = command("purge", "delete finished records past their retention (never pending/unknown)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=env_typed("IDEM_PURGE_BATCH_SIZE", 1000),
        help="rows per delete transaction (env IDEM_PURGE_BATCH_SIZE, default 1000)",
    )
    p.add_argument(
        "--max-batches",
        type=positive_int,
        default=env_typed("IDEM_PURGE_MAX_BATCHES", 1000),
        help="stop after this many batches (env IDEM_PURGE_MAX_BATCHES, default 1000)",
    )

    st = command(
        "stats",
        "counts per state and the oldest unresolved record (--json also from IDEM_STATS_JSON=1)",
    )
    st.add_argument(
        "--unresolved",
        action="store_true",
        help="count pending and unknown records only, from their index: milliseconds whatever "
        "the table's size (without it every record and outbox event is counted, a read of both "
        "tables whole)",
    )

    ls = command("list", "list records, unresolved ones by default, oldest first")
    ls.add_argument(
        "--state",
        action="append",
        choices=[state.value for state in State],
        help="repeatable (default: pending and unknown)",
    )
    ls.add_argument(
        "--tenant",
        type=utf8_text,
        default=env_default("IDEM_TENANT"),
        help="one tenant only (env IDEM_TENANT)",
    )
    ls.add_argument(
        "--operation",
        type=utf8_text,
        default=env_default("IDEM_OPERATION"),
        help='one operation only, for example "POST /payouts" (env IDEM_OPERATION)',
    )
    ls.add_argument(
        "--stale",
        action="store_true",
        help="pending records only if their lease lapsed (other states are listed whole; "
        "refused with --state unless one is pending)",
    )
    ls.add_argument(
        "--limit", type=positive_int, default=100, help="at most this many (default 100)"
    )

    def record_options(cmd: argparse.ArgumentParser) -> None:
        cmd.register("action", None, StoreOnce)  # (its options given twice: exit 2)
        cmd.add_argument("--tenant", required=True, type=utf8_text, help="the record's tenant")
        cmd.add_argument(
            "--operation", required=True, type=utf8_text, help='for example "POST /payouts"'
        )
        cmd.add_argument(
            "--key",
            required=True,
            type=utf8_text,
            help="the Idempotency-Key, bare (payout-1) or quoted as the client sent it "
            '("payout-1")',
        )

    show = command("show", "one record, with its audit trail")
    record_options(show)

    r = command(
        "resolve",
        "settle an unknown record by hand, with an audit note; --again resolves a succeeded "
        "or failed_final one anew. No handler runs: succeeded/failed_final only store the "
        "response retries get",
    )
    record_options(r)
    r.add_argument(
        "--to",
        required=True,
        choices=[res.value for res in Resolution],
        help="succeeded: it happened (2xx/3xx); failed_final: it was refused (4xx); retry: it "
        "did not happen, the client's next retry runs it again (lease mode only)",
    )
    r.add_argument(
        "--note", required=True, type=audit_note, help="why: kept in the record's audit trail"
    )
    r.add_argument(
        "--status", type=int, help="succeeded/failed_final: the status retries get (required)"
    )
    r.add_argument("--body", type=utf8_text, help="succeeded/failed_final: the body retries get")
    r.add_argument(
        "--content-type",
        type=utf8_text,
        help="the body's content type (default application/json: the body must be JSON)",
    )
    r.add_argument(
        "--again",
        action="store_true",
        help="replace the outcome of a succeeded or failed_final record",
    )

    ro = command(
        "reopen",
        "turn a succeeded or failed_final record back to unknown, with an audit note: retries "
        "get 409 outcome-unknown until it is resolved by hand (never reconciled)",
    )
    record_options(ro)
    ro.add_argument(
        "--note", required=True, type=audit_note, help="why: kept in the record's audit trail"
    )

    o = command("outbox", "publish, list and requeue outbox events")
    outbox_commands = o.add_subparsers(
        dest="outbox_command", required=True, metavar="ACTION", help="ACTION --help for its options"
    )

    def action(name: str, help: str, actions: Any = None) -> argparse.ArgumentParser:
        cmd = (actions or outbox_commands).add_parser(
            name, help=help, description=help, parents=[sub]
        )
        cmd.set_defaults(usage_parser=cmd)
        return cmd

    def batch_options(cmd: argparse.ArgumentParser, what: str, max_batches: int) -> None:
        """`outbox purge`'s and `inbox purge`'s counts, each refused (exit 2) unless from 1."""
        each = f"{what} per delete statement (default 1000)"
        cmd.add_argument("--batch-size", type=positive_int, default=1000, help=each)
        cmd.add_argument(
            "--max-batches",
            type=positive_int,
            default=max_batches,
            help=f"stop after this many batches, saying so (default {max_batches})",
        )

    pub = action("publish", "send due events to a webhook until stopped (SIGTERM/SIGINT)")
    pub.add_argument(
        "--url", default=env_default("IDEM_OUTBOX_URL"), help="webhook URL (env IDEM_OUTBOX_URL)"
    )
    pub.add_argument(
        "--batch-size", type=positive_int, default=50, help="events per batch (default 50)"
    )
    pub.add_argument(
        "--max-attempts",
        type=positive_int,
        default=env_typed("IDEM_OUTBOX_MAX_ATTEMPTS", 8),
        help="park an event after this many failed sends (env IDEM_OUTBOX_MAX_ATTEMPTS)",
    )
    pub.add_argument(
        "--send-timeout",
        type=positive_seconds,
        default=10.0,
        help="seconds per send, more than 0 (default 10)",
    )
    pub.add_argument(
        "--reservation-margin",
        type=positive_seconds,
        default=5.0,
        help="an event being sent is reserved for --send-timeout plus this (more than 0, "
        "default 5); a publisher killed mid-send leaves it to be sent again after that",
    )
    pub.add_argument(
        "--idle-seconds",
        type=positive_seconds,
        default=1.0,
        help="pause when nothing is due, more than 0 (default 1)",
    )
    pub.add_argument("--once", action="store_true", help="publish one batch and exit")
    ol = action("list", "unsent events, oldest first")
    ol.add_argument("--parked", action="store_true", help="parked events only")
    ol.add_argument(
        "--limit", type=positive_int, default=100, help="at most this many (default 100)"
    )
    rq = action("requeue", "send parked events again")
    rq.add_argument(
        "event_ids",
        nargs="+",
        type=utf8_text,
        help="the ids of the parked events (exit 1 naming any id that was not one)",
    )

    op = action("purge", "delete events sent more than --older-than seconds ago")
    op.add_argument(
        "--older-than",
        type=margin_seconds,
        default=7 * 86400.0,
        help="seconds since an event was sent, 0 or more (default 604800: 7 days)",
    )
    batch_options(op, "events", 10_000)

    i = command("inbox", "purge consumers' inbox rows (what makes a redelivery a no-op)")
    inbox_commands = i.add_subparsers(
        dest="inbox_command", required=True, metavar="ACTION", help="ACTION --help for its options"
    )
    ip = action(
        "purge",
        "delete inbox rows recorded more than --older-than seconds ago: only once their events "
        "can no longer be redelivered, or a late redelivery is applied twice",
        inbox_commands,
    )
    ip.add_argument(
        "--older-than",
        type=margin_seconds,
        default=30 * 86400.0,
        help="seconds since a row was recorded, 0 or more (default 2592000: 30 days); more than "
        "the producer's `outbox purge --older-than` plus its longest redelivery delay",
    )
    batch_options(ip, "rows", 1000)

    c = command("reconcile", "run the reconcilers on unknown and lapsed records nobody retries")
    c.add_argument(
        "--app",
        default=env_default("IDEM_APP"),
        help="module:attribute of the Starlette/FastAPI app (or a factory) whose route "
        "policies name the reconcilers, imported from the current directory (env IDEM_APP)",
    )
    c.add_argument("--tenant", type=utf8_text, default=None, help="one tenant only")
    c.add_argument("--operation", type=utf8_text, default=None, help="one operation only")
    c.add_argument("--limit", type=positive_int, default=100, help="records per run (default 100)")
    c.add_argument(
        "--seconds",
        type=positive_seconds,
        default=10.0,
        help="bound on each reconciler call, more than 0 (default 10)",
    )
    c.add_argument(
        "--no-lifespan",
        dest="lifespan",
        action="store_false",
        help="do not run the app's lifespan around the reconcilers (by default its startup "
        "runs first and its shutdown last, as a server runs them)",
    )
    return parser


_HANDLERS = {
    "purge": run.purge,
    "stats": run.stats,
    "list": cli_list.list_records,
    "show": run.show,
    "resolve": run.resolve,
    "reopen": run.reopen,
    "reconcile": cli_reconcile.reconcile,
    "outbox": run.outbox,
    "inbox": run.inbox,
}


def _usage(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser of the command given, whose usage an error shows (the top-level one names
    none of the command's options)."""
    usage: argparse.ArgumentParser = getattr(args, "usage_parser", parser)
    return usage


def main(argv: Sequence[str] | None = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):
        # A terminal or pipe whose encoding cannot show a stored tenant (`é` under
        # PYTHONIOENCODING=ascii, a Latin-1 locale) gets `\xe9`, not a traceback midway.
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    usage = _usage(args, parser)  # (errors name the command's usage, not the top-level one's)
    if unknown:
        usage.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.json = checked_flag(usage, args.json)
    if args.command == "stats":
        args.json = checked_flag(usage, env_flag("IDEM_STATS_JSON")) or args.json
    if args.dsn == "":
        usage.error("--dsn is empty: pass a PostgreSQL URL, or leave --dsn out")
    if not args.dsn:
        usage.error(
            "no database: pass --dsn URL or set " + " or ".join(DSN_ENVS) + " (in that order)"
        )
    if sys.stdout is None:
        # Run as `idem-middleware stats >&-`: whatever the command did, its report would be
        # lost, and the flush below failed with a traceback after the command had acted.
        print("idem-middleware: standard output is closed; nothing was done", file=sys.stderr)
        return 2 if getattr(args, "check", False) else 1  # (`migrate --check`: not "pending")
    terminate_as_interrupt()
    try:
        try:
            if args.command == "migrate":
                return asyncio.run(run.migrate(args))
            return asyncio.run(run.with_store(args, _HANDLERS[args.command]))
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        # `idem-middleware list | head`: the reader has enough. Point stdout at /dev/null so the
        # interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        # Ctrl-C (a long `list`, say), or SIGTERM: a line, not a traceback. What was committed
        # stays so; the statement under way was cancelled.
        if terminated():
            print("idem-middleware: terminated", file=sys.stderr)
            return 143
        print("idem-middleware: interrupted", file=sys.stderr)
        return 130
    except run.UsageError as exc:
        # Exits 2, like any other bad argument, with the usage of the command that was given
        # (before: the top-level one, which names none of the command's options).
        usage.error(str(exc))
    except (IdempotencyError, OSError, asyncpg.PostgresError, ImportError, run.Interrupted) as exc:
        print(f"idem-middleware: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
