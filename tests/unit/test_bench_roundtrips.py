"""bench.roundtrips names each message to the server; a reset that travels after a COMMIT is a
reset, not three statements of the request's."""

from __future__ import annotations

from bench.roundtrips import Logged, cost, kind_of

_RESET = "SELECT pg_advisory_unlock_all();\nCLOSE ALL;\nUNLISTEN *;\nRESET ALL;"


def test_a_reset_after_the_commit_is_named_a_reset() -> None:
    fused = "EXECUTE idem_insert_final_0123 ($v$t$v$::text);\nCOMMIT;\n" + _RESET
    assert kind_of(fused) == "insert-record+COMMIT+reset"
    assert kind_of(_RESET) == "reset"
    assert kind_of("EXECUTE idem_insert_final_0123 ($v$t$v$::text);\nCOMMIT") == (
        "insert-record+COMMIT"
    )


def test_a_fused_reset_counts_as_a_reset_and_no_statement_or_round_trip() -> None:
    entries = [
        Logged("r", 1, "BEGIN+claim-key"),
        Logged("r", 1, "ledger-insert"),
        Logged("r", 1, "insert-record+COMMIT+reset"),
    ]
    fused = cost("ours-tx", "fresh", entries, 201)
    apart = cost("ours-tx", "fresh", [*entries[:2], Logged("r", 1, "insert-record+COMMIT")], 201)
    apart_reset = cost("bare", "fresh", [*entries[:2], Logged("r", 1, "reset")], 201)
    assert (fused.round_trips, fused.statements, fused.resets, fused.autocommit) == (3, 5, 1, 0)
    assert (apart.round_trips, apart.statements, apart.resets) == (3, 5, 0)
    assert (apart_reset.round_trips, apart_reset.resets) == (2, 1)
