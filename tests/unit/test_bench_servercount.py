"""bench.servercount: reading callgrind's dump and the table built from the counts."""

from __future__ import annotations

import pytest

from bench.servercount import dumped_total, markdown
from bench.servercount import main as servercount_main

DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
cmd: python -m uvicorn bench.app:create_app
part: 1
events: Ir
summary: 712743899

fn=(1) main
0 5
totals: 712743899
"""


def test_the_dump_gives_its_instruction_total() -> None:
    assert dumped_total(DUMP) == 712_743_899
    assert dumped_total("events: Ir\ntotals: 42\n") == 42
    with pytest.raises(ValueError, match="not a callgrind dump"):
        dumped_total("events: Ir\nfn=(1) main\n")


def test_the_table_puts_each_variant_against_bare() -> None:
    table = markdown({"bare": (1_000_000, 10), "ours-memory": (1_200_000, 10)})
    assert "| bare | 10 | 100,000 | — | 1.00x |" in table
    assert "| ours-memory | 10 | 120,000 | +20,000 | 0.83x |" in table


def test_an_unknown_variant_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        servercount_main(["--variants", "bare,nonsense"])
    assert exited.value.code == 2
    assert "--variants among" in capsys.readouterr().err
