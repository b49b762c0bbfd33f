"""A datetime whose UTC offset is not whole minutes (a zone's local mean time, as Amsterdam's
+00:19:32 before 1937, or a `timezone` of seconds) is written by orjson rounded to the minute:
another instant's text. A job's arguments holding one are refused (two calls at different
instants would share a fingerprint, the second answered with the first one's result), as is an
outbox payload (the event would carry another time); ordinary datetimes are written, and
fingerprinted, as before."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import orjson
import pytest

from idem_middleware import ConfigurationError
from idem_middleware.jobs import _fingerprint
from idem_middleware.jsonvalues import changed_part, json_text

SECONDS = timezone(timedelta(hours=5, minutes=30, seconds=15))
MINUTES = timezone(timedelta(hours=5, minutes=30))
BEHIND = timezone(-timedelta(hours=3, seconds=1))
MICROSECONDS = timezone(timedelta(hours=1, microseconds=5))
AMSTERDAM = ZoneInfo("Europe/Amsterdam")


@dataclass
class Payment:
    at: datetime


def test_two_instants_orjson_writes_alike_are_the_case() -> None:
    a = datetime(2020, 1, 1, tzinfo=SECONDS)
    b = datetime(2020, 1, 1, tzinfo=MINUTES)
    assert a != b
    assert orjson.dumps(a) == orjson.dumps(b)
    lmt = datetime(1900, 1, 1, 12, tzinfo=AMSTERDAM)
    fixed = datetime(1900, 1, 1, 12, tzinfo=timezone(timedelta(minutes=20)))
    assert lmt != fixed
    assert orjson.dumps(lmt) == orjson.dumps(fixed)


@pytest.mark.parametrize(
    "argument",
    [
        datetime(2020, 1, 1, tzinfo=SECONDS),
        datetime(2020, 1, 1, tzinfo=BEHIND),
        datetime(2020, 1, 1, tzinfo=MICROSECONDS),
        datetime(1900, 1, 1, 12, tzinfo=AMSTERDAM),
        [{"at": datetime(2020, 1, 1, tzinfo=SECONDS)}],
        Payment(datetime(2020, 1, 1, tzinfo=SECONDS)),
        datetime(2020, 1, 1, 12, 0, 0, 123456, tzinfo=SECONDS),  # (written `...00.123456+05:30`)
    ],
    ids=[
        "seconds",
        "negative",
        "microseconds",
        "local-mean-time",
        "nested",
        "in-a-dataclass",
        "with-fractional-seconds",
    ],
)
def test_a_job_argument_with_an_offset_of_seconds_is_refused(argument: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"UTC offset .* has seconds.*pass it in UTC"):
        _fingerprint("send", (argument,), {})
    with pytest.raises(ConfigurationError, match="has seconds"):
        _fingerprint("send", (), {"when": argument})
    with pytest.raises(ValueError, match=r"the payload holds a datetime whose UTC offset"):
        json_text({"event": argument}, "the payload")


@pytest.mark.parametrize(
    "argument",
    [
        datetime(2020, 1, 1, 12, 30, 5, 123),
        datetime(2020, 1, 1, tzinfo=UTC),
        datetime(2020, 1, 1, tzinfo=MINUTES),
        datetime(2020, 1, 1, tzinfo=timezone(-timedelta(hours=3, minutes=30))),
        datetime(2020, 6, 1, 12, tzinfo=AMSTERDAM),
        Payment(datetime(2020, 6, 1, tzinfo=AMSTERDAM)),
    ],
)
def test_ordinary_datetimes_are_written_and_fingerprinted_as_before(argument: Any) -> None:
    assert changed_part(argument) is None
    payload = orjson.dumps([(argument,), {}], option=orjson.OPT_SORT_KEYS)
    assert _fingerprint("send", (argument,), {}) == hashlib.sha256(b"send\x00" + payload).digest()
    assert json_text([argument], "the payload") == orjson.dumps([argument])


def test_an_outbox_payload_keeps_its_private_attributes_as_before() -> None:
    @dataclass
    class Event:
        at: datetime
        _note: str = "left out"

    event = Event(datetime(2020, 1, 1, tzinfo=UTC))
    assert json_text(event, "the payload") == orjson.dumps(event)
    # Nested too: the walk json_text asks for (offsets only) stays so below the top.
    assert json_text({"events": [event]}, "the payload") == orjson.dumps({"events": [event]})
    assert changed_part(event) is not None  # (a job's argument: refused)
