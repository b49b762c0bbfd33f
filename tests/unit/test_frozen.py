"""`quick_init`: a frozen slots dataclass built through its slots' setters behaves exactly as
the dataclass-generated `__init__` would have built it, and anything it cannot build so is
refused when the class is made."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any

import pytest

from idem_middleware.answers import InFlight, Problem, Replay
from idem_middleware.errors import ProblemKind
from idem_middleware.frozen import quick_init
from idem_middleware.store.base import (
    Claimed,
    Existing,
    Record,
    RecordKey,
    State,
    StoredResponse,
    TokenRefused,
)

RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b"{}")
RECORD = Record(RecordKey("t", "POST /x", "k"), b"fp", State.SUCCEEDED, 7, RESPONSE, epoch=3)
#: Each record the request path builds per request, with the arguments of one.
BUILT = [
    (StoredResponse, (201, [(b"a", b"b")], b"body"), {}),
    (StoredResponse, (200, (), b""), {"body_omitted": "streaming"}),
    (Claimed, (5,), {"epoch": 5}),
    (Record, (RecordKey("t", "POST /x", "k"), b"fp", State.PENDING, 1, None), {}),
    (Record, (), {**{f.name: getattr(RECORD, f.name) for f in dataclasses.fields(Record)}}),
    (Existing, (RECORD,), {}),
    (TokenRefused, ("This token has expired.",), {}),
    (Replay, (RESPONSE,), {}),
    (Problem, (ProblemKind.IN_FLIGHT, "busy"), {"retry_after": 1}),
    (Problem, (ProblemKind.KEY_REUSED, "other body"), {}),
    (InFlight, (), {}),
]


def _reference(cls: type[Any]) -> type[Any]:
    """The same fields as `cls`, in a class with the __init__ dataclasses generates."""
    return dataclasses.make_dataclass(
        cls.__name__,
        [(f.name, f.type, f) for f in dataclasses.fields(cls)],
        frozen=True,
        slots=True,
    )


@pytest.mark.parametrize(("cls", "args", "kwargs"), BUILT)
def test_a_quick_record_is_the_record_the_dataclass_would_build(
    cls: type[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    assert "_set_" in " ".join(cls.__init__.__code__.co_freevars)  # built by quick_init
    built, expected = cls(*args, **kwargs), _reference(cls)(*args, **kwargs)
    assert dataclasses.astuple(built) == dataclasses.astuple(expected)
    assert inspect.signature(cls) == inspect.signature(type(expected))
    assert built == cls(*args, **kwargs)
    assert pickle.loads(pickle.dumps(built)) == built
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, dataclasses.fields(cls)[0].name, None)


def test_a_quick_record_keeps_hashing_replace_and_its_refusals() -> None:
    claimed = Claimed(3, 1)
    assert hash(claimed) == hash(Claimed(3, 1)) != hash(Claimed(3, 2))
    assert dataclasses.replace(claimed, epoch=9) == Claimed(3, 9)
    with pytest.raises(TypeError):
        Claimed(3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Claimed(1, 2, 3)  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del claimed.generation  # type: ignore[misc]
    assert StoredResponse.__init__.__qualname__ == "StoredResponse.__init__"


def _frozen(**fields: tuple[Any, Any]) -> type[Any]:
    spec = [(name, kind, field) for name, (kind, field) in fields.items()]
    return dataclasses.make_dataclass("R", spec, frozen=True, slots=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: type("Plain", (), {"__slots__": ("a",)}),
        lambda: dataclasses.make_dataclass("Open", [("a", int)], slots=True),
        lambda: dataclasses.make_dataclass("NoSlots", [("a", int)], frozen=True),
        lambda: _frozen(a=(list[int], dataclasses.field(default_factory=list))),
        lambda: _frozen(a=(int, dataclasses.field(kw_only=True))),
        lambda: _frozen(a=(int, dataclasses.field(init=False, default=0))),
        lambda: dataclasses.make_dataclass(
            "Post",
            [("a", int)],
            frozen=True,
            slots=True,
            namespace={"__post_init__": lambda self: None},
        ),
    ],
    ids=["not-a-dataclass", "not-frozen", "no-slots", "factory", "kw-only", "not-in-init", "post"],
)
def test_what_quick_init_cannot_build_is_refused_when_the_class_is_made(make: Any) -> None:
    with pytest.raises(TypeError, match="quick_init"):
        quick_init(make())
