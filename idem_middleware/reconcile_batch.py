"""The operators' batch reconciliation (`idem-middleware reconcile`): lapsed leases turned
`unknown`, and unknown records settled by asking their reconcilers, in bounded passes that no
record another session holds can stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from .context import key_digest
from .errors import ClaimBusy, ConfigurationError, StatementRefused
from .fence import Verdict
from .policy import Policy, plainly_sync, seconds_option
from .reconcile import Reconciler
from .reconcile_bound import bounded_reconciler
from .store.base import RecordKey, RecordSummary, State, Store

logger = logging.getLogger("idem_middleware")

#: The most unknown records one `reconcile_unknown` looks at (every loop is bounded).
_MAX_SCANNED = 1_000_000
#: The largest `Happened` body stored for an operation `max_response_bytes` does not name.
_DEFAULT_CAP = Policy().max_response_bytes
#: The longest `reconcile_unknown` waits for a record another session holds (an executor's or a
#: reconciler's fenced transaction, or a process paused holding one) before passing it over.
_HELD_WAIT = 1.0

_T = TypeVar("_T")


class Held(Exception):
    """Another session held the record's row (the batch's move was refused, or waited for it
    longer than `_HELD_WAIT`)."""


async def unless_held(move: Awaitable[_T], seconds: float) -> _T:
    """`move`'s result, or Held when it waited `seconds` (for a row another session holds)."""
    try:
        async with asyncio.timeout(seconds):
            return await move
    except TimeoutError:
        raise Held from None


@dataclass
class ReconcileReport:
    examined: int = 0
    expired_leases: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    #: Operations that had unknown records but no reconciler.
    unreconcilable: dict[str, int] = field(default_factory=dict)
    #: Operations whose unknown records an operator reopened (transactional or lease-mode): no
    #: reconciler runs on them, since writes may have committed with their outcome (a
    #: `Happened` would repeat them); settle them with `resolve`.
    by_hand: dict[str, int] = field(default_factory=dict)
    #: Records passed over because another session held them (an executor or a reconciler at
    #: work, or a process paused while it held one): the next run looks at them again.
    held: int = 0
    #: Lapsed leases left pending because their operation is not among the caller's `known`
    #: ones: what its route does with a lapsed lease is not known here (see `reconcile_unknown`).
    left_pending: dict[str, int] = field(default_factory=dict)
    #: Records whose move the database refused (a constraint or trigger on idem_requests: the
    #: lapsed lease's `unknown` mark, a not-happened verdict's release): logged at ERROR, left
    #: as they are. The run goes on to the others (it stopped at the first, every run).
    refused: int = 0


def _checked(
    reconcilers: object, limit: object, seconds: object, names: Mapping[str, object]
) -> float:
    """`reconcile_unknown`'s arguments (ValueError, TypeError), before any statement: `seconds`
    of 0 or less made every reconciler that awaits anything fail, NaN gave them no bound; a
    negative `limit` did nothing; a plain function among the reconcilers was run, then failed,
    at every pass (`Policy(reconciler=...)` refuses one). `names` (`takeover`, `known`) are
    collections of operation names: one name as a str was read as its substrings (`"POST /pay"`
    in `"POST /payouts"`), a lapsed lease left pending and counted nowhere; a number failed at
    the first lapsed lease."""
    for name, value in names.items():
        if value is not None and (
            isinstance(value, str | bytes) or not isinstance(value, Collection)
        ):
            raise TypeError(
                f"{name} is a collection of operation names, not a {type(value).__name__}"
            )
    try:
        bound = seconds_option(seconds, "seconds", positive=True)
    except ConfigurationError as exc:
        raise ValueError(str(exc)) from None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < 2**63:
        raise ValueError(f"limit must be a whole number from 0, not {limit!r:.40}")
    if not isinstance(reconcilers, Mapping):
        raise TypeError(
            f"reconcilers maps operation names to reconcilers, not a {type(reconcilers).__name__}"
        )
    for name, reconciler in reconcilers.items():
        if not callable(reconciler) or plainly_sync(reconciler):
            raise TypeError(f"the reconciler of {name!r:.120} is not an async function")
    return bound


