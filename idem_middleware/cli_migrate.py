"""`idem-middleware migrate --check`: whether migrations are pending, for a deploy script.

Its exit status tells the three answers apart: 0 the schema is up to date, 1 migrations are
pending, and CHECK_FAILED when the check itself failed (the server cannot be reached or refuses
the role, a privilege is missing, the migrations table is damaged, anything else). It exited 1
for those too, so "run migrate" and "something is broken" looked alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import asyncpg

from .cli_connect import NO_STATEMENT_CACHE, UsageError, connecting
from .cli_values import json_line
from .errors import IdempotencyError
from .store.migrations import pending_versions

#: The exit status of a check that could not tell (as grep and diff exit 2 on trouble; a bad
#: argument exits 2 too).
CHECK_FAILED = 2

#: What a check fails with that its message says enough about (anything else is a bug: its
#: traceback is printed too).
_KNOWN = (IdempotencyError, OSError, asyncpg.PostgresError)


async def check(args: argparse.Namespace) -> int:
    """0 up to date, 1 pending, CHECK_FAILED when it cannot tell (said on stderr; with --json,
    `{"pending": null, "error": ...}` on stdout)."""
    try:
        with connecting(args.dsn):
            conn = await asyncpg.connect(args.dsn, statement_cache_size=NO_STATEMENT_CACHE)
        try:
            pending = await pending_versions(conn)
        finally:
            await conn.close()
    except UsageError:  # (a DSN that is not one: exit 2 with the usage, as for every command)
        raise
    except Exception as exc:
        if not isinstance(exc, _KNOWN):
            traceback.print_exc()
        if args.json:
            print(json_line({"pending": None, "error": str(exc)}))
        print(f"idem-middleware: {exc}", file=sys.stderr)  # (as every command says it)
        return CHECK_FAILED
    text = f"pending migrations: {pending}" if pending else "schema is up to date"
    print(json.dumps({"pending": pending}) if args.json else text)
    return 1 if pending else 0
