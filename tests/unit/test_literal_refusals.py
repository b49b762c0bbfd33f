"""The fast path writes a literal only for exactly the types it knows: an int subclass (an
IntEnum such as `http.HTTPStatus`) and text that is not UTF-8 (a lone surrogate) are refused
(NotFusable: the parameterised path takes them), never written as their `repr` or as bytes the
server would decode into something else."""

from __future__ import annotations

import enum
from http import HTTPStatus

import pytest

from idem_middleware.errors import NotFusable
from idem_middleware.store.postgres.literals import _inline, _literal


class Flag(enum.IntEnum):
    ON = 1


@pytest.mark.parametrize("value", [HTTPStatus.CREATED, Flag.ON, 3])
def test_int_subclasses_are_not_fused(value: int) -> None:
    """Only `int` itself is written as digits (an IntEnum's repr, `<HTTPStatus.CREATED: 201>`,
    is not SQL); a plain int built any way is."""
    if type(value) is int:
        assert _literal(value) == str(value)
        return
    with pytest.raises(NotFusable):
        _literal(value)
    with pytest.raises(NotFusable):
        _inline("SELECT $1", [value])


@pytest.mark.parametrize("utf8", [True, False])
def test_a_lone_surrogate_is_refused_in_either_client_encoding(utf8: bool) -> None:
    """Text that is not encodable as UTF-8 takes the parameterised path (which reports it),
    whether or not it holds a `$`, in either client encoding."""
    for text in ("a\ud800b", "$\udfff", "\ud83d"):
        with pytest.raises(NotFusable):
            _inline("SELECT $1", [text], utf8)
