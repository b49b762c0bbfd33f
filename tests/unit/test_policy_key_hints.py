"""The hint a `policies` key that matches no route gets: the operation it most likely meant."""

from __future__ import annotations

import difflib

import pytest

from idem_middleware.startup import _meant

REACHABLE = {
    "POST /payments",
    "POST /admin/payouts",
    "PUT /admin/payouts",
    "POST /v2/admin/payouts",
}


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        # A mount's prefix left out: spelled closer to another route ("POST /payments"), it was
        # that one the hint named. The shortest of those that end with it, of its method.
        ("POST /payouts", "POST /admin/payouts"),
        ("PUT /payouts", "PUT /admin/payouts"),
    ],
)
def test_a_key_without_its_prefix_is_pointed_at_the_route_it_ends(name: str, meant: str) -> None:
    assert _meant(name, REACHABLE) == meant


def test_by_spelling_alone_the_mounted_route_was_not_named() -> None:
    assert difflib.get_close_matches("POST /payouts", sorted(REACHABLE), n=1) == ["POST /payments"]


@pytest.mark.parametrize(
    "name", ["post /payments", "POST /paymnts", "DELETE /payouts", "POST /", "POST /admin/payouts/"]
)
def test_otherwise_the_closest_spelling(name: str) -> None:
    close = difflib.get_close_matches(name, sorted(REACHABLE), n=1, cutoff=0.5)
    assert _meant(name, REACHABLE) == (close[0] if close else None)
