"""``pcr simulate --mirror``: every router runs again with mirrored owners; the audit
(against Redis, after a flush) stays 0 and the registry cost per request is shown for
both runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcr.cli.main import main

SMALL = ["--nodes", "3", "--requests", "120", "--kv-blocks", "256", "--mamba-slots", "16"]


def test_simulate_mirror_on_the_embedded_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "figures.json"
    assert main(["simulate", *SMALL, "--mirror", "--json", str(out), "--no-progress"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["router"], r.get("mirrored", False)) for r in runs] == [
        ("round-robin", False),
        ("round-robin", True),
        ("prefix", False),
        ("prefix", True),
    ]
    for run in runs:
        assert run["requests"] == 120
        assert set(run["consistency"].values()) == {0}, run["consistency"]
        assert run["totals"]["unavailable_requests"] == run["totals"]["reclaims"] == 0
        assert run["registry_us_per_request"] > 0
    for plain, mirrored in ((runs[0], runs[1]), (runs[2], runs[3])):
        assert "mirror" not in plain
        assert mirrored["mirror"]["flushed"] > 0
        assert (mirrored["mirror"]["resyncs"], mirrored["mirror"]["dropped"]) == (0, 0)
        assert mirrored["listener"] == {}  # a mirrored node needs none
    # Round-robin routes alike, and the mirror answers exactly as Redis does.
    for key in ("hit_rate_blocks", "hit_rate_tokens", "totals"):
        assert runs[0][key] == runs[1][key]
    table = capsys.readouterr().out
    assert "round-robin mirrored" in table
    assert "prefix mirrored" in table
    assert "registry µs per request" in table
    assert "mirror: writes flushed / batches / resyncs" in table


def test_mirror_is_not_for_the_bridge(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--mirror", "--bridge"]) == 2
    assert "--mirror: not with --bridge" in capsys.readouterr().err
