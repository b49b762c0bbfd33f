"""exchange.header_map: a request's headers read through one dict when that reads them exactly
as the scans do (a list of lower-case names, none repeated), and through the scans otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.errors import RequestRejected
from idem_middleware.keys import KEY_HEADER, header_map, parse_idempotency_key, parse_key_value

PLAIN = [(b"host", b"h"), (b"content-type", b"application/json"), (b"idempotency-key", b"k1")]


def test_a_list_of_distinct_lower_case_names_is_read_through_a_dict() -> None:
    by_name = header_map({"headers": PLAIN})
    assert by_name == dict(PLAIN)
    assert parse_key_value(by_name[KEY_HEADER]) == parse_idempotency_key(PLAIN) == "k1"


@pytest.mark.parametrize(
    "headers",
    [
        [*PLAIN, (b"content-type", b"text/plain")],  # a repeated name: the scans take the first
        [(b"Host", b"h"), (b"idempotency-key", b"k1")],  # a name not in lower case
        [(b"host", b"h", b"extra")],  # not pairs
        [(b"1", b"2")],  # no letter at all: nothing says the names are lower case
    ],
)
def test_anything_else_is_left_to_the_scans(headers: Any) -> None:
    assert header_map({"headers": headers}) is None


@pytest.mark.parametrize("made", [tuple, iter, lambda pairs: (pair for pair in pairs)])
def test_any_other_iterable_is_made_a_list_in_the_scope_once(made: Any) -> None:
    """ASGI's headers are any iterable: a one-shot one, read by each reader on the way (the
    key, the body's headers, the fingerprint), reached the app empty. Found by probing."""
    scope = {"headers": made(PLAIN)}
    assert header_map(scope) == dict(PLAIN)
    assert scope["headers"] == PLAIN


def test_a_key_repeated_in_another_case_is_still_refused() -> None:
    headers = [(b"idempotency-key", b"k1"), (b"Idempotency-Key", b"k2")]
    assert (
        header_map({"headers": headers}) is None
    )  # so the exchange scans, and the scan refuses it
    with pytest.raises(RequestRejected):
        parse_idempotency_key(headers)


@pytest.mark.parametrize(
    "headers",
    [
        [(b"host", b"h")],
        [(b"host", b"h"), (b"idempotency-keys", b"k1"), (b"x-idempotency-key", b"k2")],
        [(b"content-type", b"application/json"), (b"idempotency_key", b"k3")],
    ],
)
def test_a_key_the_map_lacks_is_no_key_at_all(headers: list[tuple[bytes, bytes]]) -> None:
    """The exchange reads the key from the map alone when there is one: its names are all in
    lower case, so no other spelling of the header can hide among them."""
    by_name = header_map({"headers": headers})
    assert by_name is not None
    assert KEY_HEADER not in by_name
    assert parse_idempotency_key(headers) is None
