"""An operator's response (`ops.resolve`) holding a header a replay never repeats is refused up
front: stored, it was left out of every replay with a warning at each, instead of the operator
being told while it could still be corrected. (A reconciler's `Happened` is stored without
them, as a handler's response is.)"""

from __future__ import annotations

import pytest

from idem_middleware.ops import Resolution, check_response
from idem_middleware.store.base import StoredResponse


@pytest.mark.parametrize(
    "header",
    [
        (b"content-length", b"2"),
        (b"Transfer-Encoding", b"chunked"),
        (b"connection", b"close"),
        (b"keep-alive", b"timeout=5"),
    ],
)
def test_a_header_a_replay_never_repeats_is_refused(header: tuple[bytes, bytes]) -> None:
    response = StoredResponse(201, [(b"content-type", b"application/json"), header], b"{}")
    with pytest.raises(ValueError, match="a replay never repeats"):
        check_response(Resolution.SUCCEEDED, response)


def test_ordinary_headers_are_taken() -> None:
    headers = [(b"content-type", b"application/json"), (b"location", b"/payments/1")]
    check_response(Resolution.SUCCEEDED, StoredResponse(201, headers, b"{}"))
