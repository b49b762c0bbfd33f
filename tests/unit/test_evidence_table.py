"""scripts/evidence_table.py writes its table into docs/evidence.md, between the markers."""

from __future__ import annotations

from pathlib import Path

from scripts import evidence_table


def test_the_table_replaces_the_block_in_docs_evidence(tmp_path: Path) -> None:
    assert evidence_table.DOC == evidence_table.ROOT / "docs" / "evidence.md"
    doc = tmp_path / "evidence.md"
    doc.write_text(evidence_table.DOC.read_text())
    before, after = (
        doc.read_text().split(evidence_table.START)[0],
        doc.read_text().split(evidence_table.END)[1],
    )
    lines = [
        {"scenario": "storm/credits", "requests": 600, "recorded_at": "2026-01-02T03:04:00+00:00"},
        {"scenario": "storm/credits", "requests": 3, "stuck_keys": 1},
    ]
    table = evidence_table.render("default", lines, "python -m pytest tests/x.py")

    evidence_table.write_doc(table, doc)

    text = doc.read_text()
    assert text.startswith(before)
    assert text.endswith(after)
    block = text.split(evidence_table.START)[1].split(evidence_table.END)[0]
    assert block == "\n" + table + "\n"
    assert (
        "| `storm/credits` | 200 concurrent requests on one key, `--workers 4` (credits) "
        "| 2 | 603 | 0 | 0 | 1 |" in block
    )
    assert "`python -m pytest tests/x.py`" in block
