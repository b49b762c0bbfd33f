"""`TokenIssuer.issue`, called by an application, checks what it is given as the token route
does: a token no request can ever consume (an operation in no route's shape, a digest that is no
fingerprint, an anonymous or unstorable tenant) is refused with TypeError or ValueError naming
the argument, never issued, and the value itself is never echoed."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from idem_middleware import MemoryStore
from idem_middleware.tokens import TokenIssuer

OP = "POST /payouts"
GOOD: dict[str, Any] = {"tenant": "tenant-a", "operation": OP}


def _issuer() -> tuple[MemoryStore, TokenIssuer]:
    store = MemoryStore()
    return store, TokenIssuer(store, secret=b"s" * 32)


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"tenant": ""}, ValueError, "tenant must be a non-empty str"),
        ({"tenant": None}, TypeError, "tenant is a str"),
        ({"tenant": 7}, TypeError, "tenant is a str"),
        ({"tenant": "secret\x00name"}, ValueError, "tenant must be"),
        ({"tenant": "x" * 1025}, ValueError, "tenant must be"),
        ({"operation": "payouts"}, ValueError, "operation must be"),
        ({"operation": "POST /payouts\r\nX: 1"}, ValueError, "operation must be"),
        ({"operation": b"POST /payouts"}, TypeError, "operation is a str"),
        ({"intent_id": 5}, TypeError, "intent_id is a str or None"),
        ({"intent_id": "secret\ud800"}, ValueError, "intent_id must be"),
        ({"intent_id": "x" * 256}, ValueError, "intent_id must be at most 255"),
        ({"request_digest": "abc"}, TypeError, "request_digest is the request's fingerprint"),
        ({"request_digest": b"short"}, ValueError, "of 32 bytes"),
    ],
)
async def test_issue_refuses_what_no_request_could_consume(
    changes: dict[str, Any], error: type[Exception], words: str
) -> None:
    store, issuer = _issuer()
    arguments = {**GOOD, **changes}
    with pytest.raises(error, match=words) as raised:
        await issuer.issue(arguments.pop("tenant"), arguments.pop("operation"), **arguments)
    assert "secret" not in str(raised.value)  # (the value itself is not echoed)
    assert store._tokens == {}  # nothing issued


async def test_issue_takes_the_text_of_str_subclasses_and_a_digest_as_any_bytes() -> None:
    class Tenant(str, enum.Enum):  # noqa: UP042 (its str() is "Tenant.A": the harder case)
        A = "tenant-a"

    store, issuer = _issuer()
    plain = await issuer.issue("tenant-a", OP, intent_id="i-1", request_digest=b"d" * 32)
    again = await issuer.issue(Tenant.A, OP, intent_id="i-1", request_digest=bytearray(b"d" * 32))
    assert again.token == plain.token  # the same intent of the same tenant: the same token
    assert len(store._tokens) == 1
    longest = await issuer.issue("tenant-a", OP, intent_id="x" * 255)
    assert longest.token.startswith("it_")
