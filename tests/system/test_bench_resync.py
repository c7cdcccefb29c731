"""``python -m pcr.bench.resync`` on a tiny fleet: it runs against a redis-server of its
own, reports each row's shape and the view's scores equal to exact scoring after the run.
Figures (the stale decisions, the cold start) belong to BENCHMARKS.md, not to assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.servers import require_redis_server


@pytest.mark.redis_server
def test_the_resync_bench_reports_its_rows_and_equal_answers(tmp_path: Path) -> None:
    require_redis_server()
    out = tmp_path / "resync.json"
    args = ["--workers", "8", "--duration", "2", "--resync-interval", "0.5", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "pcr.bench.resync", *args],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "stale" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workers"] == 8
    assert row["agree"] is True
    assert row["pairs"] == row["fleet_pairs"] > 8 * 4000
    assert row["decisions"] > 0
    assert 0 <= row["stale_decisions"] <= row["decisions"]
    assert row["cold_start_s"] > 0
