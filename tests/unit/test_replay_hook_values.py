"""A replay hook's `body_omitted` is a header's value (`idempotency-body-omitted`): one no
header value can hold is a malformed result, logged, and the stored response replayed unchanged.
Found by probing: it was appended unchecked after the headers' own check, and a line break in
it made the server refuse every replay of the record (a 500 under uvicorn)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import MutableMapping
from typing import Any

import pytest

from idem_middleware.responses import send_replay
from idem_middleware.sendable import head_problem
from idem_middleware.store import StoredResponse

STORED = StoredResponse(201, [(b"content-type", b"text/plain")], b"paid")
SCOPE = {"type": "http", "method": "POST", "path": "/pay"}


class Sent(list[MutableMapping[str, Any]]):
    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.append(message)


async def replayed_with(omitted: str) -> Sent:
    def hook(response: StoredResponse, scope: Any) -> StoredResponse:
        return dataclasses.replace(response, body=b"", body_omitted=omitted)

    sent = Sent()
    await send_replay(sent, STORED, hook, SCOPE, "POST /pay")
    return sent


@pytest.mark.parametrize(
    "omitted",
    [
        "trimmed\r\nx-injected: 1",
        "trimmed\n",
        "a\x00b",
        "a\x1bb",
        " leading",
        "trailing\t",
        "\ud800",
    ],
    ids=["crlf", "lf", "nul", "escape", "leading-space", "trailing-tab", "lone-surrogate"],
)
async def test_a_body_omitted_no_header_can_hold_replays_the_stored_response(
    omitted: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        start, body = await replayed_with(omitted)
    headers = start["headers"]
    assert head_problem(start["status"], headers) is None  # a head every server sends
    assert b"idempotency-body-omitted" not in dict(headers)
    assert (start["status"], body["body"]) == (201, b"paid")
    (record,) = caplog.records
    assert "replay hook failed on POST /pay" in record.getMessage()
    assert "body_omitted" in str(record.exc_info[1] if record.exc_info else "")


@pytest.mark.parametrize("omitted", ["trimmed", "", "trop grand: é"])
async def test_a_body_omitted_a_header_can_hold_is_sent(omitted: str) -> None:
    start, body = await replayed_with(omitted)
    assert dict(start["headers"])[b"idempotency-body-omitted"] == omitted.encode()
    assert head_problem(start["status"], start["headers"]) is None
    assert body["body"] == b""
