"""``pcr bench --quick``: runs against a redis-server of its own and reports every
operation, the throughput, the listener latency, and each target with its ratio.
Only the shape is checked: figures belong to BENCHMARKS.md, not to assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.servers import require_redis_server

ROOT = REPO_ROOT
OPERATIONS = [
    "match_kv_prefix, full hit",
    "match_kv_prefix, half hit",
    "match_kv_prefix, miss",
    "register_kv",
    "evict_kv with Mamba cascade (1 in 8)",
    "match_mamba_farthest",
    "find_mamba_backoff (half)",
]


@pytest.mark.redis_server
def test_quick_bench_reports_every_operation_and_target(tmp_path: Path) -> None:
    require_redis_server()
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "pcr", "bench", "--quick", "--sizes", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    rows = {(r["operation"], r["n"]) for r in report["rows"]}
    assert {(op, 64) for op in OPERATIONS} <= rows
    assert {n for _, n in rows} == {64}  # --sizes chose it
    assert ("score over 16 namespaces (vs 1 match)", 64) in rows
    for row in report["rows"]:
        assert row["p50_ms"] > 0
        assert row["p99_ms"] >= row["p50_ms"] * 0.5
        assert row["client_ratio"] > 0
    assert {"match_kv_prefix", "HMGET"} == set(report["throughput_4_processes_n64"])
    assert report["listener_notice_to_free_ms"]["missing"] == 0
    targets = {t["target"]: t for t in report["targets"]}
    assert len(targets) == 6  # the 11 targets less those at n=512 and n=8192
    for target in targets.values():
        assert isinstance(target["measured"], float | int)
        assert target["limit"].startswith(("≤", "≥"))
        assert isinstance(target["met"], bool)
    text = done.stdout
    assert "client x" in text
    assert "server x" in text
    for name in targets:
        assert name in text  # each ratio is printed next to its target
