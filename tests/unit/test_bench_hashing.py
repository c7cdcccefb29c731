"""``python -m pcr.bench.hashing``: the report's shape (never its figures), with or
without Dynamo installed."""

from __future__ import annotations

from pcr.bench import hashing
from registry.core.hashing import implementation


def test_report_rows_and_table() -> None:
    report = hashing.measure(rounds=1, batches=1)
    assert report["implementation"] == implementation()
    assert [r["block_size"] for r in report["rows"]] == [16, 32]
    for row in report["rows"]:
        assert row["blocks"] == 512
        assert row["block_hashes_us"] > 0
        assert row["plain_python_us"] > 0
        assert ("ratio" in row) == report["dynamo"] == ("dynamo_us" in row)
    table = "\n".join(hashing.format_report(report))
    assert f"block_hashes runs {implementation()}" in table
    assert "target: block_hashes <= 1.5x Dynamo" in table


def test_plain_chain_is_megatrons() -> None:
    """The bench's plain-Python reference is the same chain (the fixed vector of
    tests/unit/test_hashing.py)."""
    assert hashing.plain_sha256_chain([1, 2], 2) == [4233502300241348285]
    assert hashing.plain_sha256_chain([1, 2, 3, 4, 5], 2) == hashing.plain_sha256_chain(
        [1, 2, 3, 4], 2
    )