async def reconcile_unknown(
    store: Store,
    reconcilers: Mapping[str, Reconciler],
    *,
    tenant: str | None = None,
    operation: str | None = None,
    limit: int = 100,
    seconds: float = 10.0,
    takeover: Collection[str] = (),
    report: ReconcileReport | None = None,
    known: Collection[str] | None = None,
    max_response_bytes: Mapping[str, int] | None = None,
) -> ReconcileReport:
    """Settle unknown records (and pending ones whose lease lapsed) by asking their reconcilers.

    `Happened` settles the record; `NotHappened` lets the client's next retry run it again.
    Only lease-mode records are reconciled: transactional ones, and those an operator reopened,
    are counted in `by_hand`.
    `takeover` names the operations whose lapsed leases the client's retry takes over
    (`LeaseExpiry.TAKEOVER`): without a reconciler, theirs are left pending for it, since
    `unknown` would refuse that retry until an operator came. `known`, if given, names every
    operation whose policy the caller read (`takeover` among them): a lapsed lease of any other
    (a route behind a mount the caller cannot see into, another app's on the same database) is
    left pending and counted in `left_pending`, since its route may take it over.

    `report`, if given, is filled in as the run goes: a caller that the database fails partway
    (StoreError) still knows what was done.

    `max_response_bytes` maps operations to their policy's: a `Happened` body over it is refused
    (logged as an error, the record left unknown: `failed`), as is one over a `Policy`'s default
    for an operation it does not name.
    """
    seconds = _checked(reconcilers, limit, seconds, {"takeover": takeover, "known": known})
    caps = _caps(max_response_bytes)
    if report is None:
        report = ReconcileReport()
    elif not isinstance(report, ReconcileReport):  # (else it failed after the first move)
        raise TypeError(f"report is a ReconcileReport, not a {type(report).__name__}")
    # A record another session holds is passed over, not waited for: an executor holding its
    # fenced transaction past its lease, or paused with it, would stop the whole batch.
    held_wait = min(seconds, _HELD_WAIT)
    expiring = _Expiring(reconcilers, takeover, known)
    await _expire_leases(store, report, expiring, tenant, operation, limit, held_wait)
    # `limit` bounds the reconcilers run, not the records looked at: records no reconciler can
    # settle (transactional ones, operations without one) are passed over, oldest first, so that
    # however many of them wait for an operator they never keep the others from their turn.
    # Those asked and left unknown are stamped (`mark_asked`): the store lists them after the
    # ones not asked yet, so that however many of them a reconciler cannot tell about, they
    # never keep the others from theirs either (run after run, the batch takes them in turn).
    seen: set[RecordKey] = set()
    runs = 0
    # (A limit past `_MAX_SCANNED` looks at that many: the window never started past it, and the
    # run did nothing at all.)
    window = min(limit, _MAX_SCANNED)
    while runs < limit and window <= _MAX_SCANNED:
        unknown = await store.list_records(
            states=[State.UNKNOWN], tenant=tenant, operation=operation, limit=window
        )
        fresh = [summary for summary in unknown if summary.key not in seen]
        for summary in fresh:
            if runs == limit:
                break
            seen.add(summary.key)
            report.examined += 1
            op = summary.key.operation
            if summary.by_hand:
                report.by_hand[op] = report.by_hand.get(op, 0) + 1
                continue
            reconciler = reconcilers.get(op)
            if reconciler is None:
                report.unreconcilable[op] = report.unreconcilable.get(op, 0) + 1
                continue
            runs += 1
            try:
                cap = caps.get(op, _DEFAULT_CAP)
                verdict = await _reconcile_one(store, summary, reconciler, seconds, held_wait, cap)
            except Held:
                report.held += 1
                verdict = Verdict.HELD
            except StatementRefused as exc:
                _refused(report, exc, summary)
                verdict = Verdict.FAILED
            else:
                report.verdicts[verdict.value] = report.verdicts.get(verdict.value, 0) + 1
            if verdict in _LEFT_UNKNOWN:
                await _asked(store, summary)
        if not fresh or len(unknown) < window:
            break  # every unknown record has been looked at
        if window == _MAX_SCANNED:
            break  # the most one run looks at
        # Settled ones leave the list; the next window reaches past those passed over.
        window = min(len(seen) + limit, _MAX_SCANNED)
    return report


@dataclass(frozen=True)
class _Expiring:
    """Whose lapsed leases a run turns `unknown` (see `reconcile_unknown`)."""

    reconcilers: Mapping[str, Reconciler]
    takeover: Collection[str]
    known: Collection[str] | None


