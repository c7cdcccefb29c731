"""``pcr bench --quick``: runs against a redis-server of its own and reports every
operation, the throughput, the listener latency, the bridge's rows, and each target with
its ratio. Only the shape is checked: figures belong to BENCHMARKS.md, not to assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pcr.bench import bridge as bridge_bench
from pcr.bench import fleet as fleet_bench
from pcr.bench import run as bench
from pcr.bench import serve as serve_bench
from pcr.bench import view as view_bench
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
    bridged = bridge_bench.missing_dependency() is None
    check_bridge_rows(report["bridge"], bridged)
    served = serve_bench.missing_dependency() is None
    check_serve_rows(report["serve"], served)
    targets = {t["target"]: t for t in report["targets"]}
    # the 13 targets less those at n=512 and n=8192 (and the bridge's without pyzmq, the
    # asyncio router's without the serve extra), plus the mirror's three
    assert len(targets) == 6 + bridged + served + 3
    check_mirror_rows(report["mirror"])
    for target in targets.values():
        assert isinstance(target["measured"], float | int)
        assert target["limit"].startswith(("≤", "≥"))
        assert isinstance(target["met"], bool)
    text = done.stdout
    assert "client x" in text
    assert "server x" in text
    for name in targets:
        assert name in text  # each ratio is printed next to its target
    assert "mirror publish to visible in score: p50" in text
    assert "registry writes/s" in text
    if bridged:
        assert "blocks/s" in text
        assert "bridge publish to visible in score: p50" in text
    else:
        assert "bridge: skipped" in text
    if served:
        assert "AsyncPrefixRouter p50" in text
        assert "pcr serve POST /v1/score, 512 hashes, 16 live nodes, offered" in text
    else:
        assert "serve: skipped" in text


@pytest.mark.redis_server
@pytest.mark.cluster
def test_quick_fleet_bench_reports_equal_answers_and_sane_figures(tmp_path: Path) -> None:
    """``pcr bench --fleet --quick``: the in-process rows at both sizes (answers equal to
    Dynamo's tree where it is installed), the rows through Redis on both deployments
    with the view's scores equal to the exact ones, and the write rows (never a speed
    asserted)."""
    require_redis_server()
    out = tmp_path / "fleet.json"
    done = subprocess.run(
        [sys.executable, "-m", "pcr", "bench", "--fleet", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"quick", "in_process", "fleet", "redis", "seconds"}
    in_process = report["in_process"]
    assert [(r["nodes"], r["workload"]) for r in in_process["rows"]] == [
        (n, workload) for n in (16, 256) for workload in (view_bench.HEADLINE, "realistic")
    ]
    assert set(in_process["growth_p50"]) == {view_bench.HEADLINE, "realistic"}
    for row in in_process["rows"]:
        assert 0 < row["view_p50_us"] <= row["view_p99_us"]
        assert row["view_bytes_per_pair"] > 0
        if in_process["radix_tree"]:
            assert row["answers_equal"] is True
    fleet = report["fleet"]
    assert len(fleet["load_average"]) == 3
    rows = fleet["rows"]
    assert [(r["deployment"], r["namespaces"]) for r in rows] == [
        (deployment, n) for deployment in ("standalone", "cluster") for n in (16, 64)
    ]
    for row in rows:
        assert row["workload"] == "realistic"
        assert row["servers"] == (1 if row["deployment"] == "standalone" else 3)
        assert row["scored"] == row["namespaces"]  # every live namespace, each scored
        assert row["agree"] is True  # the view's scores equal the exact ones
        assert row["longest_prefix"] > 0
        assert row["pairs"] > 0
        for path in fleet_bench.PATHS:
            assert row[f"{path}_p50_ms"] > 0
        for path in fleet_bench.PATHS[:-1]:
            ratio = row[f"{path}_p50_ms"] / row["match_p50_ms"]
            assert row[f"{path}_ratio"] == pytest.approx(ratio, rel=0.01, abs=0.01)  # 2 decimals
        assert row["server_us_exact"] > 0
        assert row["server_us_match"] > 0
        assert row["setup_s"] > 0
    assert len(fleet["targets"]) == len(rows)  # the view's ratio, per row
    for target in fleet["targets"]:
        assert isinstance(target["measured"], float | int)
        assert target["limit"].startswith("≤")
        assert target["target"] in done.stdout
    redis = report["redis"]
    assert 0 < redis["write_to_view_p50_ms"] <= redis["write_to_view_p99_ms"]
    assert redis["cold_start_s"] > 0
    for op in ("register_kv", "evict_kv"):  # with and without the change record
        assert redis[f"{op}_us"] > 0
        assert redis[f"{op}_unrecorded_us"] > 0
        assert redis[f"{op}_record_ratio"] > 0
    assert "RadixTree" in done.stdout
    assert "view ms" in done.stdout
    assert "server µs exact" in done.stdout
    assert "quick fleet run" in done.stdout


def test_view_is_the_fleet_rows_by_their_earlier_name() -> None:
    from pcr.cli.main import build_parser

    assert build_parser().parse_args(["bench", "--view", "--best-case"]).fleet is True
    assert build_parser().parse_args(["bench"]).fleet is False


def test_best_case_needs_the_fleet_rows() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pcr", "bench", "--best-case"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1
    assert "--best-case: only with --fleet" in done.stderr
    assert "Traceback" not in done.stderr


def test_fleet_bench_refuses_a_sentinel_url() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pcr", "bench", "--fleet", "--redis-url",
         "redis+sentinel://127.0.0.1:9/mymaster"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert "redis+cluster://" in done.stderr


def check_mirror_rows(rows: dict[str, Any]) -> None:
    """The mirror rows are sane figures (never a speed)."""
    assert "error" not in rows, rows
    cycle = rows["engine_cycle"]
    assert cycle["requests"] == 300
    assert cycle["local_us"] > 0
    assert cycle["mirrored_us"] > 0
    assert cycle["redis_us"] > 0
    assert cycle["flushed"] > 0
    visible = rows["publish_to_visible"]
    assert 0 < visible["p50_ms"] <= visible["p99_ms"] <= visible["max_ms"]
    assert rows["flush"]["writes_per_s"] > 0


def check_serve_rows(rows: dict[str, object], served: bool) -> None:
    """The serve rows are sane figures (never a speed), or a clear skip."""
    if not served:
        assert rows == {"skipped": serve_bench.SKIP_REASON}
        return
    assert "error" not in rows, rows.get("error")
    assert rows["namespaces"] == 16
    assert rows["blocks"] == 512
    for name in ("sync_router_p50_ms", "async_router_p50_ms", "async_over_sync"):
        assert isinstance(rows[name], float)
        assert rows[name] > 0
    http = rows["http"]
    assert isinstance(http, dict)
    assert http["offered_per_s"] == serve_bench.QUICK.rate
    assert http["requests"] == int(serve_bench.QUICK.rate * serve_bench.QUICK.seconds)
    assert http["failed"] == 0
    assert http["requests_per_s"] > 0
    assert 0 < http["p50_ms"] <= http["p99_ms"]
    assert http["saturated_per_s"] > 0


def test_serve_rows_are_skipped_without_fastapi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    rows = serve_bench.measure("redis://127.0.0.1:9", quick=True)  # never connects
    assert rows == {"skipped": serve_bench.SKIP_REASON}
    report = _report({"skipped": bridge_bench.SKIP_REASON}, serve=rows)
    assert not [t for t in report["targets"] if "AsyncPrefixRouter" in t["target"]]
    assert f"serve: skipped ({serve_bench.SKIP_REASON})" in bench.format_report(report)


def check_bridge_rows(rows: dict[str, object], bridged: bool) -> None:
    """The bridge's rows are sane figures (never a speed), or a clear skip."""
    if not bridged:
        assert rows == {"skipped": bridge_bench.SKIP_REASON}
        return
    assert "error" not in rows, rows.get("error")
    assert rows["block_size"] == rows["blocks_per_event"] == 16
    assert rows["events_per_batch"] == 8
    assert rows["blocks_per_trial"] == (bridge_bench.QUICK.events + 1) * 16
    for name in ("stored", "removed"):
        runs = rows[f"{name}_runs"]
        assert isinstance(runs, list)
        assert len(runs) == bridge_bench.QUICK.trials
        assert all(isinstance(r, int) and r > 0 for r in runs)
        assert min(runs) <= rows[f"{name}_blocks_per_s"] <= max(runs)
    visible = rows["publish_to_visible"]
    assert isinstance(visible, dict)
    assert visible["samples"] == bridge_bench.QUICK.samples
    assert 0 < visible["p50_ms"] <= visible["p99_ms"] <= visible["max_ms"]
    assert visible["polls_per_sample"] >= 1
    assert visible["background_blocks_per_s"] > 0
    counts = rows["bridge_counts"]
    assert isinstance(counts, dict)
    assert counts["batches"] > 0
    assert counts["writes"] > 0
    # nothing lost, skipped or restarted on the way
    for name in ("orphans", "gaps", "restarts", "bad_messages", "redis_errors"):
        assert counts[name] == 0, name


