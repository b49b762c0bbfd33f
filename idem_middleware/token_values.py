"""What `TokenIssuer` and the token route accept: a token's time to live, and the tenant,
operation, intent and request digest a token is issued for. A value the checks refuse raises
TypeError or ValueError naming the argument (never echoing it: an intent or a tenant may be
personal data), instead of a token issued that no request can ever consume, or a bare error from
deep in the store.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .policy import MAX_SECONDS, OPERATION_SHAPE  # (the operations the status resource accepts)
from .tenant import MAX_TENANT_BYTES, storable_tenant

#: The longest intent_id the token route accepts (characters).
MAX_INTENT_ID = 255
#: The length of a request digest: a fingerprint (`fingerprint.compute_fingerprint`).
DIGEST_BYTES = 32


def clean_text(value: str) -> bool:
    """No NUL (PostgreSQL text refuses it) and no lone surrogate (not encodable as UTF-8)."""
    if "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def good_operation(operation: str) -> bool:
    """An operation in the shape the status resource accepts ("METHOD /path-template")."""
    return clean_text(operation) and OPERATION_SHAPE.fullmatch(operation) is not None


def good_intent(intent_id: str | None) -> bool:
    return intent_id is None or (len(intent_id) <= MAX_INTENT_ID and clean_text(intent_id))


def time_to_live(value: Any) -> float:
    """A token's time to live: seconds, positive, finite and at most MAX_SECONDS (past it,
    `now() + ttl` leaves PostgreSQL's range and every issue would be refused)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    number = float(value) if real else None
    if number is None or not (math.isfinite(number) and 0 < number <= MAX_SECONDS):
        raise ValueError(
            f"ttl_seconds must be positive, finite and at most {MAX_SECONDS} seconds (100 years),"
            f" not {value!r}"
        )
    return number


def checked_request(
    tenant: Any, operation: Any, intent_id: Any, request_digest: Any
) -> tuple[str, str, str | None, bytes | None]:
    """`TokenIssuer.issue`'s arguments, checked, as plain `str` and `bytes` (a subclass's text,
    an enum member's say, is its value, as a resolver's tenant is)."""
    if not isinstance(tenant, str):
        raise TypeError(f"tenant is a str (the caller's tenant), not {type(tenant).__name__}")
    tenant = str.__str__(tenant)
    if not tenant or not storable_tenant(tenant):
        # (An anonymous caller has no tokens: a token route answers only authenticated ones.)
        raise ValueError(
            "tenant must be a non-empty str of at most"
            f" {MAX_TENANT_BYTES} bytes of UTF-8, without NUL or unpaired surrogates"
        )
    if not isinstance(operation, str):
        raise TypeError(f'operation is a str ("POST /payouts"), not {type(operation).__name__}')
    operation = str.__str__(operation)
    if not good_operation(operation):
        raise ValueError('operation must be "METHOD /path-template", as a guarded route names it')
    if intent_id is not None:
        if not isinstance(intent_id, str):
            raise TypeError(f"intent_id is a str or None, not {type(intent_id).__name__}")
        intent_id = str.__str__(intent_id)
        if not good_intent(intent_id):
            raise ValueError(
                f"intent_id must be at most {MAX_INTENT_ID} characters, without NUL or unpaired"
                " surrogates"
            )
    if request_digest is not None:
        if not isinstance(request_digest, (bytes, bytearray, memoryview)):
            raise TypeError(
                "request_digest is the request's fingerprint (bytes) or None,"
                f" not {type(request_digest).__name__}"
            )
        request_digest = bytes(request_digest)
        if len(request_digest) != DIGEST_BYTES:
            raise ValueError(
                f"request_digest is a fingerprint of {DIGEST_BYTES} bytes"
                f" (fingerprint.compute_fingerprint), not one of {len(request_digest)}"
            )
    return tenant, operation, intent_id, request_digest
