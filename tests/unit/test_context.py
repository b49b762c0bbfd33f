"""context.py: the outcome a status means, the downstream key, and the context a handler sees."""

from __future__ import annotations

import dataclasses

import pytest

from idem_middleware import IdempotencyContext, Mode, Outcome, derive_downstream_key
from idem_middleware.context import (
    RELEASE_STATUSES,
    claimed_context,
    key_digest,
    outcome_for_status,
)
from idem_middleware.errors import ConfigurationError
from idem_middleware.reconcile import ReconcileContext


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, Outcome.SUCCEEDED), (201, Outcome.SUCCEEDED), (303, Outcome.SUCCEEDED)]
    + [(status, Outcome.RELEASE) for status in sorted(RELEASE_STATUSES)]
    + [(402, Outcome.FAILED_FINAL), (410, Outcome.FAILED_FINAL), (451, Outcome.FAILED_FINAL)],
)
def test_outcome_for_status_below_500(status: int, outcome: Outcome, mode: Mode) -> None:
    assert outcome_for_status(status, mode) is outcome


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_5xx_releases_in_transactional_mode_and_is_unknown_in_lease_mode(status: int) -> None:
    # The transaction rolled back with the 5xx; a lease-mode effect elsewhere may have happened.
    assert outcome_for_status(status, Mode.TRANSACTIONAL) is Outcome.RELEASE
    assert outcome_for_status(status, Mode.LEASE) is Outcome.UNKNOWN


def test_the_downstream_key_is_stable_per_key_space_and_epoch() -> None:
    key = derive_downstream_key("tenant-a", "POST /payouts", "k1", 7)
    assert key == derive_downstream_key("tenant-a", "POST /payouts", "k1", 7)
    assert len(key) == 64
    assert int(key, 16) >= 0
    others = {
        derive_downstream_key("tenant-b", "POST /payouts", "k1", 7),
        derive_downstream_key("tenant-a", "POST /refunds", "k1", 7),
        derive_downstream_key("tenant-a", "POST /payouts", "k2", 7),
        derive_downstream_key("tenant-a", "POST /payouts", "k1", 8),
        derive_downstream_key("tenant-a", "POST /payouts", "k1"),
    }
    assert key not in others
    assert len(others) == 5


def test_the_downstream_key_cannot_be_forged_by_moving_a_separator() -> None:
    """The parts are length-prefixed: ("a|b", "c") and ("a", "b|c") are different key spaces."""
    assert derive_downstream_key("a|b", "c", "k") != derive_downstream_key("a", "b|c", "k")
    assert derive_downstream_key("t", "op", "k1", 1) != derive_downstream_key("t", "op", "k", 11)


def _context(**changes: object) -> IdempotencyContext:
    fields: dict[str, object] = {
        "tenant": "tenant-a",
        "operation": "POST /payouts",
        "key": "k1",
        "generation": 3,
        "mode": Mode.LEASE,
        "connection": None,
        "epoch": 2,
    }
    fields.update(changes)
    return IdempotencyContext(**fields)  # type: ignore[arg-type]


def test_the_contexts_downstream_key_is_derived_lazily_from_the_epoch() -> None:
    ctx = _context()
    assert ctx._downstream_key is None, "derived before anyone asked"
    expected = derive_downstream_key("tenant-a", "POST /payouts", "k1", 2)
    assert ctx.downstream_key == expected
    assert ctx._downstream_key == expected
    # The generation (a takeover's fencing token) never changes it; the epoch does.
    assert _context(generation=9).downstream_key == expected
    assert _context(epoch=5).downstream_key != expected
    assert _context(epoch=None).downstream_key == derive_downstream_key(
        "tenant-a", "POST /payouts", "k1"
    )


def test_declare_and_fencing_token() -> None:
    ctx = _context()
    assert ctx.fencing_token == 3
    ctx.declare(Outcome.UNKNOWN)
    assert ctx.declared is Outcome.UNKNOWN
    transactional = _context(mode=Mode.TRANSACTIONAL)
    with pytest.raises(ConfigurationError):
        transactional.declare(Outcome.UNKNOWN)
    transactional.declare(Outcome.FAILED_FINAL)
    assert transactional.declared is Outcome.FAILED_FINAL


async def test_fenced_connection_is_the_claims_connection_in_transactional_mode() -> None:
    conn = object()
    assert await _context(mode=Mode.TRANSACTIONAL, connection=conn).fenced_connection() is conn


@pytest.mark.parametrize("mode", list(Mode))
def test_a_claimed_context_is_the_context_its_keywords_make(mode: Mode) -> None:
    """The middleware's builder (no keyword dict) makes what the class called with the same
    keywords makes, every field included (a field added to the class without a default breaks
    the builder, and this test)."""

    async def fence() -> None:
        return None

    connection = object()
    built = claimed_context("tenant-a", "POST /payouts", "k1", 3, mode, connection, 2, fence)
    expected = _context(mode=mode, connection=connection, _fence=fence)
    assert type(built) is IdempotencyContext
    for f in dataclasses.fields(IdempotencyContext):
        assert getattr(built, f.name) is getattr(expected, f.name), f.name
    assert claimed_context("t", "op", "k", 1, mode, None, None)._fence is None


def test_a_context_shown_or_logged_names_its_key_by_digest_only() -> None:
    """Raw keys may carry personal data: a context in a log line or a traceback shows the key's
    digest (the one the middleware's own logs use), never the key."""
    raw = "alice@example.com/order-77"
    ctx = _context(key=raw)
    for shown in (repr(ctx), str(ctx), f"{ctx}", f"{ctx}"):
        assert raw not in shown
        assert key_digest(raw) in shown
        assert "POST /payouts" in shown
        assert "generation=3" in shown


def test_a_reconcile_context_shown_or_logged_omits_the_raw_key() -> None:
    raw = "alice@example.com/order-77"

    async def fence() -> None:
        return None

    ctx = ReconcileContext(
        tenant="t",
        operation="POST /payouts",
        key=raw,
        downstream_key="d" * 64,
        generation=2,
        _fence=fence,
    )
    assert raw not in repr(ctx)
    assert "d" * 64 in repr(ctx)
    assert ctx.key == raw  # the reconciler still has it
