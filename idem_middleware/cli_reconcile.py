"""`idem-middleware reconcile`: import the app, run its reconcilers (reconcile_batch.py) inside
its lifespan, report (the parser is in cli.py)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import sys
from typing import Any, NoReturn

from . import app_lifespan
from .cli_commands import DATABASE_ERRORS, emit, stopped
from .cli_connect import UsageError
from .cli_list import printable
from .errors import IdempotencyError
from .ops import ReconcileReport, collect_policies, reconcile_unknown
from .policy import LeaseExpiry, Mode
from .reconcile_bound import abandoned
from .routing import routes_of
from .store.postgres import PostgresStore


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
    if inspect.isawaitable(target):  # (an async factory's: never awaited, Python warned)
        if inspect.iscoroutine(target):
            target.close()
        raise UsageError(f"--app {spec}: {attribute!r} is an async factory; name the app")
    if routes_of(target) is None:  # nothing to find reconcilers in: not a silent no-op
        raise UsageError(
            f"--app {spec}: {type(target).__name__} is not a Starlette or FastAPI app "
            "(nor a factory of one)"
        )
    return target


async def reconcile(store: PostgresStore, args: argparse.Namespace) -> int:
    try:
        code = await _reconciled(store, args)
    except BaseException as exc:
        if abandoned():
            _leave(exc)
        raise
    if abandoned():
        _leave(None)
    return code


def _leave(exc: BaseException | None) -> NoReturn:
    """Exit now, leaving the reconciler runs that ignored their cancellation (`reconcile_bound`,
    each logged at ERROR): closing the store waited for their connections, then asyncio.run for
    their tasks, for good. The process's end drops their connections: the server rolls their
    fenced transactions back, and their records stay unknown. Exit 1 (130 if interrupted)."""
    interrupted = exc is not None and not isinstance(exc, Exception)
    if exc is not None:
        print(f"idem-middleware: {'interrupted' if interrupted else exc}", file=sys.stderr)
    print(
        f"idem-middleware: {abandoned()} reconciler runs ignored their cancellation and still "
        "run: exiting without waiting for them (their fenced transactions roll back)",
        file=sys.stderr,
    )
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(130 if interrupted else 1)


async def _reconciled(store: PostgresStore, args: argparse.Namespace) -> int:
    if not args.app:
        raise UsageError("reconcile needs --app (or IDEM_APP) to find the reconcilers")
    app = load_app(args.app)
    policies = collect_policies(app)
    report = ReconcileReport()  # (filled in as it goes: a run the database fails reports it)
    try:
        # Its reconcilers use what its lifespan opens (a client, a pool), as they do when served.
        async with app_lifespan.running(app) if args.lifespan else contextlib.nullcontext():
            await reconcile_unknown(
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
                report=report,
                known=set(policies),
                max_response_bytes={n: p.max_response_bytes for n, p in policies.items()},
            )
    except app_lifespan.LifespanFailed as exc:
        raise UsageError(f"--app {args.app}: {exc}") from None
    except (IdempotencyError, *DATABASE_ERRORS) as exc:
        # Each record is settled (or not) in its own fenced transaction: nothing is half done,
        # and the next run looks at what is still unknown.
        done = (
            f"examining {report.examined} unknown records ({_verdicts(report)}) and turning "
            f"{report.expired_leases} lapsed leases unknown; run it again"
        )
        stopped(args, _reconcile_data(report), done, exc)
    data = _reconcile_data(report)
    lines = [
        f"examined {report.examined} unknown records; "
        f"{report.expired_leases} lapsed leases turned unknown"
    ]
    lines += [f"  {verdict}: {n}" for verdict, n in sorted(report.verdicts.items())]
    if report.held:
        lines.append(f"  held by another session, passed over (run again later): {report.held}")
    # (Operation names as stored: behind a mount the router cannot see into, a client's path.)
    lines += [
        f"  no reconciler for {printable(op)}: {n}"
        for op, n in sorted(report.unreconcilable.items())
    ]
    lines += [
        f"  reopened, not reconciled (settle with resolve) for {printable(op)}: {n}"
        for op, n in sorted(report.by_hand.items())
    ]
    lines += [
        f"  lapsed leases left pending, {printable(op)} not in --app: {n}"
        for op, n in sorted(report.left_pending.items())
    ]
    emit(args, data, "\n".join(lines))
    return 0


def _reconcile_data(report: ReconcileReport) -> dict[str, Any]:
    return {
        "examined": report.examined,
        "expired_leases": report.expired_leases,
        "verdicts": report.verdicts,
        "unreconcilable": report.unreconcilable,
        "by_hand": report.by_hand,
        "held": report.held,
        "left_pending": report.left_pending,
    }


def _verdicts(report: ReconcileReport) -> str:
    shown = ", ".join(f"{verdict} {n}" for verdict, n in sorted(report.verdicts.items()))
    # (Not "no reconciler ran": the one whose record the store failed under may have run.)
    return shown or "no verdict reached"