async def _expire_leases(
    store: Store,
    report: ReconcileReport,
    expiring: _Expiring,
    tenant: str | None,
    operation: str | None,
    limit: int,
    held_wait: float,
) -> None:
    """Turn lapsed leases `unknown`: at most `limit` tries (each may wait `held_wait`). Leases
    left for the client's takeover cost none, and the window reaches past them, so however many
    of them there are they never keep the others from their turn."""
    seen: set[RecordKey] = set()
    tries = 0
    window = min(limit, _MAX_SCANNED)
    while tries < limit and window <= _MAX_SCANNED:
        stale = await store.list_records(
            states=[State.PENDING],
            tenant=tenant,
            operation=operation,
            limit=window,
            stale_only=True,
        )
        fresh = [summary for summary in stale if summary.key not in seen]
        for summary in fresh:
            if tries == limit:
                break
            seen.add(summary.key)
            op = summary.key.operation
            if not summary.lease_expired:
                continue
            if expiring.known is not None and op not in expiring.known:
                report.left_pending[op] = report.left_pending.get(op, 0) + 1
                continue
            if op in expiring.takeover and op not in expiring.reconcilers:
                continue
            tries += 1
            try:
                move = store.expire_lease(summary.key, summary.generation)
                if await unless_held(move, held_wait):
                    report.expired_leases += 1
            except (Held, ClaimBusy):
                # (ClaimBusy: its executor's fenced transaction holds it, past its lease.)
                report.held += 1
            except StatementRefused as exc:
                _refused(report, exc, summary)
        if not fresh or len(stale) < window:
            break  # every lapsed lease has been looked at
        if window == _MAX_SCANNED:
            break  # the most one run looks at
        window = min(len(seen) + limit, _MAX_SCANNED)


#: The verdicts that leave the record unknown under the generation asked about.
_LEFT_UNKNOWN = frozenset({Verdict.STILL_UNKNOWN, Verdict.FAILED, Verdict.HELD})


async def _asked(store: Store, summary: RecordSummary) -> None:
    """Stamp the record asked about (see `Store.mark_asked`): a refusal of the database is
    logged, and the record is asked first again at the next run, as before the stamp."""
    try:
        await store.mark_asked(summary.key, summary.generation)
    except StatementRefused as exc:
        logger.warning(
            "idempotency: reconcile: the database refused to stamp a record asked about: %s",
            exc,
            extra=_fields(summary),
        )


def _refused(report: ReconcileReport, exc: StatementRefused, summary: RecordSummary) -> None:
    report.refused += 1
    logger.error(
        "idempotency: reconcile: the database refused a record's move: %s",
        exc,
        extra=_fields(summary),
    )


def _fields(summary: RecordSummary) -> dict[str, object]:
    """A record's log fields: never the raw key."""
    return {
        "tenant": summary.key.tenant,
        "operation": summary.key.operation,
        "key_digest": key_digest(summary.key.key),
        "generation": summary.generation,
    }


def _caps(caps: object) -> Mapping[str, int]:
    """`reconcile_unknown`'s `max_response_bytes` (TypeError, ValueError), before any statement."""
    if caps is None:
        return {}
    if not isinstance(caps, Mapping):
        raise TypeError(
            f"max_response_bytes maps operation names to sizes, not a {type(caps).__name__}"
        )
    for name, cap in caps.items():
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"the max_response_bytes of {name!r:.120} is a whole number from 0")
    return caps


async def _reconcile_one(
    store: Store,
    summary: RecordSummary,
    reconciler: Reconciler,
    seconds: float,
    held_wait: float,
    cap: int,
) -> Verdict:
    result = await bounded_reconciler(
        store,
        summary.key,
        summary.generation,
        reconciler,
        seconds=seconds,
        stuck_raises=True,  # (ReconcilersStuck: the batch stops, and says why)
        epoch=summary.epoch,
        held_wait=held_wait,
        by_hand=False,  # (read with the record: no second read)
        max_body_bytes=cap,
    )
    if result.verdict is Verdict.HELD:
        raise Held  # (another session held the record: its fenced connection was refused)
    if result.verdict is Verdict.NOT_HAPPENED:
        # (The line a retry's takeover writes, in an operator's move's format.)
        line = "reconciled unknown -> pending: not happened"
        retry = store.allow_retry(summary.key, summary.generation, line)
        if not await unless_held(retry, held_wait):
            return Verdict.CHANGED  # someone else moved it meanwhile
    return result.verdict
