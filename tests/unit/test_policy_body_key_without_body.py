"""A key taken from the body, under a policy that allows no body (`max_body_bytes=0`), is never
found: every request was refused 400, or, with `key_required=False`, ran unguarded without a
word. The policy is refused when it is made."""

from __future__ import annotations

import pytest

from idem_middleware import ConfigurationError, KeyFromBody, Policy


@pytest.mark.parametrize("key_required", [True, False])
def test_a_body_key_with_no_body_allowed_is_refused(key_required: bool) -> None:
    with pytest.raises(ConfigurationError, match=r"reads the body, and max_body_bytes=0"):
        Policy(key_source=KeyFromBody("/id"), max_body_bytes=0, key_required=key_required)


def test_a_body_key_with_a_body_allowed_and_a_header_key_without_one_are_taken() -> None:
    assert Policy(key_source=KeyFromBody("/id"), max_body_bytes=1).max_body_bytes == 1
    assert Policy(max_body_bytes=0).key_source is None
