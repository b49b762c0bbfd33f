"""waiting.py: a held slot or waiting place goes back once however often `give_back` runs
(`Held.give_back` takes its lender before calling it); a wait's bound grows with its
length (`wait_rounds`)."""

from __future__ import annotations

from idem_middleware.waiting import MAX_ROUNDS, TenantSlots, Waiters, wait_rounds


def test_a_waiting_place_given_back_twice_frees_one_place() -> None:
    """Given back twice (early, when the request stops waiting, and again at its end), a place
    freed two: the process let one more duplicate wait than `max_waiters`."""
    waiters = Waiters(1)
    place = waiters.place()
    assert place is not None
    place.give_back()
    place.give_back()
    assert not place.held
    again = waiters.place()
    assert again is not None
    assert waiters.place() is None  # still one place, not two
    assert waiters.count == 1


def test_a_tenant_slot_given_back_twice_frees_one_slot() -> None:
    """A stream gives its slot back as it starts, and its request again at its end: once."""
    slots = TenantSlots(1)
    slot = slots.hold("t")
    assert slot is not None
    slot.give_back()
    slot.give_back()  # (no KeyError, no second slot freed)
    assert slots.hold("t") is not None
    assert slots.hold("t") is None


def test_a_long_wait_is_bounded_by_its_polls_not_a_fixed_count() -> None:
    """A job told to wait hours, polling every second, may poll that many times: a fixed
    `MAX_ROUNDS` ended it with "the record kept changing" long before its wait ran out."""
    hours = 4 * 3600.0
    assert wait_rounds(hours, 1.0) >= MAX_ROUNDS + hours


def test_a_wait_with_nothing_left_still_allows_the_least_lock_wait() -> None:
    """A duplicate with nothing left of its wait (`wait_seconds=0`) that finds the record
    `unknown` still gives the route's reconciler a moment to open its fenced transaction:
    `lock_wait` never hands out a spent or negative bound (with none, the fence timed out
    before it was asked for, and every retry was told 409 while the reconciler could have
    settled it)."""
    from idem_middleware.waiting import lock_wait

    assert lock_wait(-1.0) == lock_wait(0.0) > 0
    assert lock_wait(3.0) == 3.0
