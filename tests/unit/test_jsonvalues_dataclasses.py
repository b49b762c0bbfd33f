"""jsonvalues.non_finite looks wherever orjson writes a float natively: in a dataclass's
attributes and an enum's value too, not only in lists, tuples and dicts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from idem_middleware.jsonvalues import json_text, non_finite

INF, NAN = float("inf"), float("nan")


@dataclass
class Plain:
    amount: Any
    _private: Any = 0.0


@dataclass(slots=True, frozen=True)
class Slotted:
    amount: Any
    _private: Any = 0.0
    items: list[Any] = field(default_factory=list)


class Rate(enum.Enum):
    UNBOUNDED = INF
    NONE = None


@pytest.mark.parametrize(
    "value",
    [
        Plain(INF),
        Plain(-INF),
        Plain(NAN),
        Slotted(NAN),
        Slotted(1.0, items=[{"x": -INF}]),
        [Plain(Plain(INF))],
        {"order": (Slotted(1.0), Plain(NAN))},
        Rate.UNBOUNDED,
        Plain(Rate.UNBOUNDED),
    ],
)
def test_a_non_finite_float_orjson_writes_as_null_is_found(value: Any) -> None:
    assert b"null" in orjson.dumps(value)
    assert non_finite(value)
    with pytest.raises(ValueError, match="NaN or an infinity"):
        json_text(value, "the payload")


@pytest.mark.parametrize(
    "value",
    [
        Plain(1.5),
        Plain(None),
        Slotted(None, items=[1.0, None]),
        Rate.NONE,
        Plain,  # the class, not an instance
        # orjson leaves out the attributes whose name starts with "_": not in the JSON, not
        # looked at.
        Plain(1.0, _private=NAN),
        Slotted(1.0, _private=INF),
    ],
)
def test_finite_values_and_attributes_orjson_leaves_out_are_not(value: Any) -> None:
    assert not non_finite(value)


def test_an_attribute_set_on_a_dataclass_instance_is_looked_at_as_orjson_writes_it() -> None:
    """orjson writes a (non-slots) dataclass's `__dict__`: an attribute set after `__init__`
    too."""
    value = Plain(1.0)
    value.extra = INF  # type: ignore[attr-defined]
    assert orjson.dumps(value) == b'{"amount":1.0,"extra":null}'
    assert non_finite(value)
