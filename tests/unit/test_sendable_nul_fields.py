"""Pinned: a header whose name or value brings NUL characters of its own is no header a server
sends (sendable._all_sendable counts the NULs of the joined headers: with the right count of
fields, a value `b"v\\x00x-b\\x00w"` read as two fields, and passed the fast check whole). The
replay hook's response is refused for it, and a replay leaves it out."""

from __future__ import annotations

import pytest

from idem_middleware.sendable import head_problem, sendable_headers

SMUGGLED = [
    [(b"x-a", b"v\x00x-b\x00w")],  # a value holding a whole "field"
    [(b"x-a\x00v\x00x-b", b"w")],  # a name holding one
    [(b"x-ok", b"1"), (b"x-a", b"v\x00x-b\x00w")],
]


@pytest.mark.parametrize("headers", SMUGGLED)
def test_a_nul_inside_a_name_or_value_is_refused(headers: list[tuple[bytes, bytes]]) -> None:
    problem = head_problem(200, headers)
    assert problem is not None
    assert "cannot be sent" in problem
    kept, refused = sendable_headers(headers)
    assert all(b"\x00" not in name + value for name, value in kept)
    assert len(refused) == 1