def test_bridge_rows_are_skipped_without_pyzmq(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq now raises ImportError
    rows = bridge_bench.measure("redis://127.0.0.1:9", quick=True)  # never connects
    assert rows == {"skipped": bridge_bench.SKIP_REASON}
    assert "pip install 'prefix-cache-registry[bridge]'" in rows["skipped"]
    report = _report(rows)
    assert report["targets"] == [t for t in report["targets"] if "bridge" not in t["target"]]
    text = bench.format_report(report)
    assert f"bridge: skipped ({bridge_bench.SKIP_REASON})" in text


def test_a_failed_bridge_run_is_reported_and_misses_its_target() -> None:
    report = _report({"error": "the bridge applied every batch but the hash holds 3 entries"})
    (target,) = [t for t in report["targets"] if "bridge" in t["target"]]
    assert target["measured"] is None
    assert target["limit"] == "≥ 50000"
    assert target["met"] is False
    text = bench.format_report(report)
    assert "bridge: FAILED: the bridge applied every batch" in text


def _report(bridge: dict[str, object], serve: dict[str, object] | None = None) -> dict[str, object]:
    """A report with no operation rows, around ``bridge`` (and ``serve``)."""
    report: dict[str, object] = {
        "quick": True,
        "rows": [],
        "throughput_4_processes_n64": {"match_kv_prefix": 1.0, "HMGET": 1.0},
        "listener_notice_to_free_ms": None,
        "bridge": bridge,
        "serve": serve,
        "seconds": 0.0,
    }
    report["targets"] = bench._targets(report)
    return report


@pytest.mark.redis_server
@pytest.mark.cluster
def test_durability_bench_times_writes_and_confirmed_reads_on_both_deployments() -> None:
    require_redis_server()
    done = subprocess.run(
        [sys.executable, "-m", "pcr", "bench", "--durability", "--quick"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if " us " in line]
    kinds = [(row[0], row[-10]) for row in rows]  # deployment's first word, call
    assert kinds == [
        ("standalone,", "write"),
        ("standalone,", "read"),
        ("cluster", "write"),
        ("cluster", "read"),
    ]
    for row in rows:
        ratio = float(row[-5].rstrip("x"))
        assert ratio > 0
