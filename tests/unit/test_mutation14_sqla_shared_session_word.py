"""A claim session used from another request (or from none) is refused saying what to do: use
one session per request (the driver's InterfaceError, which SQLAlchemy passes on)."""

from __future__ import annotations

import pytest
from asyncpg import InterfaceError

from idem_middleware.sqla_engine import _same_claim


def test_a_session_used_outside_its_claim_names_the_fix() -> None:
    with pytest.raises(InterfaceError, match=r"^the session is another request's: use one "):
        _same_claim(object())
