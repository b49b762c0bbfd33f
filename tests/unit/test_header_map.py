"""exchange.header_map: a request's headers read through one dict when that reads them exactly
as the scans do (a list of lower-case names, none repeated), and through the scans otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.errors import RequestRejected
from idem_middleware.exchange import header_map
from idem_middleware.keys import parse_idempotency_key

PLAIN = [(b"host", b"h"), (b"content-type", b"application/json"), (b"idempotency-key", b"k1")]


def test_a_list_of_distinct_lower_case_names_is_read_through_a_dict() -> None:
    assert header_map(PLAIN) == dict(PLAIN)
    assert parse_idempotency_key(PLAIN, header_map(PLAIN)) == "k1"


@pytest.mark.parametrize(
    "headers",
    [
        [*PLAIN, (b"content-type", b"text/plain")],  # a repeated name: the scans take the first
        [(b"Host", b"h"), (b"idempotency-key", b"k1")],  # a name not in lower case
        tuple(PLAIN),  # not a list: any iterable is the server's to give, and is not consumed
        [(b"host", b"h", b"extra")],  # not pairs
        [(b"1", b"2")],  # no letter at all: nothing says the names are lower case
    ],
)
def test_anything_else_is_left_to_the_scans(headers: Any) -> None:
    assert header_map(headers) is None


def test_a_key_repeated_in_another_case_is_still_refused() -> None:
    headers = [(b"idempotency-key", b"k1"), (b"Idempotency-Key", b"k2")]
    with pytest.raises(RequestRejected):
        parse_idempotency_key(headers, header_map(headers))


def test_a_key_the_map_lacks_is_still_found_by_the_scan() -> None:
    """A caller may pass a map of other headers; a key spelt in another case is scanned for."""
    headers = [(b"host", b"h"), (b"IDEMPOTENCY-KEY", b"k3")]
    assert parse_idempotency_key(headers, {b"host": b"h"}) == "k3"
    assert parse_idempotency_key([(b"host", b"h")], {b"host": b"h"}) is None
