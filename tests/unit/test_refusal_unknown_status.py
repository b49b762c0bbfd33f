"""Pinned: an app's 4xx HTTPException with a status HTTP names no phrase for (499, 460...) is
answered with the title "Request refused" (refusals._phrase), its own status and detail, as
problem+json of type about:blank."""

from __future__ import annotations

import orjson
import pytest
from starlette.exceptions import HTTPException

from idem_middleware.refusals import build_refusal


@pytest.mark.parametrize("status", [460, 499])
def test_a_status_without_a_phrase_is_titled_request_refused(status: int) -> None:
    exc = HTTPException(status, "the sender is not allowed")
    sent, headers, body = build_refusal(
        exc, base="https://errors.example/", challenge=None, source="key source"
    )
    assert sent == status
    assert (b"content-type", b"application/problem+json") in headers
    assert orjson.loads(body) == {
        "type": "about:blank",
        "title": "Request refused",
        "status": status,
        "detail": "the sender is not allowed",
    }
